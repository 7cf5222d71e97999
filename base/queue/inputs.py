"""Long inputs, kept beside the queue.

A string a Redis script reads costs Redis about a nanosecond a byte each time,
and a queued envelope is read by ``take_*.lua``: decoded, joined into its batch,
pushed and returned. A take of 91 envelopes with inputs of 16,000 characters
cost Redis 13 ms, and every gateway's admit waited behind it. So an input of
at least ``BESIDE_MIN_CHARS`` characters is stored under a key of its own
(``Keys.input``): a plain SET, written just before the admit call that
queues its envelope, in the same round trip, so that no script makes it a
Lua string (which costs Redis a hash of every byte); the admit deletes it
if its request is refused (``admit.lua``). The envelope goes through the
queues with ``input`` null and ``input_key`` set. Code from before this finds such an envelope
unreadable, where an empty input would have run in its place: it drops it,
and the request gets 504 at its deadline. So roll out workers and
dispatchers before gateways.

The worker fetches the inputs of a batch before running it: one MGET, in which
Redis copies no byte into a script. It deletes them in the transaction that
publishes the batch's answer.

``take_*.lua`` deletes the input of a request it drops (cancelled, expired).
Otherwise an input lives until its request's deadline plus ``GRACE_MS``.
Past the deadline nobody runs it: the gateway has answered 504. So a request
dropped elsewhere (its batch dead-lettered, its envelope unreadable) leaves
nothing behind for long.

An input that is missing when its batch runs fails its own request, never
the batch: 503 SERVICE_OVERLOADED, to be retried (not INFERENCE_FAILED, which
says the input itself failed: identical requests collapsed onto it would get
that too). It can be missing because Redis evicted it or lost it, or because
the envelope was planted. A key outside the inputs' prefix is never read.

Jobs keep their input in the envelope: a job may wait in its queue for hours.
"""

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import msgspec
from infergate.base import wire
from infergate.base.keys import Keys

# Shorter inputs stay in the envelope: up to here an input adds less to a take
# than the worker's extra round trip for it would cost.
BESIDE_MIN_CHARS = 1024

# How long an input outlives its request's deadline: the workers' clocks may
# be behind the gateway's.
GRACE_MS = 30_000


class Beside(NamedTuple):
    """An input to store beside its envelope: written just before its admit,
    and deleted if the request is not queued (admit.lua, admits.py)."""

    key: str
    input: str
    ttl_ms: int


def stored(keys: Keys, envelope: wire.Envelope) -> tuple[bytes, Beside | None]:
    """The envelope as it is queued, and its input to store beside it if it
    is long."""
    text = envelope.input
    if text is None or len(text) < BESIDE_MIN_CHARS or envelope.job:
        return wire.encode_queued(envelope), None
    key = keys.input(envelope.gateway, envelope.id)
    ttl_ms = max(1, envelope.deadline_ms - envelope.enqueued_ms) + GRACE_MS
    queued = msgspec.structs.replace(envelope, input=None, input_key=key, input_chars=len(text))
    return wire.encode_queued(queued), Beside(key, text, ttl_ms)


def any_beside(envelopes: Sequence[wire.Envelope]) -> bool:
    return any(e.input is None for e in envelopes)


def input_keys(keys: Keys, envelopes: Sequence[wire.Envelope]) -> list[str]:
    """The keys of the inputs kept beside ``envelopes``, once each: only
    those under the inputs' prefix (a planted envelope names no other key
    to read or delete)."""
    prefix = keys.input_prefix
    return list(
        dict.fromkeys(
            e.input_key
            for e in envelopes
            if e.input is None and e.input_key is not None and e.input_key.startswith(prefix)
        )
    )


def filled(
    envelopes: Sequence[wire.Envelope], fetched: Mapping[str, bytes | None]
) -> tuple[list[wire.Envelope], list[wire.Envelope]]:
    """``envelopes`` with the inputs ``fetched`` (key -> value) in place; and
    those whose input is not there (missing, not text, or never fetched)."""
    ready: list[wire.Envelope] = []
    lost: list[wire.Envelope] = []
    for env in envelopes:
        if env.input is not None:
            ready.append(env)
            continue
        value = None if env.input_key is None else fetched.get(env.input_key)
        try:
            text = value.decode() if isinstance(value, bytes) else None
        except UnicodeDecodeError:
            text = None
        if text is None:
            lost.append(env)
        else:
            ready.append(msgspec.structs.replace(env, input=text))
    return ready, lost
