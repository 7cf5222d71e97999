"""What one key may hold open at one gateway.

A request that waits (a synchronous inference, a job's long poll) holds its
connection until it ends, and a gateway process takes a bounded number of
connections (``--max-connections``). So one key may hold at most a share of
them (``limits.key_connection_share`` in the policy): one more is 429, and
every other key still finds connections free. A dict of counters, touched
twice per request, no Redis.
"""

import math

from infergate.gateway.errors import ApiError

RETRY_HELD_MS = 1_000


class Holds:
    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._held: dict[str, int] = {}

    def limit(self, share: float) -> int:
        return max(1, math.floor(share * self.max_connections))

    def acquire(self, key_id: str, share: float) -> None:
        """Count one more waiting request of ``key_id`` (``release`` when it
        ends); 429 if the key already holds its share."""
        held = self._held.get(key_id, 0)
        if held >= self.limit(share):
            raise ApiError(
                "RATE_LIMITED",
                f"this key already holds {held} requests open at this gateway, its limit "
                f"({share:g} of {self.max_connections} connections); wait for some to finish",
                RETRY_HELD_MS,
            )
        self._held[key_id] = held + 1

    def release(self, key_id: str) -> None:
        left = self._held[key_id] - 1
        if left:
            self._held[key_id] = left
        else:
            del self._held[key_id]

    def held(self, key_id: str) -> int:
        return self._held.get(key_id, 0)
