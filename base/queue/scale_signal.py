"""The autoscaling signal in Redis: written by dispatchers (each computes the
same from the fleet's heartbeats, the last write wins), read by
``infergate up`` to scale its own workers. It expires, so a scaler never
follows a signal no dispatcher is computing any more."""

import msgspec
import redis
from infergate.base import wire
from infergate.base.keys import Keys
from infergate.base.queue import redis_url
from infergate.base.queue.store import Store

SIGNAL_TTL_MS = 5_000


async def hold_peak(
    store: Store, dispatcher_id: str, needed: int, now_ms: int, hold_ms: int
) -> int:
    """Record this dispatcher's reading and return the highest of every
    dispatcher's readings over the last ``hold_ms``: the hold lives in Redis,
    so dispatchers agree, and one that restarts forgets nothing."""
    history = store.keys.scale_history
    _, _, readings, _ = await store.pipelined.transaction(
        [
            ("ZADD", history, now_ms, f"{now_ms}:{dispatcher_id}:{needed}"),
            ("ZREMRANGEBYSCORE", history, "-inf", now_ms - hold_ms - 1),
            ("ZRANGEBYSCORE", history, now_ms - hold_ms, "+inf"),
            ("PEXPIRE", history, hold_ms + 10_000),
        ],
        scripts=(),
    )
    peak = needed
    for reading in readings:
        try:
            peak = max(peak, int(reading.rsplit(b":", 1)[1]))
        except (IndexError, ValueError):
            continue  # not ours: ignore it (it ages out)
    return peak


async def publish(store: Store, signal: wire.ScaleSignal) -> None:
    await store.set_expiring(store.keys.scale_signal, wire.encode(signal), SIGNAL_TTL_MS)


class SignalReader:
    """A blocking reader of the signal (for ``up``, which runs no event loop)."""

    def __init__(self, url: str, namespace: str, timeout_s: float = 1.0) -> None:
        self._client = redis_url.sync_client(url, timeout_s)
        self._key = Keys(namespace).scale_signal

    def read(self) -> wire.ScaleSignal | None:
        """The current signal; None if there is none, it is unreadable, or
        Redis cannot be reached (the caller then keeps what it has)."""
        try:
            raw: bytes | None = self._client.get(self._key)  # type: ignore[assignment]
        except (redis.exceptions.RedisError, OSError):
            return None
        if raw is None:
            return None
        try:
            return wire.decode_scale_signal(raw)
        except msgspec.DecodeError:
            return None

    def close(self) -> None:
        self._client.close()
