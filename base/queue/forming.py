"""Forming a batch (``take_*.lua``), as its two callers share it: a dispatcher
holding an idle worker's credit, and a worker that has just answered its
batch and forms its next one itself. Also the batching rule that
dispatchers publish for the workers: they read the policy and the fleet,
workers read neither."""

import os
from typing import Any, Literal, NamedTuple

import msgspec
from infergate.base import logs
from infergate.base.keys import Keys

log = logs.get(__name__)

# A fleet with no synchronous batch for this long runs jobs without headroom.
JOBS_QUIET_MS = 2_000

# How long a published rule holds; dispatchers refresh it well within that.
# Once it lapses (no dispatcher left), workers offer their credits instead.
RULE_TTL_MS = 5_000

# The take entries (lua/take_*.lua), one a caller: each names its own keys
# after the six every take has, then the tiers' keys.
Entry = Literal["take_dispatch", "take_worker", "take_join", "take_withdrawn"]


class Rule(msgspec.Struct, frozen=True):
    """What the policy and the fleet say about forming batches now."""

    n: int
    interval_ms: int
    headroom: int
    quiet_ms: int = JOBS_QUIET_MS
    min_slots: tuple[int, ...] = ()


class TakeResult(msgspec.Struct, frozen=True):
    # The batch formed: its size, and its envelopes when asked for.
    size: int
    envelopes: list[bytes]
    expired: int
    cancelled: int
    malformed: int
    # > 0: pacing says come back after this many ms (nothing was taken).
    wait_ms: int = 0
    # How many of the envelopes are jobs.
    jobs: int = 0
    # The credit's worker has gone (stopped, or died) while the credit was held.
    worker_gone: bool = False
    # The credit is no longer this dispatcher's (the reaper took it back).
    credit_lost: bool = False
    # 'worker': the batch now in the worker's processing list, if any.
    batch: bytes | None = None
    # 'dispatch': nothing waited at all, so the credit went back onto ready
    # (a gateway hands the next request straight to its worker).
    offered: bool = False


def new_batch_id() -> str:
    return os.urandom(6).hex()


class TakeCall(NamedTuple):
    """One take: which entry, its keys and its arguments, as the entry's
    header lists them (tests/test_scripts.py runs each against its script)."""

    entry: Entry
    keys: list[str]
    args: list[Any]


def _take(
    entry: Entry,
    keys: Keys,
    own: list[str],
    now_ms: int,
    credit: str,
    former: str,
    args: list[Any],
    batch_id: str = "",
) -> TakeCall:
    every = [
        keys.stats,
        keys.doorbell,
        keys.cancelled,
        keys.last_dispatch,
        keys.ready,
        keys.jobs_queued,
    ]
    tiers = [
        *keys.queues,
        *keys.job_queues,
        *keys.fair_queues,
        *keys.fair_states,
        *keys.job_fair_queues,
        *keys.job_fair_states,
    ]
    head = [now_ms, credit, batch_id or new_batch_id(), former, keys.prefix]
    return TakeCall(entry, [*every, *own, *tiers], [*head, *args])


def dispatch_take(
    keys: Keys,
    dispatcher_id: str,
    credit: str,
    batch_id: str,
    now_ms: int,
    rule: Rule,
    envelopes: bool,
) -> TakeCall:
    """A dispatcher's, with the credit it holds (``take_dispatch.lua``)."""
    own = [keys.credits(dispatcher_id), keys.heartbeat("worker", credit), keys.handoff(credit)]
    args = [1 if envelopes else 0, rule.n, rule.interval_ms, rule.headroom, rule.quiet_ms]
    args += rule.min_slots
    return _take("take_dispatch", keys, own, now_ms, credit, dispatcher_id, args, batch_id)


def worker_take(
    keys: Keys, worker_id: str, now_ms: int, ran: bytes, step: str, ack: bool
) -> TakeCall:
    """A worker's next batch, beside the one it ran (``take_worker.lua``)."""
    own = [keys.processing(worker_id), keys.batch_rule, keys.batches, keys.last_step(worker_id)]
    args = [ran, step, "ack" if ack else ""]
    return _take("take_worker", keys, own, now_ms, worker_id, worker_id, args)


def credit_take(
    keys: Keys,
    entry: Literal["take_join", "take_withdrawn"],
    worker_id: str,
    now_ms: int,
    mark_ms: int = 0,
    room: int = 0,
) -> TakeCall:
    """A worker's idle credit as a call of another shard's batch starts
    (``take_join.lua``: a batch of at most ``room``, or the credit withdrawn
    for ``mark_ms``) and ends (``take_withdrawn.lua``: given back)."""
    own = [keys.batch_rule, keys.handoff(worker_id), keys.withdrawn(worker_id)]
    args = [mark_ms, room] if entry == "take_join" else []
    return _take(entry, keys, own, now_ms, worker_id, worker_id, args)


# A take's reply, in the order take_form.lua's take_reply writes it.
TAKE_REPLY = (
    "envelopes",
    "expired",
    "cancelled",
    "malformed",
    "wait_ms",
    "jobs",
    "worker_gone",
    "size",
    "credit_lost",
    "batch",
    "offered",
)


def take_result(raw: Any) -> TakeResult:
    fields = dict(zip(TAKE_REPLY, raw, strict=True))
    return TakeResult(
        size=int(fields["size"]),
        envelopes=list(fields["envelopes"]),
        expired=int(fields["expired"]),
        cancelled=int(fields["cancelled"]),
        malformed=int(fields["malformed"]),
        wait_ms=int(fields["wait_ms"]),
        jobs=int(fields["jobs"]),
        worker_gone=bool(fields["worker_gone"]),
        credit_lost=bool(fields["credit_lost"]),
        batch=fields["batch"] or None,
        offered=bool(fields["offered"]),
    )


def encode_rule(rule: Rule) -> bytes:
    return msgspec.json.encode(rule)


def log_drops(taken: TakeResult) -> None:
    """What a take dropped before any worker saw it, whoever took."""
    if taken.expired or taken.cancelled or taken.malformed:
        log.info(
            "take.dropped",
            expired=taken.expired,
            cancelled=taken.cancelled,
            malformed=taken.malformed,
        )
