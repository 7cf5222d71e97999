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


async def publish(store: Store, signal: wire.ScaleSignal) -> None:
    await store.redis.set(store.keys.scale_signal, wire.encode(signal), px=SIGNAL_TTL_MS)


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
