"""A dispatcher at rest, with real processes: waiting on the doorbell it
holds nothing its death would leave, so its beat rests; every time it
takes a credit again its key had the short TTL first; and while it waits
for a credit (not on the doorbell) its beat never rests. Read from
Redis's MONITOR, in the order Redis ran the commands."""

import time
from collections.abc import Iterator
from pathlib import Path

import redis
from infergate.base.keys import Keys
from infergate.redis_server import RedisServer

from tests.helpers import Cluster, as_yaml, policy, wait_for

TTL_MS = 1000  # (the default)
KEYS = Keys("infergate")


def _commands(client: redis.Redis, seconds: float) -> Iterator[list[str]]:
    """What Redis runs for ``seconds`` (or until the caller stops), as words."""
    deadline = time.monotonic() + seconds
    with client.monitor() as monitor:
        for seen in monitor.listen():
            yield seen["command"].split()
            if time.monotonic() > deadline:
                return


def _the_dispatcher(client: redis.Redis) -> tuple[str, str]:
    """The one dispatcher's id, once it registered, and its beat's key."""
    (dispatcher_id,) = wait_for(
        lambda: client.smembers(KEYS.members("dispatcher")), 30, "the dispatcher"
    )
    return dispatcher_id, KEYS.heartbeat("dispatcher", dispatcher_id)


def test_a_dispatcher_rests_at_rest_and_beats_short_before_it_holds_a_credit(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    try:
        with Cluster(tmp_path, own_redis.url, as_yaml(policy()), gateways=0, workers=1):
            dispatcher_id, beat_key = _the_dispatcher(client)
            wait_for(lambda: client.pttl(beat_key) > TTL_MS, 10, "the dispatcher's beat to rest")
            # At rest it takes a credit every 2 s to look at the queues
            # (AT_REST_WAITS): three of those, each after a short beat.
            last_ttl, takes, resting = None, 0, 0
            for words in _commands(client, 20):
                if words[:2] == ["SET", beat_key]:
                    last_ttl = int(words[-1])
                    resting += last_ttl > TTL_MS
                elif words[:2] == ["BLMOVE", KEYS.ready] and dispatcher_id in words[2]:
                    assert last_ttl == TTL_MS
                    takes += 1
                if takes == 3:
                    break
            assert (takes, resting > 0) == (3, True)
    finally:
        client.close()


def test_a_dispatcher_waiting_for_a_credit_never_rests(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    """No worker: the dispatcher waits for a credit the whole time (it
    would hold it the moment one came), never on the doorbell, and says
    nothing new; its beat stays at the interval with the short TTL."""
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    try:
        with Cluster(tmp_path, own_redis.url, as_yaml(policy()), gateways=0, workers=0):
            _, beat_key = _the_dispatcher(client)
            ttls = [
                int(words[-1]) for words in _commands(client, 3) if words[:2] == ["SET", beat_key]
            ]
            assert len(ttls) >= 8, ttls
            assert set(ttls) == {TTL_MS}, ttls
    finally:
        client.close()
