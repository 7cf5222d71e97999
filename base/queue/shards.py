"""One deployment over several Redis primaries (shards): ``REDIS_URL`` may
name several, separated by whitespace, and every process is given the
same list. One primary runs Lua on one thread, so it caps the request
rate; shards multiply it.

A key (its quotas, its queue place and fair share, its jobs, its usage)
lives on one shard, chosen by rendezvous hashing: each shard scores the
key by a hash of its identity and the key's id, and the highest score
wins. A shard added later takes about 1/(N+1) of the keys and moves no
key between the others; a shard's identity is its address (host, port
and db; a Sentinel service's name), never its place in the list or its
credentials, so the list may be reordered and passwords rotated. A name
after ``#`` at the end of a URL is its identity instead: two Sentinel
setups that both call their service ``mymaster`` are two shards, and a
shard keeps its keys when its address changes.

A gateway routes each request to its key's shard; a dispatcher and a
worker serve every shard.
"""

import hashlib
import re
from collections.abc import Sequence
from functools import lru_cache
from urllib.parse import urlsplit

from infergate.base.queue import redis_url
from redis.asyncio import BlockingConnectionPool

MAX_SHARDS = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def urls(text: str) -> list[str]:
    """The shards' URLs, in order, each checked (``ValueError`` with a
    message fit for an operator, quoting no part of a URL)."""
    found = text.split()
    if not found:
        raise ValueError("no Redis URL given")
    if len(found) > MAX_SHARDS:
        raise ValueError(f"at most {MAX_SHARDS} Redis URLs (shards), got {len(found)}")
    for n, url in enumerate(found, 1):
        try:
            _check_name(url)
            redis_url.check(url)
        except ValueError as exc:
            raise ValueError(f"URL {n} of {len(found)}: {exc}") from None
    names = [identity(url) for url in found]
    if len(set(names)) < len(names):
        raise ValueError(
            "two Redis URLs have one identity (the same shard name after '#', or, unnamed, "
            "the same server and db or Sentinel service name and db): each shard is its own. "
            "Two Sentinel setups whose services share a name: name each shard yourself, "
            "'#name' at the end of its URL"
        )
    places = [_places(url) for url in found]
    if any(a & b for i, a in enumerate(places) for b in places[i + 1 :]):
        raise ValueError(
            "two Redis URLs reach the same server, whatever their dbs (or the same "
            "Sentinel service through a sentinel they share): each shard is its own"
        )
    return found


def _check_name(url: str) -> None:
    """A shard's own name, if its URL ends with one (quoting none of it: a
    '#' left unescaped in a password makes the rest look like one)."""
    _, sep, name = url.partition("#")
    if sep and not _NAME.match(name):
        raise ValueError(
            "the shard's name after '#' is 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (a '#' in a password is written %23)"
        )


def identity(url: str) -> str:
    """What names a shard for the hash: its own name, if its URL ends with
    one (``#name``), else where it is, not how it is reached."""
    name = urlsplit(url).fragment
    return f"name/{name}" if name else _address(url)


def _places(url: str) -> set[str]:
    """Where a URL reaches its Redis: the server, or each of its sentinels
    with the service (two URLs that share one reach the same primary). Not
    the db: two dbs of one server share its Lua thread, so they add no
    capacity, and its pub/sub channels, so each would hear the other's
    answers."""
    if not redis_url.is_sentinel(url):
        return {_address(url).rpartition("/")[0]}
    target = redis_url.parse_sentinel(url)
    return {f"{h.lower()}:{p}/{target.service_name}" for h, p in target.sentinels}


def _address(url: str) -> str:
    parts = urlsplit(url)
    if redis_url.is_sentinel(url):
        target = redis_url.parse_sentinel(url)
        db = target.connection.get("db", 0)
        return f"sentinel/{target.service_name}/{db}"
    # The db as redis-py reads it (the query's ``db`` wins over the path's).
    db = int(BlockingConnectionPool.from_url(url).connection_kwargs.get("db", 0) or 0)
    if parts.scheme.lower() == "unix":
        return f"unix{parts.path}/{db}"
    host = (parts.hostname or "localhost").lower()
    return f"{host}:{parts.port or 6379}/{db}"


@lru_cache(maxsize=65_536)
def _pick(key_id: str, names: tuple[str, ...]) -> int:
    best, best_score = 0, b""
    for index, name in enumerate(names):
        score = hashlib.blake2b(f"{name}\0{key_id}".encode(), digest_size=8).digest()
        if score > best_score:
            best, best_score = index, score
    return best


def shard_of(key_id: str, names: Sequence[str]) -> int:
    """The index, in ``names``, of the shard that holds ``key_id``."""
    if len(names) == 1:
        return 0
    return _pick(key_id, tuple(names))
