"""Wire formats: envelope, batch, reply and heartbeat, encoded in one place.

Envelopes are JSON so the Lua scripts can read ``id`` and ``deadline_ms``
with ``cjson``; a batch embeds its envelopes' bytes unchanged.
"""

import os
import re
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


class Batch(msgspec.Struct, frozen=True):
    """Envelopes handed to one worker, oldest first within each tier."""

    id: str
    dispatcher: str
    formed_ms: int
    envelopes: list[Envelope]
    attempt: int = 0


class _RawBatch(msgspec.Struct, frozen=True):
    """``Batch`` with its envelopes as raw bytes: built from envelopes as they
    came out of Redis without re-encoding them, and read one envelope at a time."""

    id: str
    dispatcher: str
    formed_ms: int
    envelopes: list[msgspec.Raw]
    attempt: int = 0


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
    draining: bool = False
    # A worker's backend fingerprint (what decides its outputs): the cache's key.
    model: str = ""
    # A gateway's demand since it started: requests admitted, and refused for
    # capacity (503), which the fleet would have served had it been bigger.
    admitted: int = 0
    refused: int = 0


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
_reply_decoder = msgspec.json.Decoder(Reply)
_heartbeat_decoder = msgspec.json.Decoder(Heartbeat)
_scale_signal_decoder = msgspec.json.Decoder(ScaleSignal)
_result_decoder = msgspec.json.Decoder(Result)


def encode(obj: Envelope | Reply | Result | Heartbeat | Batch | ScaleSignal) -> bytes:
    return _json_encoder.encode(obj)


def encode_batch(
    batch_id: str, dispatcher: str, formed_ms: int, envelopes: list[bytes], attempt: int = 0
) -> bytes:
    """Encode a batch from envelopes as they came out of Redis, without
    re-encoding them: the bytes ``take.lua`` writes when it forms a batch
    (tests/test_queue.py holds the two to the same bytes)."""
    return _json_encoder.encode(
        _RawBatch(batch_id, dispatcher, formed_ms, [msgspec.Raw(e) for e in envelopes], attempt)
    )


def retried_batch(data: bytes) -> bytes:
    """The same batch with ``attempt + 1`` (its envelopes' bytes unchanged)."""
    raw = _decode_raw_batch(data)
    return _json_encoder.encode(msgspec.structs.replace(raw, attempt=raw.attempt + 1))


T = TypeVar("T")


def _decode(decoder: "msgspec.json.Decoder[T]", data: bytes) -> T:
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
    raw = _decode_raw_batch(data)
    envelopes = []
    for env in raw.envelopes:
        try:
            envelopes.append(_decode(_envelope_decoder, env))
        except msgspec.DecodeError:
            continue
    batch = Batch(raw.id, raw.dispatcher, raw.formed_ms, envelopes, raw.attempt)
    return batch, len(raw.envelopes) - len(envelopes)


# take.lua checks each envelope with Redis's cjson, which reads more than
# JSON does: NaN, Infinity, 0x10, 01, +1, 1., a raw tab or newline inside a
# string. Redis contents are not trusted, and one such envelope made its
# whole batch unreadable here, every request in it lost with it. Such a
# batch's envelopes are found by their brackets instead (outside strings),
# each to be read on its own. One pass over the bytes (a string, however
# long, in one match of the regex engine: at worst about 40 ns a byte on
# this project's 2-core machine, 0.3 s for 8 MB of escaped quotes), into at
# most _SPLIT_MAX_ENVELOPES (the backend's contract), in at most
# _SPLIT_MAX_MARKS steps of the loop (a real envelope takes about 25: a
# bracket or a string each; 500,000 of them, 0.25 s, well under the
# worker's 1 s heartbeat TTL even on a slower day). Only an envelope of
# more than 500,000 brackets and strings (a megabyte or more of them) still
# makes its batch unreadable.
_SPLIT_MAX_ENVELOPES = 100
_SPLIT_MAX_MARKS = 500_000
_MARK_BETWEEN = re.compile(rb'["\[\]{},]')  # between envelopes: commas split them
_MARK_WITHIN = re.compile(rb'["\[\]{}]')
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_ENVELOPES_FROM = b'"envelopes":['
_QUOTE, _COMMA, _LIST_END = 0x22, 0x2C, 0x5D
_OPENING = b"{["


def _decode_raw_batch(data: bytes) -> _RawBatch:
    try:
        return _decode(_raw_batch_decoder, data)
    except msgspec.DecodeError:
        return _split_batch(data)


def _split_batch(data: bytes) -> _RawBatch:
    """The batch, its envelopes split at the commas between them; raises
    ``msgspec.DecodeError`` if the rest of it is not a batch."""
    at = data.find(_ENVELOPES_FROM)  # (the id before it is a JSON string)
    if at < 0:
        raise msgspec.DecodeError("not a batch")
    start = begin = at = at + len(_ENVELOPES_FROM)
    pieces: list[msgspec.Raw] = []
    depth = 0
    for _ in range(_SPLIT_MAX_MARKS):
        found = (_MARK_WITHIN if depth else _MARK_BETWEEN).search(data, at)
        if found is None:
            break
        mark, at = data[found.start()], found.end()
        if mark == _QUOTE:
            at = _string_end(data, at)
        elif mark in _OPENING:
            depth += 1
        elif depth > 0:  # (a closing bracket: commas are not looked for)
            depth -= 1
        elif mark == _COMMA:  # between two envelopes
            if len(pieces) == _SPLIT_MAX_ENVELOPES:
                break
            pieces.append(msgspec.Raw(data[begin : found.start()]))
            begin = at
        elif mark == _LIST_END:
            if data[begin : found.start()].strip():
                pieces.append(msgspec.Raw(data[begin : found.start()]))
            head = _decode(_raw_batch_decoder, data[:start] + data[found.start() :])
            if head.envelopes:
                break
            return msgspec.structs.replace(head, envelopes=pieces)
        else:
            break
    raise msgspec.DecodeError("not a batch")


def _string_end(data: bytes, at: int) -> int:
    """Just past the quote that ends the string whose first byte is at ``at``."""
    found = _STRING_REST.match(data, at)
    if found is None:
        raise msgspec.DecodeError("not a batch")
    return found.end()


def decode_reply(data: bytes) -> Reply:
    return _decode(_reply_decoder, data)


def decode_result(data: bytes | str) -> Result:
    return _decode(_result_decoder, data.encode() if isinstance(data, str) else data)


def decode_heartbeat(data: bytes) -> Heartbeat:
    return _decode(_heartbeat_decoder, data)


def decode_scale_signal(data: bytes) -> ScaleSignal:
    return _decode(_scale_signal_decoder, data)
