"""Backends of a known batch time, to measure what each kind of backend
costs infergate against the simulated one (docs/performance.md): a Python
batch function, and one server that speaks infergate's ``http:`` contract
(``POST /infer``) and OpenAI's ``/v1/completions`` (a prompt or a list),
each answering a call in ``latency_ms`` whatever its size, as the
simulated backend does. Outputs contain their input, as the load
generator checks.

    python -m infergate.loadtest.reference_backends --port 9100 --latency-ms 100
    infergate up --backend http:http://127.0.0.1:9100/infer
    infergate up --backend openai:http://127.0.0.1:9100/v1
    INFERGATE_REFERENCE_LATENCY_MS=100 infergate up \\
        --backend python:infergate.loadtest.reference_backends:batchstring
"""

import argparse
import asyncio
import os
import time
from typing import Any

LATENCY_S = float(os.environ.get("INFERGATE_REFERENCE_LATENCY_MS", "100")) / 1000.0


def batchstring(inputs: list[str]) -> list[str]:
    """The design documents' function: one batch time a call."""
    time.sleep(LATENCY_S)
    return [f"ref: {s}" for s in inputs]


def _app(latency_s: float) -> Any:
    from aiohttp import web

    async def infer(request: web.Request) -> web.Response:
        inputs = (await request.json())["inputs"]
        await asyncio.sleep(latency_s)
        return web.json_response({"outputs": [f"ref: {s}" for s in inputs]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body["prompt"]
        prompts = prompt if isinstance(prompt, list) else [prompt]
        await asyncio.sleep(latency_s)
        choices = [{"index": i, "text": f"ref: {p}"} for i, p in enumerate(prompts)]
        usage = {"prompt_tokens": len(prompts), "completion_tokens": 2 * len(prompts)}
        return web.json_response({"choices": choices, "usage": usage})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "reference"}]})

    app = web.Application()
    app.add_routes(
        [
            web.post("/infer", infer),
            web.post("/v1/completions", completions),
            web.get("/v1/models", models),
        ]
    )
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infergate.loadtest.reference_backends")
    p.add_argument("--port", type=int, default=9100)
    p.add_argument("--latency-ms", type=float, default=100.0)
    args = p.parse_args(argv)
    from aiohttp import web

    web.run_app(
        _app(args.latency_ms / 1000.0),
        host="127.0.0.1",
        port=args.port,
        print=None,
        access_log=None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
