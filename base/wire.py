"""Wire formats: envelope, batch, reply and heartbeat, encoded in one place.

Envelopes are JSON so the Lua scripts can read ``id`` and ``deadline_ms``
with ``cjson``; a batch embeds its envelopes' bytes unchanged.
"""

import os
from typing import TypeVar

import msgspec


class Envelope(msgspec.Struct, frozen=True, omit_defaults=True):
    """One accepted request, as it waits in Redis."""

    id: str
    gateway: str
    tier: str
    key_id: str
    # None: kept beside the queue, under ``input_key`` (``queue/inputs.py``).
    # (So an envelope whose input waits there is unreadable to code from
    # before it, which would run an empty input: dropped, never answered.)
    input: str | None
    enqueued_ms: int
    deadline_ms: int
    # W3C traceparent of the request's span, when tracing is on.
    trace: str | None = None
    # An asynchronous job: its result is stored (job:{id}), not sent to ``gateway``.
    job: bool = False
    # With the result cache on: the input's digest (in its sharing scope) and
    # how long the worker keeps the answer under it.
    cache_key: str | None = None
    cache_ttl_ms: int = 0
    # A long input is kept beside the queue, under this key, and ``input`` is
    # None: no script copies it on its way to a worker (``queue/inputs.py``).
    input_key: str | None = None
    input_chars: int = 0  # (its length, when it is kept beside)
    # The request's parameters (``parameters`` in its body): the most tokens
    # of its output (0: the model's own bound), and its sampling temperature
    # (0: the model's greedy decoding; above 0 it takes a slot of its own).
    max_tokens: int = 0
    temperature: float = 0.0
    # Count the input's tokens too (the OpenAI routes' usage).
    count_input: bool = False
    # A chat's messages, as JSON: a backend with a chat template of its own
    # renders them in place of ``input`` (the gateway's rendering).
    conversation: str | None = None


class Batch(msgspec.Struct, frozen=True):
    """Envelopes handed to one worker, oldest first within each tier."""

    id: str
    dispatcher: str
    formed_ms: int
    envelopes: list[Envelope]
    attempt: int = 0


class _BatchHead(msgspec.Struct, frozen=True):
    """A batch less its envelopes: the line before them in its frame, with
    each envelope's length in bytes, in order."""

    id: str
    dispatcher: str
    formed_ms: int
    attempt: int = 0
    lengths: list[int] = []


class _RawBatch(msgspec.Struct, frozen=True):
    """Version 1 of a batch (before the frame): one JSON document, its
    envelopes as raw bytes. Still read, so that a rolling upgrade loses
    nothing (docs/operations.md: upgrades)."""

    id: str
    dispatcher: str
    formed_ms: int
    envelopes: list[msgspec.Raw]
    attempt: int = 0


# A batch as it sits in Redis (version 2, written by take_*.lua and
# ``encode_batch``): this line, the head as JSON on a line of its own (with
# each envelope's length), then the envelopes' bytes as they came off their
# queues, one after the other:
#   infergate-batch/2\n{"id":..,"dispatcher":..,"formed_ms":..,"attempt":0,"lengths":[..]}\n
#   <envelope><envelope>...
# No byte of an envelope is read to find where it ends, so a planted one (what
# Redis's cjson reads but JSON does not, a bracket that would end a list) is
# only ever itself: unreadable, and dropped alone.
BATCH_FRAME = b"infergate-batch/2\n"


class ErrorInfo(msgspec.Struct, frozen=True):
    code: str
    message: str


class Result(msgspec.Struct, frozen=True, omit_defaults=True):
    """The outcome of one request."""

    id: str
    batch_id: str
    batch_size: int
    worker: str
    queue_ms: int
    infer_ms: int
    output: str | None = None
    error: ErrorInfo | None = None
    # How it was served: "model" (its own slot of a backend call), "collapsed"
    # (an identical input's slot), or "cache" (set by the gateway).
    served_by: str = "model"
    # The output's length in the backend's tokens (its tokenizer's, or words).
    tokens: int = 0
    # The input's, when its envelope asked (``count_input``).
    input_tokens: int = 0
    # Its share of the backend call's time (usage, a GPU budget's settling),
    # by its tokens weighed (``weighed``); the call's tokens (input and
    # output, one more each), plain and weighed (0: as plain, by a worker
    # that weighs none), and the weight of a new token written alone (the
    # most one of its request's new tokens weighed).
    gpu_us: int = 0
    call_tokens: int = 0
    weighed_call_tokens: int = 0
    new_token_weight: float = 1.0


