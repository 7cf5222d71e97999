"""Blocking pops (BLMOVE, BLPOP) on a connection of their own, read
straight from its stream (``resp.RawConnection``).

A worker waits for each batch this way, a dispatcher for each credit and
ring: through redis-py each wait cost more CPU than the batch of a fast
model. A connection per wait at once (a worker's slots). Anything but a
reply (a timeout past the block's, a cancelled wait, a lost connection)
drops the connection: a reply that arrives later must not be read as the
next wait's, and a popped item it carried is where Redis put it (the
destination list of a BLMOVE, which its owner's recovery reads).
"""

from typing import Any

from hiredis import pack_command
from infergate.base.queue.resp import RawConnection, hold, let_go
from redis.asyncio import Redis

# Past the block's own timeout, how long a reply may take (a busy Redis).
GRACE_S = 2.0


class Blocking:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._idle: list[RawConnection] = []  # one per wait at once (a worker's slots)

    async def pop(self, command: tuple[Any, ...], timeout_s: float) -> Any:
        """Send a blocking ``command`` whose block is ``timeout_s``; its reply
        (an error reply raised)."""
        link = None
        while self._idle and link is None:
            link = self._idle.pop()
            if not link.usable():
                await let_go(self.redis, link)
                link = None
        if link is None:
            link = await hold(self.redis)
        replies: list[Any] = []
        try:
            link.write(pack_command(command))
            wait_s = timeout_s + GRACE_S if timeout_s > 0 else None  # (0: until an item comes)
            await link.replies(1, wait_s, lambda _, reply: replies.append(reply))
        except BaseException:
            await let_go(self.redis, link)
            raise
        if isinstance(replies[0], Exception):
            await let_go(self.redis, link)  # (a primary no longer one: a new one asks again)
            raise replies[0]
        self._idle.append(link)
        return replies[0]

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for link in idle:
            await let_go(self.redis, link)
