"""What a Redis failure means to the code around it, in one place.

``UNAVAILABLE``: Redis cannot be reached right now (refused, timed out, a
replica that cannot take writes during a failover); retry with backoff.
``STORE_ERRORS``: any failure of a Redis call, unavailable included; the
request path answers these with 503 rather than a 500.
"""

import redis.exceptions

UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    OSError,
)

STORE_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