# A new token weighs at least an input token (writing one reads it too),
# at most this many (``gpu/token_weight.py``).
MOST_NEW_TOKEN_WEIGHT = 64.0


def weighed(
    input_tokens: int,
    new_tokens: int,
    new_token_weight: float,
    step_share: float = 0.0,
    step_weight: float = 0.0,
) -> int:
    """A request's tokens as input tokens' worth, its new tokens weighed,
    and its share of its call's decoding steps where they are weighed
    apart (``gpu/token_weight.py``); one more (an empty one has a share of
    its call too). A request alone takes all its steps: its new tokens
    weighed by the two weights' sum."""
    return 1 + input_tokens + round(new_token_weight * new_tokens + step_weight * step_share)


def held_weight(weight: float) -> float:
    """A new token's weight held to 1-``MOST_NEW_TOKEN_WEIGHT`` (NaN, as
    anything else planted in a result, weighs one)."""
    if weight > MOST_NEW_TOKEN_WEIGHT:
        return MOST_NEW_TOKEN_WEIGHT
    return weight if weight >= 1.0 else 1.0


def new_job_id() -> str:
    """128 random bits: a job id cannot be guessed (and says nothing)."""
    return os.urandom(16).hex()


# Where a job's result goes instead of a gateway's reply channel (``replies.py``).
JOBS = "~jobs"


def input_of(env: Envelope) -> str:
    """The input of an envelope whose input is in it (a worker fetches the
    inputs kept beside the queue before it runs a batch)."""
    if env.input is None:
        raise ValueError(f"the input of {env.id!r} was not fetched")
    return env.input


def destination(env: Envelope) -> str:
    """The reply channel's gateway for a request; ``JOBS`` for a job."""
    return JOBS if env.job else env.gateway


class Reply(msgspec.Struct, frozen=True):
    """One message per gateway per batch."""

    results: list[Result]


