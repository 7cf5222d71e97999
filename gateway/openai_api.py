"""The OpenAI-compatible requests: what /v1/completions and
/v1/chat/completions take, and how a body becomes the gateway's own
requests (one per prompt; a conversation rendered as one input).

A parameter the backend cannot honour is a 400 that names it, never
ignored: OpenAI's own fields are accepted at their neutral values (``n: 1``,
``top_p: 1``, no penalties, no logprobs), and an unknown field is refused as
OpenAI refuses it. ``user`` is accepted and not used.
"""

import dataclasses
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from infergate.gateway.api import MAX_TOKENS, InferenceRequest, Parameters
from infergate.gateway.errors import ApiError
from infergate.policies.schema import ChatTemplate

# The most prompts one /v1/completions call may carry (each is a request).
MAX_PROMPTS = 100

_MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] | None
_Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)] | None
_User = Annotated[str, msgspec.Meta(max_length=256)] | None
_Model = Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool = False  # (nothing is padded here)


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields both routes share."""

    model: _Model = None
    max_tokens: _MaxTokens = None
    temperature: _Temperature = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: _User = None
    # Accepted at their neutral values only (``refuse_unsupported``).
    n: int | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str


# OpenAI's roles, and no other: a role a caller made up, written into a
# template, could forge a turn of another (``user|>...<|system``). Content
# is required, as OpenAI requires it of every message without tool calls
# (which are not served): a message of none, or of no parts, is a mistake
# to name, not an empty turn to run.
class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], msgspec.Meta(min_length=1)]
    name: str | None = None


class ChatRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: _MaxTokens = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None


# -- from a body to the gateway's requests -----------------------------------


@dataclass(frozen=True)
class Ask:
    """An OpenAI call as the gateway's requests: one input per prompt, and
    how to answer."""

    inputs: list[str]
    model: str | None
    parameters: Parameters | None
    stream: bool
    include_usage: bool
    chat: bool
    # A chat's messages, as JSON (role and text each): a backend with a chat
    # template of its own (a transformers tokenizer's) renders them itself.
    conversation: str | None = None

    def requests(self) -> list[InferenceRequest]:
        return [InferenceRequest(text, None, self.model, self.parameters) for text in self.inputs]


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatRequest)
_AT = re.compile(r"at `\$\.([A-Za-z_]+)")
_UNKNOWN = re.compile(r"unknown field `([^`]{1,64})`")
# What a chat template replaces, in one pass (a message's text is never read as template).
_NAMES = re.compile(r"\{role\}|\{content\}")


def invalid(message: str, param: str | None) -> ApiError:
    return ApiError("INVALID_INPUT", message, param=param)


def _decode(decoder: "msgspec.json.Decoder[Any]", body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        where = _UNKNOWN.search(text) or _AT.search(text)
        raise invalid(f"invalid request body: {text}", where.group(1) if where else None) from None
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON in UTF-8", None) from None
    except RecursionError:  # (tools, tool_choice, response_format take any JSON)
        raise invalid("the request body nests too deeply", None) from None


def read_completion(body: bytes) -> Ask:
    req: CompletionRequest = _decode(_completion_decoder, body)
    _refuse_unsupported(req)
    for name, value, neutral in (
        ("logprobs", req.logprobs, None),
        ("echo", req.echo, False),
        ("best_of", req.best_of, 1),
        ("suffix", req.suffix, None),
    ):
        _neutral_only(name, value, neutral)
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not 1 <= len(prompts) <= MAX_PROMPTS:
        raise invalid(f"prompt must be a string or a list of 1-{MAX_PROMPTS} strings", "prompt")
    if not all(prompts):
        raise invalid("prompt must not be empty", "prompt")
    return _ask(req, prompts, req.max_tokens, chat=False)


def read_chat(body: bytes, template: ChatTemplate | None) -> Ask:
    req: ChatRequest = _decode(_chat_decoder, body)
    _refuse_unsupported(req)
    for name, value, neutral in (
        ("logprobs", req.logprobs, False),
        ("top_logprobs", req.top_logprobs, None),
        ("tools", req.tools or None, None),
        ("tool_choice", req.tool_choice, "none"),
    ):
        _neutral_only(name, value, neutral)
    if req.response_format not in (None, {"type": "text"}):
        raise invalid("only the text response format is served", "response_format")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise invalid("give max_completion_tokens or max_tokens, not both", "max_tokens")
    text = render_chat(req.messages, template)
    if not text:
        raise invalid("the conversation renders to an empty input", "messages")
    ask = _ask(req, [text], req.max_completion_tokens or req.max_tokens, chat=True)
    conversation = msgspec.json.encode(
        [{"role": m.role, "content": _text(m)} for m in req.messages]
    ).decode()
    return dataclasses.replace(ask, conversation=conversation)


def _ask(req: _Common, inputs: list[str], max_tokens: int | None, *, chat: bool) -> Ask:
    params = None
    if max_tokens is not None or req.temperature is not None:
        params = Parameters(max_tokens, req.temperature)
    options = req.stream_options
    if options is not None and not req.stream:
        raise invalid("stream_options is only for stream: true", "stream_options")
    include_usage = options is not None and options.include_usage
    return Ask(inputs, req.model, params, req.stream, include_usage, chat)


def _refuse_unsupported(req: _Common) -> None:
    for name, value, neutral in (
        ("n", req.n, 1),
        ("top_p", req.top_p, 1),
        ("stop", req.stop or None, None),
        ("frequency_penalty", req.frequency_penalty, 0),
        ("presence_penalty", req.presence_penalty, 0),
        ("logit_bias", req.logit_bias or None, None),
        ("seed", req.seed, None),
    ):
        _neutral_only(name, value, neutral)


def _neutral_only(name: str, value: object, neutral: object) -> None:
    """``value`` may be absent (None) or the neutral one: the backend has no other."""
    if value is None or value == neutral:
        return
    raise invalid(
        f"{name} {value!r:.40} is not supported by this model server "
        f"(leave it out{'' if neutral is None else f' or send {neutral}'})",
        name,
    )


def render_chat(messages: list[ChatMessage], template: ChatTemplate | None) -> str:
    """The conversation as one input: the policy's template, or the last
    user message's content."""
    if template is None:
        for message in reversed(messages):
            if message.role == "user":
                return _text(message)
        raise invalid("the conversation has no user message", "messages")
    parts = [template.prefix]
    for message in messages:
        parts.append(_fill(template.message, message.role, _text(message)))
    parts.append(template.suffix)
    return "".join(parts)


def _fill(template: str, role: str, content: str) -> str:
    values = {"{role}": role, "{content}": content}
    return _NAMES.sub(lambda m: values[m.group(0)], template)


def _text(message: ChatMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    if any(part.type != "text" for part in content):
        raise invalid("only text content parts are served", "messages")
    return "".join(part.text for part in content)
