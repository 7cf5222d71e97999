"""Forming a batch (``take.lua``), as its two callers share it: a dispatcher
holding an idle worker's credit, and a worker that has just answered its
batch and forms its next one itself. Also the batching rule that
dispatchers publish for the workers: they read the policy and the fleet,
workers read neither."""

import os
from typing import Any, Literal

import msgspec
from infergate.base import logs
from infergate.base.keys import Keys

log = logs.get(__name__)

# A fleet with no synchronous batch for this long runs jobs without headroom.
JOBS_QUIET_MS = 2_000

# How long a published rule holds; dispatchers refresh it well within that.
# Once it lapses (no dispatcher left), workers offer their credits instead.
RULE_TTL_MS = 5_000

Mode = Literal["dispatch", "dispatch+envelopes", "worker", "join", "withdrawn"]


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


def new_batch_id() -> str:
    return os.urandom(6).hex()


def take_keys(
    keys: Keys, own: str, eighth: str, last_step: str | None = None, batches: str | None = None
) -> list[str]:
    """``take.lua``'s keys: ``own`` is the dispatcher's credits list or the
    worker's processing list; ``eighth`` the credit's heartbeat or the rule;
    ``last_step`` the worker's last step token (a dispatcher has none)."""
    return [
        own,
        keys.stats,
        keys.doorbell,
        keys.cancelled,
        keys.last_dispatch,
        keys.ready,
        keys.jobs_queued,
        eighth,
        batches or keys.batches,
        last_step or own,
        *keys.queues,
        *keys.job_queues,
        *keys.fair_queues,
        *keys.fair_states,
    ]


def take_args(
    keys: Keys,
    mode: Mode,
    now_ms: int,
    credit: str,
    batch_id: str,
    former: str,
    ran: bytes = b"",
    step: str = "",
    ack: bool = False,
    rule: Rule | None = None,
) -> list[Any]:
    head: list[Any] = [mode, now_ms, credit, batch_id, former, keys.prefix, ran, step]
    head.append("ack" if ack else "")
    if rule is None:
        return head
    return [*head, rule.n, rule.interval_ms, rule.headroom, rule.quiet_ms, *rule.min_slots]


def take_result(raw: Any) -> TakeResult:
    envelopes, expired, cancelled, malformed, wait_ms, jobs, gone, size, lost, batch = raw
    return TakeResult(
        int(size),
        list(envelopes),
        int(expired),
        int(cancelled),
        int(malformed),
        int(wait_ms),
        int(jobs),
        bool(gone),
        bool(lost),
        batch or None,
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
