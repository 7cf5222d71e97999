"""Which Redis a deployment uses, from one URL, for every process and for
``limits`` (which shares the process's connection pool).

    redis://[user:password@]host:port/db            one Redis (AUTH/ACL user)
    rediss://...?ssl_ca_certs=/path/ca.pem         the same over TLS
    redis+sentinel://[user:password@]h1:26379,h2:26379/service[/db]
    rediss+sentinel://...                          Sentinel, the primary over TLS

With Sentinel, every connection asks the sentinels where the primary of
``service`` is, and asks again when a connection to it fails, so a failover
is followed without a restart. The user and password are the primary's;
``sentinel_username`` and ``sentinel_password`` in the query authenticate
to the sentinels themselves. Other query arguments (``ssl_ca_certs``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``, ...) go to the
connections, as redis-py's ``from_url`` reads them.
"""

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import redis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.sentinel import Sentinel as SyncSentinel

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: list[tuple[str, int]]
    service_name: str
    db: int = 0
    tls: bool = False
    connection: dict[str, Any] = field(default_factory=dict)  # to the primary
    sentinel: dict[str, Any] = field(default_factory=dict)  # to the sentinels


def check(url: str) -> None:
    """Raise ``ValueError`` with a message fit for an operator if ``url`` is
    not one infergate can use (the password is never part of the message)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise ValueError(
            f"the Redis URL must start with one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    if scheme.endswith("+sentinel"):
        parse_sentinel(url)
        return
    try:
        BlockingConnectionPool.from_url(url)
    except ValueError as exc:
        raise ValueError(f"the Redis URL is not valid: {exc}") from None
    db = urlsplit(url).path.strip("/")
    if scheme != "unix" and db and not db.isdigit():
        raise ValueError(f"the Redis URL is not valid: the db must be a number, not {db!r}")


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower().endswith("+sentinel")


def parse_sentinel(url: str) -> SentinelUrl:
    parts = urlsplit(url)
    credentials, _, hosts = parts.netloc.rpartition("@")
    sentinels = [_host_port(h) for h in hosts.split(",") if h]
    if not sentinels:
        raise ValueError(
            "a Sentinel URL names at least one sentinel: redis+sentinel://host:26379/service"
        )
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(
            "a Sentinel URL ends with the service name and an optional db: /mymaster/0"
        )
    try:
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError:
        raise ValueError("the db in a Sentinel URL must be a number: /mymaster/0") from None
    connection: dict[str, Any] = {"db": db}
    user, has_password, password = credentials.partition(":")
    if user:
        connection["username"] = unquote(user)
    if has_password and password:
        connection["password"] = unquote(password)
    sentinel: dict[str, Any] = {}
    for name, value in parse_qsl(parts.query):
        if name in ("sentinel_username", "sentinel_password"):
            sentinel[name.removeprefix("sentinel_")] = value
        else:
            connection[name] = value
    tls = parts.scheme.lower().startswith("rediss")
    return SentinelUrl(sentinels, path[0], db, tls, connection, sentinel)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"sentinel address {text!r} has no host")
    try:
        return host, int(port) if port else SENTINEL_PORT
    except ValueError:
        raise ValueError(f"sentinel address {text!r}: the port must be a number") from None


def redact(url: str) -> str:
    """The URL without its password, for logs and messages."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    credentials, _, tail = rest.partition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{quote(unquote(user))}:***@{tail}" if user else f"{scheme}://:***@{tail}"


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """A Sentinel pool that, like the plain one, makes a command wait for a
    free connection (up to ``timeout``) instead of failing under a burst."""


def async_client(url: str, **pool: Any) -> Redis:
    """A client on a blocking connection pool, for one Redis or a Sentinel's
    primary; ``pool`` holds the pool's settings (timeouts, sizes, retry)."""
    if not is_sentinel(url):
        return Redis.from_pool(BlockingConnectionPool.from_url(url, **pool))
    target = parse_sentinel(url)
    timeouts = {k: v for k, v in pool.items() if k.startswith("socket_")}
    manager = Sentinel(  # type: ignore[no-untyped-call]
        target.sentinels, sentinel_kwargs={**timeouts, **target.sentinel}
    )
    client: Redis = manager.master_for(
        target.service_name,
        connection_pool_class=_BlockingSentinelPool,
        ssl=target.tls,
        **target.connection,
        **pool,
    )
    return client


def sync_client(url: str, timeout_s: float) -> redis.Redis:
    """A plain blocking client (for the CLI, before any event loop runs)."""
    timeouts = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **timeouts)
    target = parse_sentinel(url)
    manager = SyncSentinel(  # type: ignore[no-untyped-call]
        target.sentinels, sentinel_kwargs={**timeouts, **target.sentinel}
    )
    client: redis.Redis = manager.master_for(  # type: ignore[no-untyped-call]
        target.service_name, ssl=target.tls, **target.connection, **timeouts
    )
    return client
