"""A team's batch endpoint to infergate's ``http:`` contract, as a user
would put one in front of a model (docs/backends.md), for the tests:

    POST /infer  {"inputs": [...], "parameters": {...}}  ->  {"outputs": [...], "tokens": [...]}
    GET  /health                                          ->  200

Its model upper-cases (and says how many inputs its call had). Markers in
an input make it misbehave as servers do: ``__400__`` refuses the batch,
``__500__`` fails it, ``__count__`` answers one output too few,
``__slow__`` takes 1.5 s, ``__hang__`` never answers. ``GET /calls``
says how many calls and inputs it has seen.

    python batch_server.py PORT
"""

import asyncio
import sys

from aiohttp import web

calls = {"calls": 0, "inputs": 0, "parameters": 0}


async def infer(request: web.Request) -> web.Response:
    body = await request.json()
    inputs = body["inputs"]
    calls["calls"] += 1
    calls["inputs"] += len(inputs)
    if "parameters" in body:
        calls["parameters"] += 1
    if any("__hang__" in s for s in inputs):
        await asyncio.sleep(3600)
    if any("__slow__" in s for s in inputs):
        await asyncio.sleep(1.5)
    if any("__400__" in s for s in inputs):
        return web.json_response({"error": "this input is not for me"}, status=400)
    if any("__500__" in s for s in inputs):
        return web.json_response({"error": "the model failed"}, status=500)
    outputs = [f"{s.upper()} ({len(inputs)})" for s in inputs]
    if any("__count__" in s for s in inputs):
        outputs.pop()
    return web.json_response({"outputs": outputs, "tokens": [len(o) for o in outputs]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def seen(request: web.Request) -> web.Response:
    return web.json_response(calls)


def main() -> None:
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.add_routes([web.post("/infer", infer), web.get("/health", health), web.get("/calls", seen)])
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
