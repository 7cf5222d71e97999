"""Real Redis for every test, never the one on 6379: one ``redis-server``
on a free port per session, flushed before each test that asks for
``redis_url``; ``module_redis`` for a module whose stack outlives one test;
``own_redis`` for a test that kills or restarts its Redis; ``cluster_factory``
for processes started one by one on the module's Redis."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from infergate.redis_server import RedisServer

from tests.helpers import Cluster


def _serve() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    yield from _serve()


@pytest.fixture(scope="module")
def module_redis() -> Iterator[RedisServer]:
    yield from _serve()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    yield from _serve()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def cluster_factory(tmp_path: Path, module_redis: RedisServer) -> Iterator:
    """Clusters (tests.helpers.Cluster) on the module's Redis, emptied
    before each, all stopped at the end of the test."""
    made: list[Cluster] = []

    def make(policy: str, **kw: Any) -> Cluster:
        client = redis.Redis.from_url(module_redis.url)
        client.flushall()
        client.close()
        c = Cluster(tmp_path, module_redis.url, policy, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()
