"""Replies: how a batch's results reach those who wait for them.

One message per gateway per batch on ``reply:{gateway}``; a job's result is
stored on its record instead (``finish_jobs.lua``), for its owner to fetch
from any gateway. Delivering is written once, here, for every path that
answers a batch: a worker that ran it, a worker that could not read it, and
the reaper that gave up on it.
"""

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from infergate.base import wire
from infergate.base.queue.scripts import evalsha
from infergate.base.queue.store import Store
from redis.asyncio.client import Pipeline


def group_by_gateway(
    results: Iterable[tuple[str, wire.Result]],
) -> dict[str, wire.Reply]:
    """``(gateway id, result)`` pairs -> one ``Reply`` per gateway."""
    by_gateway: dict[str, list[wire.Result]] = defaultdict(list)
    for gateway_id, result in results:
        by_gateway[gateway_id].append(result)
    return {gateway_id: wire.Reply(rs) for gateway_id, rs in by_gateway.items()}


def failure_replies(
    batch: wire.Batch, code: str, message: str, worker_id: str, now_ms: int
) -> dict[str, wire.Reply]:
    """Every request of ``batch`` answered with the same error."""
    return group_by_gateway(
        (
            wire.destination(env),
            wire.Result(
                id=env.id,
                batch_id=batch.id,
                batch_size=len(batch.envelopes),
                worker=worker_id,
                queue_ms=max(0, now_ms - env.enqueued_ms),
                infer_ms=0,
                error=wire.ErrorInfo(code, message),
            ),
        )
        for env in batch.envelopes
    )


def reply_commands(
    store: Store, replies: Mapping[str, wire.Reply], now_ms: int
) -> list[tuple[Any, ...]]:
    """One PUBLISH per gateway, and the storing of the jobs' results, as
    commands for one transaction (running them twice publishes a
    duplicate, which gateways ignore, and stores a job's result again)."""
    keys = store.keys
    commands: list[tuple[Any, ...]] = [
        ("PUBLISH", keys.reply_channel(gateway_id), wire.encode(reply))
        for gateway_id, reply in replies.items()
        if gateway_id != wire.JOBS
    ]
    jobs = replies.get(wire.JOBS)
    if jobs is not None and jobs.results:
        commands.append(
            evalsha(
                store.scripts.finish_jobs,
                [keys.job(r.id) for r in jobs.results],
                [
                    keys.jobs_done,
                    now_ms,
                    *(wire.encode(r) for r in jobs.results),
                    *("failed" if r.error else "succeeded" for r in jobs.results),
                ],
            )
        )
    return commands


def deliver_replies(
    pipe: Pipeline, store: Store, replies: Mapping[str, wire.Reply], now_ms: int
) -> None:
    """``reply_commands`` queued on ``pipe`` (the caller executes it with
    ``scripts.execute``)."""
    for command in reply_commands(store, replies, now_ms):
        pipe.execute_command(*command)
