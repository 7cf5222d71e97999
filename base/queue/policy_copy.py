"""The fleet's last valid policy, kept in Redis: a process that starts or
restarts while the policy file is invalid (or missing) comes up on it and
reports the file's problem, instead of crash-looping until someone fixes it.

Any process that loads a valid policy keeps it here (the version, the text
and when); the file stays the source of truth whenever it is valid.
"""

from typing import NamedTuple

import redis
from infergate.base import clock
from infergate.base.keys import Keys
from infergate.base.queue import redis_url
from infergate.base.queue.store import Store


class PolicyCopy(NamedTuple):
    version: str
    text: str
    saved_ms: int


async def keep_policy(store: Store, version: str, text: str) -> None:
    await store.redis.hset(
        store.keys.policy,
        mapping={"version": version, "text": text, "saved_ms": clock.now_ms()},
    )


def fetch_policy(url: str, namespace: str, timeout_s: float = 2.0) -> PolicyCopy | None:
    """The last valid policy, read once at start-up (before any event loop runs).
    None if there is none, or Redis cannot be reached within ``timeout_s``."""
    client = redis_url.sync_client(url, timeout_s)
    try:
        raw: dict[bytes, bytes] = client.hgetall(Keys(namespace).policy)  # type: ignore[assignment]
    except (redis.exceptions.RedisError, OSError):
        return None
    finally:
        client.close()
    try:
        return PolicyCopy(
            raw[b"version"].decode(), raw[b"text"].decode("utf-8"), int(raw[b"saved_ms"])
        )
    except (KeyError, ValueError, UnicodeDecodeError):
        return None
