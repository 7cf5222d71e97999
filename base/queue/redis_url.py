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
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.sentinel import Sentinel as SyncSentinel

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: list[tuple[str, int]]
    service_name: str
    tls: bool = False
    connection: dict[str, Any] = field(default_factory=dict)  # to the primary
    sentinel: dict[str, Any] = field(default_factory=dict)  # to the sentinels


def check(url: str) -> None:
    """Raise ``ValueError`` with a message fit for an operator if ``url`` is
    not one infergate can use. No message quotes any part of the URL's
    credentials or host (a mistyped URL can hold a password anywhere)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise ValueError(
            f"the Redis URL must start with one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    if scheme.endswith("+sentinel"):
        parse_sentinel(url)
        return
    try:
        pool = BlockingConnectionPool.from_url(url)
    except (ValueError, TypeError):
        raise ValueError(
            "the Redis URL is not valid: check its host, port (1-65535), db and query"
        ) from None
    _check_settings(pool.connection_kwargs)
    db = urlsplit(url).path.strip("/")
    if scheme != "unix" and db and not db.isdecimal():
        raise ValueError("the Redis URL is not valid: the db must be a number, 0 or more")


def _check_settings(settings: dict[str, Any]) -> None:
    """What redis-py accepts at parse time but fails on at every connect."""
    db = settings.get("db", 0)
    if not isinstance(db, int) or db < 0:
        raise ValueError("the Redis URL is not valid: the db must be a number, 0 or more")
    reqs = settings.get("ssl_cert_reqs")
    if reqs is not None and str(reqs).lower() not in ("none", "optional", "required"):
        raise ValueError("the Redis URL is not valid: ssl_cert_reqs is none, optional or required")


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower().endswith("+sentinel")


# Settings infergate gives every connection itself: a URL may not set them.
_RESERVED = frozenset(
    {
        "socket_timeout",
        "socket_connect_timeout",
        "max_connections",
        "timeout",
        "retry",
        "client_name",
        "ssl",
        "db",
        "username",
        "password",
        "connection_class",
        "connection_pool",
    }
)


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
    if len(path) == 2 and not path[1].isdecimal():
        raise ValueError("the db in a Sentinel URL must be a number, 0 or more: /mymaster/0")
    db = int(path[1]) if len(path) == 2 else 0
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
        elif name in _RESERVED:
            raise ValueError(f"a Sentinel URL may not set {name!r}: infergate sets it")
        else:
            connection[name] = _typed(name, value)
    _check_settings(connection)
    tls = parts.scheme.lower().startswith("rediss")
    return SentinelUrl(sentinels, path[0], tls, connection, sentinel)


def _typed(name: str, value: str) -> Any:
    """A query argument as redis-py's own URL parsing would type it."""
    parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
    if parser is None:
        return value
    try:
        return parser(value)
    except (TypeError, ValueError):
        raise ValueError(f"the Sentinel URL's {name!r} has an invalid value") from None


def _host_port(text: str) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` (26379 by default)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else ("" if not rest else "x")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""  # a bare IPv6 address has no port
    if not host:
        raise ValueError("a sentinel address has no host")
    if port and not (port.isdecimal() and 1 <= int(port) <= 65535):
        raise ValueError("a sentinel's port must be a number from 1 to 65535")
    return host, int(port) if port else SENTINEL_PORT


def redact(url: str) -> str:
    """The URL without its secrets (the password, and any ``*password*``
    query value), for logs and messages. Splits where redis-py does: the
    credentials end at the last ``@`` before the path."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "(not a URL)"
    netloc, slash, tail = rest.partition("/")
    query_at = tail.find("?") if slash else netloc.find("?")
    if not slash and query_at >= 0:
        netloc, tail, slash = netloc[:query_at], netloc[query_at:], ""
    credentials, at, hosts = netloc.rpartition("@")
    if at:
        user = credentials.split(":", 1)[0]
        netloc = f"{user}:***@{hosts}" if user else f":***@{hosts}"
    path, q, query = tail.partition("?")
    if q:
        query = "&".join(
            f"{name}=***" if "password" in name.lower() else f"{name}={value}"
            for name, _, value in (pair.partition("=") for pair in query.split("&"))
        )
    return f"{scheme}://{netloc}{slash}{path}{q}{query}"


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


def sync_client(url: str, timeout_s: float, **options: Any) -> redis.Redis:
    """A plain blocking client (for the CLI, before any event loop runs, and
    a worker's backend thread); ``options`` go to the client (a retry)."""
    timeouts = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **timeouts, **options)
    target = parse_sentinel(url)
    manager = SyncSentinel(  # type: ignore[no-untyped-call]
        target.sentinels, sentinel_kwargs={**timeouts, **target.sentinel}
    )
    client: redis.Redis = manager.master_for(  # type: ignore[no-untyped-call]
        target.service_name, ssl=target.tls, **target.connection, **timeouts, **options
    )
    return client
