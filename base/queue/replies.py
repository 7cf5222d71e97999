"""Replies: how a batch's results reach the gateways that wait for them.

One message per gateway per batch on ``reply:{gateway}``. Publishing is
written once, here, for every path that answers a batch: a worker that ran
it, a worker that could not read it, and the reaper that gave up on it.
"""

from collections import defaultdict
from collections.abc import Iterable, Mapping

from infergate.base import wire
from infergate.base.keys import Keys
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
            env.gateway,
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


def publish_replies(pipe: Pipeline, keys: Keys, replies: Mapping[str, wire.Reply]) -> None:
    """Queue one PUBLISH per gateway on ``pipe`` (the caller executes it)."""
    for gateway_id, reply in replies.items():
        pipe.publish(keys.reply_channel(gateway_id), wire.encode(reply))