class Heartbeat(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a process says about itself each beat (the value of its heartbeat key)."""

    role: str
    id: str
    started_ms: int
    beat_ms: int
    busy: bool = False
    batches_done: int = 0
    requests_done: int = 0
    # Measured: requests/s delivered over the last window, and the batch time
    # (its capacity follows from the live policy's batch size: see fleet.py).
    delivered_rps: float = 0.0
    batch_ms: float = 0.0
    # ...and a batch of one input's time (0: not said, as by a worker of an
    # earlier version: a full batch's then stands for every batch).
    one_ms: float = 0.0
    draining: bool = False
    # A worker's backend fingerprint (what decides its outputs): the cache's key.
    model: str = ""
    # What its backend cannot do for a request ("sampling", "max_tokens": the
    # gateway refuses those while every worker of the model lacks them),
    # whether the server a remote backend calls is down (it takes no work
    # meanwhile, and admission counts it out), and how many workers (slots)
    # its process runs.
    lacks: list[str] = []
    upstream_down: bool = False
    slots: int = 1
    # A worker's fitted weights of a new token and a decoding step against
    # an input token (none before its first fit), and the full batch time
    # its warm-up measured: a worker that starts on the same model and
    # warms up as fast (the same device) begins from them (gpu/token_weight.py).
    token_weights: list[float] = []
    warm_ms: float = 0.0
    # A gateway's demand since it started: requests admitted, and refused for
    # capacity (503), which the fleet would have served had it been bigger.
    admitted: int = 0
    refused: int = 0
    # What it admitted per tier (tiers.TIERS order): the tiers' arrival rates,
    # which admission needs for the capacity the tiers above leave.
    admitted_by_tier: list[int] = []


class ScaleSignal(msgspec.Struct, frozen=True):
    """How many workers the fleet needs, and what that was computed from."""

    desired_workers: int
    demand_rps: float
    worker_capacity_rps: float
    target_utilization: float
    workers: int
    at_ms: int


_json_encoder = msgspec.json.Encoder()
_envelope_decoder = msgspec.json.Decoder(Envelope)
_raw_batch_decoder = msgspec.json.Decoder(_RawBatch)
_batch_head_decoder = msgspec.json.Decoder(_BatchHead)
_reply_decoder = msgspec.json.Decoder(Reply)
_heartbeat_decoder = msgspec.json.Decoder(Heartbeat)
_scale_signal_decoder = msgspec.json.Decoder(ScaleSignal)
_result_decoder = msgspec.json.Decoder(Result)


def encode(obj: Envelope | Reply | Result | Heartbeat | Batch | ScaleSignal) -> bytes:
    return _json_encoder.encode(obj)


_NO_INPUT = b',"input":null'


def encode_queued(envelope: Envelope) -> bytes:
    """An envelope as it is queued: the same JSON object, its input last, so
    that ``take_*.lua`` reads what it checks (every field before the input)
    without reading the input. (The first ``,"input":`` is the field's: a
    JSON string holds no bare quote.)"""
    head = _json_encoder.encode(msgspec.structs.replace(envelope, input=None))
    at = head.index(_NO_INPUT)
    return b"".join(
        (
            head[:at],
            head[at + len(_NO_INPUT) : -1],
            b',"input":',
            _json_encoder.encode(envelope.input),
            b"}",
        )
    )


def encode_batch(
    batch_id: str, dispatcher: str, formed_ms: int, envelopes: list[bytes], attempt: int = 0
) -> bytes:
    """Frame a batch from envelopes as they came out of Redis, without
    re-encoding them: the bytes ``take_*.lua`` writes when it forms a batch
    (tests/test_queue.py holds the two to the same bytes)."""
    head = _BatchHead(batch_id, dispatcher, formed_ms, attempt, [len(e) for e in envelopes])
    return b"".join([BATCH_FRAME, _json_encoder.encode(head), b"\n", *envelopes])


def retried_batch(data: bytes) -> bytes:
    """The same batch with ``attempt + 1`` (its envelopes' bytes unchanged),
    in the version it came in."""
    if not data.startswith(BATCH_FRAME):
        raw = _decode(_raw_batch_decoder, data)
        return _json_encoder.encode(msgspec.structs.replace(raw, attempt=raw.attempt + 1))
    head, end = _head_of(data)
    head = msgspec.structs.replace(head, attempt=head.attempt + 1)
    return BATCH_FRAME + _json_encoder.encode(head) + b"\n" + data[end:]


T = TypeVar("T")


def _decode(decoder: "msgspec.json.Decoder[T]", data: bytes | memoryview | msgspec.Raw) -> T:
    """Every decode of bytes from Redis: anything unreadable, however it is
    unreadable (msgspec raises RecursionError for deeply nested JSON, and
    UnicodeDecodeError for a string that is not UTF-8), is a
    ``msgspec.DecodeError``, which every caller handles."""
    try:
        return decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("nested too deeply") from None
    except UnicodeDecodeError:
        raise msgspec.DecodeError("a string that is not UTF-8") from None


def decode_envelope(data: bytes) -> Envelope:
    return _decode(_envelope_decoder, data)


def decode_batch(data: bytes) -> tuple[Batch, int]:
    """The batch with every envelope that decodes, and how many did not.
    Raises ``msgspec.DecodeError`` only if the batch itself is unreadable."""
    head, raws = _split_batch(data)
    envelopes = []
    for raw in raws:
        try:
            envelopes.append(_decode(_envelope_decoder, raw))
        except msgspec.DecodeError:
            continue
    batch = Batch(head.id, head.dispatcher, head.formed_ms, envelopes, head.attempt)
    return batch, len(raws) - len(envelopes)


def _split_batch(data: bytes) -> tuple[_BatchHead, list[memoryview] | list[msgspec.Raw]]:
    """A batch's head, and its envelopes' bytes (not copied)."""
    if not data.startswith(BATCH_FRAME):
        raw = _decode(_raw_batch_decoder, data)
        return _BatchHead(raw.id, raw.dispatcher, raw.formed_ms, raw.attempt), raw.envelopes
    head, at = _head_of(data)
    lengths = head.lengths
    if sum(lengths) != len(data) - at or (lengths and min(lengths) < 0):
        raise msgspec.DecodeError("a batch whose frame is broken")
    view = memoryview(data)
    envelopes = []
    for length in lengths:
        envelopes.append(view[at : at + length])
        at += length
    return head, envelopes


def _head_of(data: bytes) -> tuple[_BatchHead, int]:
    """A framed batch's head, and where its envelopes begin."""
    end = data.find(b"\n", len(BATCH_FRAME))
    if end < 0:
        raise msgspec.DecodeError("a batch without its head")
    return _decode(_batch_head_decoder, data[len(BATCH_FRAME) : end]), end + 1


def decode_reply(data: bytes) -> Reply:
    return _decode(_reply_decoder, data)


def decode_result(data: bytes | str) -> Result:
    return _decode(_result_decoder, data.encode() if isinstance(data, str) else data)


def decode_heartbeat(data: bytes) -> Heartbeat:
    return _decode(_heartbeat_decoder, data)


def decode_scale_signal(data: bytes) -> ScaleSignal:
    return _decode(_scale_signal_decoder, data)
