"""Usage per key: what each key's answered requests cost, kept per hour.

A worker charges every request of a batch it ran its share of the batch's
measured backend time (the call's time split over the requests that ran in
it by their tokens, input and output, one more each, in microseconds, so
the shares add up to the call), with its input
characters and its input and output tokens (the model's), in the transaction
that answers the batch (``WorkerQueue``).
One hash per hour, ``usage:{hour}``, with fields ``{tier}\\n{key}\\n{what}``
(a key id may hold anything but a newline), kept for the policy's
``usage.retention_days``; gateways add what they refused, and the requests
they answered without a worker (from the cache, or joined to one in
flight: no GPU time), per key, a few times a minute. Operators read it
with ``GET /v1/admin/usage``: totals per
key, or a row per key and hour or UTC day (for billing).
"""

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, NamedTuple

import msgspec
from infergate.base.queue.scripts import evalsha
from infergate.base.queue.store import Store
from infergate.base.tiers import TIERS

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
# What is counted per key and hour (a field's last part).
WHAT = ("requests", "input_chars", "gpu_us", "refused", "input_tokens", "output_tokens")
# What a report can be sorted by, most first.
Order = Literal["gpu_ms", "requests", "input_chars", "refused", "input_tokens", "output_tokens"]
# A report's rows: one per key over the whole time, or per key and hour or UTC day.
By = Literal["all", "hour", "day"]
PERIOD_MS = {"hour": HOUR_MS, "day": DAY_MS}


class Charge(NamedTuple):
    """What one key's requests in one batch (or refused at one gateway) cost."""

    key_id: str
    tier: str
    requests: int = 0
    input_chars: int = 0
    gpu_us: int = 0
    refused: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class KeyUsage(msgspec.Struct, frozen=True, omit_defaults=True):
    key_id: str
    tier: str
    requests: int
    input_chars: int
    gpu_ms: float
    refused: int
    input_tokens: int
    output_tokens: int
    # The hour or UTC day the row counts, from its start (ISO 8601); none for totals.
    period: str | None = None


def shares(total_us: int, count: int) -> list[int]:
    """``total_us`` split over ``count`` requests, in whole microseconds that
    add up to it (the first ones get the remainder's microseconds)."""
    if count <= 0:
        return []
    each, extra = divmod(max(total_us, 0), count)
    return [each + (1 if i < extra else 0) for i in range(count)]


def weighted_shares(total_us: int, weights: list[int]) -> list[int]:
    """``total_us`` split in proportion to ``weights`` (each at least 0), in
    whole microseconds that add up to it; evenly if they are all 0."""
    whole = sum(max(w, 0) for w in weights)
    if whole <= 0:
        return shares(total_us, len(weights))
    total = max(total_us, 0)
    out = [total * max(w, 0) // whole for w in weights]
    for i in range(total - sum(out)):
        out[i % len(out)] += 1
    return out


def charge_commands(
    store: Store, charges: Iterable[Charge], now_ms: int, retention_s: int
) -> list[tuple[Any, ...]]:
    """The script that adds ``charges`` to this hour's hash (and keeps it for
    ``retention_s``), for a transaction: ``charge_usage.lua``, which never
    fails it (nothing planted there stops a batch's answer)."""
    args: list[Any] = [retention_s]
    for c in charges:
        head = f"{c.tier}\n{c.key_id}\n"
        for what, amount in zip(WHAT, c[2:], strict=True):
            if amount:
                args += (head + what, amount)
    if len(args) == 1:
        return []
    return [evalsha(store.scripts.charge_usage, [store.keys.usage(now_ms // HOUR_MS)], args)]


async def charge(store: Store, charges: Sequence[Charge], now_ms: int, retention_s: int) -> None:
    """Add ``charges`` now, in one transaction (a gateway's refusals)."""
    commands = charge_commands(store, charges, now_ms, retention_s)
    if commands:
        await store.pipelined.transaction(commands, (store.scripts.charge_usage,))


async def read(
    store: Store | Sequence[Store],
    since_ms: int,
    until_ms: int,
    key_id: str | None = None,
    by: By = "all",
) -> list[KeyUsage]:
    """Every key's usage in the hours from ``since_ms`` to ``until_ms``
    (whole hours: the hour ``since_ms`` falls in counts whole), most GPU time
    first (by period first, when ``by`` an hour or a day), summed over
    ``store`` when it is several (a deployment's shards: a key moved to a
    shard added later has usage on both). A field that does not read as a
    count is skipped (Redis contents are not trusted)."""
    hours = range(since_ms // HOUR_MS, until_ms // HOUR_MS + 1)
    period_ms = PERIOD_MS.get(by)
    totals: dict[tuple[int | None, str, str], list[int]] = {}
    # A day at a time: between two round trips the gateway serves requests
    # (a long read is up to 400 days of hours).
    for one in [store] if isinstance(store, Store) else store:
        for first in range(0, len(hours), 24):
            async with one.redis.pipeline(transaction=False) as pipe:
                some = hours[first : first + 24]
                for hour in some:
                    pipe.hgetall(one.keys.usage(hour))
                for hour, raw in zip(some, await pipe.execute(raise_on_error=False), strict=True):
                    period = None if period_ms is None else hour * HOUR_MS // period_ms * period_ms
                    _add(totals, period, raw, key_id)
    rows = [
        KeyUsage(key, tier, c[0], c[1], c[2] / 1000.0, c[3], c[4], c[5], _iso(period))
        for (period, key, tier), c in totals.items()
    ]
    return sorted(rows, key=lambda r: (r.period or "", -r.gpu_ms, -r.requests, r.key_id))


def _iso(epoch_ms: int | None) -> str | None:
    if epoch_ms is None:
        return None
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="seconds")


def _add(
    totals: dict[tuple[int | None, str, str], list[int]],
    period: int | None,
    raw: Any,
    key_id: str | None,
) -> None:
    if not isinstance(raw, dict):
        return  # (a key of another type)
    for field, value in raw.items():
        parsed = _parse(field, value)
        if parsed is None or (key_id is not None and parsed[1] != key_id):
            continue
        tier, key, what, amount = parsed
        totals.setdefault((period, key, tier), [0] * len(WHAT))[WHAT.index(what)] += amount


def _parse(field: bytes, value: bytes) -> tuple[str, str, str, int] | None:
    """A field as ``charge_usage.lua`` writes it: a tier, a key, a count's
    name, and a count as HINCRBY keeps it (digits, under 2**63)."""
    if not (value.isdigit() and len(value) <= 18):
        return None  # (a sign, spaces, an exponent, a count no charge reaches)
    try:
        tier, rest = field.decode().split("\n", 1)
        key, what = rest.rsplit("\n", 1)
    except (UnicodeDecodeError, ValueError):
        return None
    if tier not in TIERS or not key or what not in WHAT:
        return None
    return tier, key, what, int(value)
