"""The dead-letter list, as an operator sees it: what each batch was, how
big, and why it was given up on, never its inputs (they are users' data).

A batch lands here after ``workers.max_attempts`` runs that each lost their
worker (it died or hung), or when no worker could read it at all; its
requests were answered 500 when it landed. The list keeps the newest
``DEAD_LETTER_CAP`` batches.
"""

import asyncio

import msgspec
from infergate.base import wire
from infergate.base.queue.store import Store

# The list keeps the newest this many batches (retry.lua trims it).
DEAD_LETTER_CAP = 1_000
# One listing reads at most this many batches, and stops after this many
# bytes: a dead batch can hold 100 inputs of 16 KB, and one read of them all
# would stall Redis for everyone.
MAX_LISTED = 100
LISTING_BUDGET_BYTES = 8 * 1024 * 1024

LOST_WORKERS = "each run lost its worker (it died or hung)"
UNREADABLE = "the batch could not be decoded"


class DeadLetter(msgspec.Struct, frozen=True):
    position: int  # 0 is the newest
    size_bytes: int
    error: str
    batch_id: str | None = None
    dispatcher: str | None = None
    formed_ms: int | None = None
    runs: int | None = None
    requests: int = 0
    request_ids: list[str] = msgspec.field(default_factory=list)
    tiers: dict[str, int] = msgspec.field(default_factory=dict)
    input_chars: list[int] = msgspec.field(default_factory=list)  # sizes, not the inputs


def describe(raw: bytes, position: int) -> DeadLetter:
    try:
        batch, unreadable = wire.decode_batch(raw)
    except msgspec.DecodeError:
        return DeadLetter(position, len(raw), UNREADABLE)
    tiers: dict[str, int] = {}
    for env in batch.envelopes:
        tiers[env.tier] = tiers.get(env.tier, 0) + 1
    error = LOST_WORKERS + (f"; {unreadable} envelopes unreadable" if unreadable else "")
    return DeadLetter(
        position,
        len(raw),
        error,
        batch.id,
        batch.dispatcher,
        batch.formed_ms,
        batch.attempt + 1,
        len(batch.envelopes) + unreadable,
        [e.id for e in batch.envelopes],
        tiers,
        [e.input_chars if e.input is None else len(e.input) for e in batch.envelopes],
    )


async def read(store: Store, limit: int) -> tuple[int, list[DeadLetter]]:
    """How many batches the list holds, and the newest ``limit`` of them (at
    most ``MAX_LISTED``), read one at a time until ``LISTING_BUDGET_BYTES``
    is spent, and described off the event loop."""
    key = store.keys.dead_letter
    total = int(await store.redis.llen(key))
    raws: list[bytes] = []
    spent = 0
    for position in range(min(limit, MAX_LISTED, total)):
        raw: bytes | None = await store.redis.lindex(key, position)  # type: ignore[assignment]
        if raw is None:
            break
        raws.append(raw)
        spent += len(raw)
        if spent >= LISTING_BUDGET_BYTES:
            break
    letters = await asyncio.to_thread(lambda: [describe(r, i) for i, r in enumerate(raws)])
    return total, letters


async def purge(store: Store) -> int:
    """Empty the list; returns how many batches it held."""
    async with store.redis.pipeline(transaction=True) as pipe:
        pipe.llen(store.keys.dead_letter)
        pipe.delete(store.keys.dead_letter)
        total, _ = await pipe.execute()
    return int(total)
