"""A do-nothing HTTP server on the benchmark's route, the yardstick of the
stack's CPU a request (``sweep --echo``): it reads the body, checks a key
is given and answers the input, as cheaply as an asyncio server in Python
does, so the stack's ratio to it is what the stack adds to that."""

import argparse

from aiohttp import web


async def infer(request: web.Request) -> web.Response:
    body = await request.json()
    if not request.headers.get("Authorization", "").startswith("Bearer "):
        return web.json_response({"error": {"code": "UNAUTHENTICATED"}}, status=401)
    answer = {"request_id": "echo", "output": body.get("input", ""), "tier": "free"}
    return web.json_response({**answer, "latency_ms": 0.0, "batch_size": 1, "queue_ms": 0})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infergate.loadtest.echo_server")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    app = web.Application()
    app.router.add_post("/v1/inference", infer)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
