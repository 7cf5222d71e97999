"""Which workers say they are warming up (a model's weights load, its first
batches run): ``Keys.warming``, worker ids scored by when their word runs
out. ``up`` waits past its ready timeout while any word holds."""

import contextlib

import redis
from infergate.base.keys import Keys
from infergate.base.queue import redis_url

# The set goes this long after the last word said (no worker is left to
# take back a dead one's: scores are not compared across clocks to prune).
WORD_KEPT_MS = 60_000


class WarmingWord:
    """The word, said and read with a blocking client (the CLI runs no event
    loop), on Redis's clock; a Redis that cannot be reached reads as none."""

    def __init__(self, url: str, namespace: str, timeout_s: float = 1.0) -> None:
        self._client = redis_url.sync_client(url, timeout_s)
        self._key = Keys(namespace).warming

    def say(self, worker_id: str, for_ms: int) -> None:
        """``worker_id`` is warming up for ``for_ms`` from now."""
        with contextlib.suppress(redis.exceptions.RedisError, OSError):  # (said again soon)
            pipe = self._client.pipeline(transaction=False)
            pipe.zadd(self._key, {worker_id: self._now_ms() + for_ms})
            pipe.pexpire(self._key, WORD_KEPT_MS)
            pipe.execute()

    def any(self) -> bool:
        try:
            return bool(self._client.zcount(self._key, self._now_ms(), "+inf"))
        except (redis.exceptions.RedisError, OSError):
            return False

    def _now_ms(self) -> int:
        seconds, micros = self._client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def close(self) -> None:
        self._client.close()
