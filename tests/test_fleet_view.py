"""A gateway's fleet view at rest, with real processes: it rests (read
every four heartbeat TTLs while the gateway is ready), so what a request
is judged on is the view read fresh, and a Redis that goes takes the view
with it at once. Heartbeats last 10 s here, so a resting view is read only
every 40 s: what changes sooner is the change's own doing."""

import hashlib
import time
from pathlib import Path
from typing import Any

import redis
from infergate.base import wire
from infergate.base.keys import Keys
from infergate.base.queue.scripts import source
from infergate.redis_server import RedisServer

from tests.helpers import Cluster, as_yaml, http, policy, wait_for

LONG_BEATS = {"INFERGATE_HEARTBEAT_TTL_MS": "10000"}


def readiness(c: Cluster) -> Any:
    return http("GET", c.urls[0] + "/readyz", timeout=5)[2]


def test_a_request_is_judged_on_the_fleet_as_it_is_not_as_the_view_last_read_it(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    """A worker whose backend does not sample is all the resting view has
    read; one that samples joins. A request for a sample is served by it,
    not refused on the view's last reading (400: the model does not sample)."""
    keys = Keys("infergate")
    client = redis.Redis.from_url(own_redis.url)
    now_ms = int(time.time() * 1000)
    planted = wire.Heartbeat(
        "worker", "no-sampling", now_ms, now_ms, batch_ms=100.0, lacks=["sampling"]
    )
    client.set(keys.heartbeat("worker", planted.id), wire.encode(planted), px=120_000)
    client.sadd(keys.members("worker"), planted.id)
    try:
        with Cluster(tmp_path, own_redis.url, as_yaml(policy()), workers=0, env=LONG_BEATS) as c:
            assert readiness(c)["workers_alive"] == 1  # (the view: the planted worker alone)
            c.add_worker()
            wait_for(
                lambda: (
                    len(client.smembers(keys.members("worker"))) == 2
                    and client.exists(keys.ready) == 1
                ),
                30,
                "the worker that samples to offer its credit",
            )
            status, _, body = c.infer("enterprise", "a sample", parameters={"temperature": 0.7})
            assert status == 200, body
    finally:
        client.close()


def test_a_gateway_forgets_its_fleet_the_moment_its_redis_goes(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    """At rest the view was read a worker alive; Redis is killed: the
    reply listener's subscription breaks and the view reads as none then,
    not at its next read (40 s away)."""
    with Cluster(tmp_path, own_redis.url, as_yaml(policy()), env=LONG_BEATS) as c:
        assert readiness(c)["workers_alive"] == 1
        own_redis.kill()
        wait_for(lambda: readiness(c)["workers_alive"] == 0, 2, "the view to read as none")


def test_a_gateway_with_no_worker_serving_reads_its_view_every_second(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    """A view rests (a read every 4 s) only while some worker serves: the
    planted worker the gateway was ready with expires, and from then on
    the gateway reads its view every second (default heartbeats), so it
    is ready within a second of a worker's coming."""
    keys = Keys("infergate")
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    fleet_sha = hashlib.sha1(source("fleet").encode()).hexdigest()
    now_ms = int(time.time() * 1000)
    planted = wire.Heartbeat("worker", "planted", now_ms, now_ms, batch_ms=100.0)
    client.set(keys.heartbeat("worker", planted.id), wire.encode(planted).decode(), px=120_000)
    client.sadd(keys.members("worker"), planted.id)
    try:
        with Cluster(tmp_path, own_redis.url, as_yaml(policy()), workers=0) as c:
            assert readiness(c)["workers_alive"] == 1
            client.delete(keys.heartbeat("worker", planted.id))
            wait_for(lambda: readiness(c)["workers_alive"] == 0, 10, "the planted worker gone")
            gateway = {
                f"{entry['addr']}"
                for entry in client.client_list()
                if entry["name"].startswith("gateway:")
            }
            reads, deadline = 0, time.monotonic() + 4.5
            with client.monitor() as monitor:
                for seen in monitor.listen():
                    address = f"{seen['client_address']}:{seen['client_port']}"
                    words = seen["command"].split()
                    reads += address in gateway and words[:2] == ["EVALSHA", fleet_sha]
                    if time.monotonic() > deadline:
                        break
            assert reads >= 3  # (resting, one or two)
    finally:
        client.close()
