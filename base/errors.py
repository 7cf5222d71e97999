"""What a Redis failure means to the code around it, in one place.

``UNAVAILABLE``: Redis cannot be reached right now (refused, timed out, a
replica that cannot take writes during a failover); retry with backoff.
``STORE_ERRORS``: any failure of a Redis call, unavailable included; the
request path answers these with 503 rather than a 500. ``out_of_memory``:
Redis is there but full; its own state (``Store.full``), not an outage.
"""

import redis.exceptions

UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    OSError,
)

STORE_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)


# What admit.lua says of a request whose long input Redis did not keep (its
# SET refused for want of memory, or the input evicted before the admit ran).
INPUT_NOT_STORED = "its input was not stored"


def input_not_stored(exc: BaseException) -> bool:
    """The admit found the request's long input missing (``admit.lua``):
    that request alone failed, charged nothing (not proof of a full Redis)."""
    return isinstance(exc, redis.exceptions.ResponseError) and INPUT_NOT_STORED in str(exc)


def wrong_type(exc: BaseException) -> bool:
    """A command met a key of another type than its own (planted: Redis's
    contents are not trusted)."""
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("WRONGTYPE")


def out_of_memory(exc: BaseException) -> bool:
    """Redis refused a write for want of memory (``maxmemory`` reached):
    its OOM error, as redis-py raises it for a command or a transaction, or
    inside a script's error (redis-py raises a plain ResponseError then)."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or (
        isinstance(exc, redis.exceptions.ResponseError) and "OOM command not allowed" in str(exc)
    )
