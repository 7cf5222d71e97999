"""The dead-letter list, as an operator sees it: what each batch was, how
big, and why it was given up on, never its inputs (they are users' data).

A batch lands here after ``workers.max_attempts`` runs that each lost their
worker (it died or hung), or when no worker could read it at all; its
requests were answered 500 when it landed. The list keeps the newest
``DEAD_LETTER_CAP`` batches.
"""

import msgspec
from infergate.base import wire
from infergate.base.queue.store import Store

LOST_WORKERS = "each run lost its worker (it died or hung)"
UNREADABLE = "the batch could not be decoded"


class DeadLetter(msgspec.Struct, frozen=True):
    position: int  # 0 is the newest
    bytes: int
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
        [len(e.input) for e in batch.envelopes],
    )


async def read(store: Store, limit: int) -> tuple[int, list[DeadLetter]]:
    """How many batches the list holds, and the newest ``limit`` of them."""
    async with store.redis.pipeline(transaction=True) as pipe:
        pipe.llen(store.keys.dead_letter)
        pipe.lrange(store.keys.dead_letter, 0, limit - 1)
        total, raws = await pipe.execute()
    return int(total), [describe(raw, i) for i, raw in enumerate(raws)]


async def purge(store: Store) -> int:
    """Empty the list; returns how many batches it held."""
    async with store.redis.pipeline(transaction=True) as pipe:
        pipe.llen(store.keys.dead_letter)
        pipe.delete(store.keys.dead_letter)
        total, _ = await pipe.execute()
    return int(total)
