"""An OpenAI-compatible ``/v1/completions`` that takes a list of prompts in
one call, as vLLM, SGLang and llama.cpp's server do, for the ``openai:``
backend's list path (``transformers serve``, which the other tests run,
takes one prompt a call). Its "model" echoes each prompt's words, one
token a word, up to ``max_tokens``; ``usage`` totals the call, as the
protocol has it. A prompt with ``__refuse__`` makes it refuse the call
(400), as an engine refuses a prompt over its context. ``GET /calls``
says how many calls and prompts it has seen.

    python completions_server.py PORT
"""

import sys

from aiohttp import web

seen = {"calls": 0, "prompts": 0}


async def completions(request: web.Request) -> web.Response:
    body = await request.json()
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    seen["calls"] += 1
    seen["prompts"] += len(prompts)
    if any("__refuse__" in p for p in prompts):
        error = {"message": "this prompt is over the context", "type": "invalid_request_error"}
        return web.json_response({"error": error}, status=400)
    choices, out_tokens = [], 0
    for i, prompt in enumerate(prompts):
        words = prompt.split()[: body.get("max_tokens", 16)]
        out_tokens += len(words)
        choices.append(
            {"index": i, "text": " ".join(w.upper() for w in words), "finish_reason": "length"}
        )
    usage = {
        "prompt_tokens": sum(len(p.split()) for p in prompts),
        "completion_tokens": out_tokens,
        "total_tokens": 0,
    }
    return web.json_response(
        {
            "object": "text_completion",
            "model": body.get("model"),
            "choices": choices,
            "usage": usage,
        }
    )


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "echo-words", "object": "model"}]})


async def calls(request: web.Request) -> web.Response:
    return web.json_response(seen)


def main() -> None:
    app = web.Application()
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.get("/v1/models", models),
            web.get("/calls", calls),
        ]
    )
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
