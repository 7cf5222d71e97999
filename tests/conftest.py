"""Real Redis for every test: one redis-server on a free port per session
(never the one on 6379), flushed before each test."""

from collections.abc import Iterator

import pytest
import redis
from infergate.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
