"""``openai:URL``: an engine that batches by itself (vLLM, SGLang, TGI,
llama.cpp's server, ``transformers serve``), through its OpenAI-compatible
``/v1/completions``.

A batch goes as one call with the list of its prompts where the server
takes one (``prompt_list``: ``auto`` finds out on the first batch), one
call per distinct ``max_tokens`` and temperature; otherwise as one call a
prompt, all at once. Each request's ``max_tokens`` (or the model's
``max_new_tokens``) and temperature are passed on, and its tokens are the
server's own count (``usage``; a list's count is shared among its outputs
by their length, the protocol giving one total). The model is the
``model`` option, or the one the server lists when it lists one. Such an
engine keeps a batch's GPU full only with several in flight: give its
workers ``concurrency``.
"""

import asyncio
from typing import Any

import aiohttp
from infergate.base import logs
from infergate.gpu.backend import (
    BackendError,
    Counted,
    Partial,
    Unusable,
    Upstream,
    UpstreamError,
    check_batch,
    clip_words,
    max_tokens_of,
)
from infergate.gpu.backends.remote import UNAVAILABLE, Answered, Remote

log = logs.get(__name__)


class OpenAIEngineBackend:
    name = "openai"

    def __init__(self, url: str, options: dict[str, Any], max_new_tokens: int) -> None:
        self.base = url if url.endswith("/v1") else url + "/v1"
        self.remote = Remote(url, options, f"{self.base}/models")
        self.upstream: Upstream | None = self.remote
        self.lacks: frozenset[str] = frozenset()
        self.model: str | None = options.get("model")
        self.max_new_tokens = max_new_tokens
        listed = options.get("prompt_list", "auto")
        self.prompt_list: bool | None = None if listed == "auto" else bool(listed)
        self.fingerprint = f"openai/{url}/{self.model or ''}/{max_new_tokens}"

    def infer(self, inputs: list[str]) -> list[str]:
        return self.infer_sampled(inputs, [0.0] * len(inputs))

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]:
        """(Its outputs come ``Counted``; this counts words for anything else.)"""
        return clip_words(text, 0)

    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        check_batch(inputs)
        limits = [n or self.max_new_tokens for n in max_tokens_of(inputs)]
        return self.remote.io.run(self._batch(list(inputs), list(temperatures), limits))

    async def _batch(
        self, prompts: list[str], temperatures: list[float], limits: list[int]
    ) -> list[str]:
        if self.model is None:
            self.model = await self._listed_model(prompts)
        if self.prompt_list is None and len(prompts) > 1:
            self.prompt_list = await self._takes_lists(prompts)
        if self.prompt_list:
            groups: dict[tuple[int, float], list[int]] = {}
            for i, key in enumerate(zip(limits, temperatures, strict=True)):
                groups.setdefault(key, []).append(i)
            calls = [(ids, *key) for key, ids in groups.items()]
        else:
            calls = [([i], limits[i], temperatures[i]) for i in range(len(prompts))]
        outcomes: list[str | BackendError] = [""] * len(prompts)
        results = await asyncio.gather(
            *(self._complete(prompts, ids, n, t) for ids, n, t in calls), return_exceptions=True
        )
        for (ids, _, _), result in zip(calls, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, BackendError):
                raise result
            for j, i in enumerate(ids):
                outcomes[i] = result if isinstance(result, BackendError) else result[j]
        failed = [o for o in outcomes if isinstance(o, BackendError)]
        if not failed:
            return outcomes  # type: ignore[return-value]
        refused = [o for o in failed if not isinstance(o, UpstreamError)]
        if refused and self.prompt_list:
            raise refused[0]  # (a list the server refused: the worker splits the batch)
        if len(failed) == len(outcomes) and not refused:
            raise failed[0]  # (the server did not answer: nothing to split)
        raise Partial(outcomes)  # (each prompt answered apart: each its own outcome)

    async def _complete(
        self, prompts: list[str], ids: list[int], max_tokens: int, temperature: float
    ) -> list[str]:
        """One call for the prompts ``ids``, tried as every remote call is."""
        body = {
            "model": self.model,
            "prompt": prompts[ids[0]] if len(ids) == 1 else [prompts[i] for i in ids],
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        url = f"{self.base}/completions"

        async def attempt(timeout_s: float) -> Any:
            return await self.remote.post(url, body, timeout_s)

        chosen = [prompts[i] for i in ids]
        return _choices(await self.remote.attempts(chosen, attempt), chosen)

    async def _listed_model(self, prompts: list[str]) -> str:
        """The model the server serves, when it lists exactly one."""

        async def attempt(timeout_s: float) -> Any:
            return await self.remote.get(f"{self.base}/models", timeout_s)

        listed = await self.remote.attempts(prompts, attempt)
        data = listed.get("data") if isinstance(listed, dict) else None
        ids = [m.get("id") for m in data or [] if isinstance(m, dict)]
        if len(ids) != 1 or not isinstance(ids[0], str):
            raise Unusable(f"the server lists {len(ids)} models; name one (options: model)")
        log.info("openai.model", model=ids[0])
        return ids[0]

    async def _takes_lists(self, prompts: list[str]) -> bool | None:
        """Whether the server answers a list of prompts with one choice each
        (None: it did not answer; asked again next time)."""
        body = {"model": self.model, "prompt": ["1", "2"], "max_tokens": 1, "temperature": 0.0}
        try:
            answer = await self.remote.post(f"{self.base}/completions", body, 30.0)
            _choices(answer, ["1", "2"])
        except (Answered, BackendError) as exc:
            if isinstance(exc, Answered) and exc.status in UNAVAILABLE:
                return None  # (not now: asked again with the next batch)
            log.info("openai.prompt_list", taken=False, why=str(exc)[:200])
            return False
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        log.info("openai.prompt_list", taken=True)
        return True


def _choices(answer: Any, prompts: list[str]) -> list[str]:
    """Each prompt's text, in order, with the server's token counts."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != len(prompts):
        got = len(choices) if isinstance(choices, list) else 0
        raise BackendError(f"the server returned {got} choices for {len(prompts)} prompts")
    texts: list[str | None] = [None] * len(prompts)
    for position, choice in enumerate(choices):
        index = choice.get("index", position) if isinstance(choice, dict) else None
        text = choice.get("text") if isinstance(choice, dict) else None
        if not isinstance(index, int) or not 0 <= index < len(prompts) or not isinstance(text, str):
            raise BackendError(f"choice {position} is not a completion of a prompt")
        texts[index] = text
    if any(t is None for t in texts):
        raise BackendError("the server answered one prompt twice and another not at all")
    usage = answer.get("usage") if isinstance(answer, dict) else None
    out_total = _int(usage, "completion_tokens")
    in_total = _int(usage, "prompt_tokens")
    done = [t or "" for t in texts]
    if len(done) == 1:
        return [Counted(done[0], out_total, in_total)]
    return [
        Counted(text, n, m)
        for text, n, m in zip(
            done, _shares(out_total, done), _shares(in_total, prompts), strict=True
        )
    ]


def _int(usage: Any, name: str) -> int:
    value = usage.get(name) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and value >= 0 else 0


def _shares(total: int, texts: list[str]) -> list[int]:
    """``total`` shared among ``texts`` by their length (whole numbers, summing to it)."""
    weights = [len(t) + 1 for t in texts]
    whole = sum(weights)
    shares = [total * w // whole for w in weights]
    for i in range(total - sum(shares)):
        shares[i % len(shares)] += 1
    return shares
