"""The OpenAI-compatible answers: the gateway's responses as a completion, a
chat completion or their Server-Sent Events, and its errors in OpenAI's shape
(with when the official client should not retry).
"""

import msgspec
from infergate.gateway.api import InferenceResponse
from infergate.gateway.errors import ERRORS, JSON, ApiError, Headers
from infergate.gateway.openai_api import Ask

# A 429 or 5xx whose retry-after is longer than this tells the OpenAI client
# not to retry (``x-should-retry: false``): a spent quota costs one call.
RETRY_SOON_MS = 2_000


class Usage(msgspec.Struct):
    """In the backend's tokens: its tokenizer's (transformers), or words (simulated)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Message(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: Message
    finish_reason: str
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: Usage | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatChunk(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChunkChoice]
    usage: Usage | None = None


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None
    request_id: str


class OpenAIError(msgspec.Struct):
    error: OpenAIErrorDetail


def finish_reason(response: InferenceResponse, limit: int | None) -> str:
    """``length`` when the output used all the tokens it was allowed."""
    used = response.metadata.tokens_used if response.metadata is not None else 0
    return "length" if limit is not None and used >= limit else "stop"


def usage_of(responses: list[InferenceResponse]) -> Usage:
    prompt = completion = 0
    for response in responses:
        if response.metadata is not None:
            prompt += response.metadata.input_tokens or 0
            completion += response.metadata.tokens_used
    return Usage(prompt, completion, prompt + completion)


class Reply:
    """One call's answer: its id, time, model and fingerprint, and the
    most tokens each output was allowed (``limit``; None: unknown)."""

    def __init__(
        self, ask: Ask, request_id: str, created: int, responses: list[InferenceResponse],
        limit: int | None,
    ) -> None:  # fmt: skip
        self.ask, self.responses, self.created, self.limit = ask, responses, created, limit
        first = responses[0]
        self.model = first.model or ""
        metadata = first.metadata
        self.fingerprint = metadata.model_version or None if metadata is not None else None
        self.id = f"{'chatcmpl' if ask.chat else 'cmpl'}-{request_id}"

    def body(self) -> tuple[Headers, bytes]:
        """One JSON document, or (``stream``) its events, then ``[DONE]``."""
        if self.ask.stream:
            events = self._chat_events() if self.ask.chat else self._completion_events()
            data = [b"data: " + msgspec.json.encode(event) + b"\n\n" for event in events]
            return list(SSE), b"".join(data) + b"data: [DONE]\n\n"
        return [JSON], msgspec.json.encode(self._document())

    def _document(self) -> msgspec.Struct:
        usage = usage_of(self.responses)
        if self.ask.chat:
            first = self.responses[0]
            choice = ChatChoice(0, Message("assistant", first.output), self._finish(first))
            return ChatCompletion(self.id, "chat.completion", *self._head(), [choice], usage)
        choices = [
            CompletionChoice(i, r.output, self._finish(r)) for i, r in enumerate(self.responses)
        ]
        return Completion(self.id, "text_completion", *self._head(), choices, usage)

    def _chat_events(self) -> list[msgspec.Struct]:
        """The role, the content (the backend answers whole: one chunk), the end."""
        first = self.responses[0]
        events: list[msgspec.Struct] = [
            self._chat_chunk(Delta("assistant", "")),
            self._chat_chunk(Delta(content=first.output)),
            self._chat_chunk(Delta(), self._finish(first)),
        ]
        if self.ask.include_usage:
            events.append(ChatChunk(self.id, CHUNK, *self._head(), [], usage_of(self.responses)))
        return events

    def _chat_chunk(self, delta: Delta, finish: str | None = None) -> ChatChunk:
        choices = [ChunkChoice(0, delta, finish)]
        return ChatChunk(self.id, CHUNK, *self._head(), choices)

    def _completion_events(self) -> list[msgspec.Struct]:
        """Each choice's text, then its end; the usage chunk last if asked."""
        events: list[msgspec.Struct] = []
        for i, response in enumerate(self.responses):
            for text, finish in ((response.output, None), ("", self._finish(response))):
                choice = CompletionChoice(i, text, finish)
                events.append(Completion(self.id, "text_completion", *self._head(), [choice]))
        if self.ask.include_usage:
            usage = usage_of(self.responses)
            events.append(Completion(self.id, "text_completion", *self._head(), [], usage))
        return events

    def _head(self) -> tuple[int, str, str | None]:
        return self.created, self.model, self.fingerprint

    def _finish(self, response: InferenceResponse) -> str:
        return finish_reason(response, self.limit)


CHUNK = "chat.completion.chunk"
SSE = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


# -- errors ------------------------------------------------------------------


def should_retry(error: ApiError) -> bool | None:
    """What ``x-should-retry`` says (None: leave it to the client's rule,
    which retries 408, 409, 429 and 5xx): no where a retry cannot succeed
    soon (a quota that resets later, a failing input, a refused key, a list
    of prompts over a limit as a whole). A list of prompts that failed was
    withdrawn whole (``prompt_lists.py``): it retries as one prompt does."""
    status = error.status
    if error.retryable is False or not (status in (408, 409, 429) or status >= 500):
        return False
    if error.code == "INFERENCE_FAILED":
        return False
    if error.retry_after_ms is not None and error.retry_after_ms > RETRY_SOON_MS:
        return False
    return None


def render_openai(
    error: ApiError, request_id: str, param: str | None
) -> tuple[int, Headers, bytes]:
    """An error in OpenAI's shape (``code`` in its lower case), with
    retry-after, retry-after-ms and x-should-retry."""
    headers = [JSON]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in error.all_headers().items()]
    if should_retry(error) is False:
        headers.append((b"x-should-retry", b"false"))
    detail = OpenAIErrorDetail(
        error.message, ERRORS[error.code][1], error.param or param, error.code.lower(), request_id
    )
    return error.status, headers, msgspec.json.encode(OpenAIError(detail))
