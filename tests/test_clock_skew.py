"""Processes whose clocks are off by seconds (faketime, a real skewed
clock for the whole process) serve as if they were not: the fleet's clock
is Redis's (base/clock.py). Before, a worker 3 s ahead dropped every
request with less than 3 s left as expired, and a gateway 3 s behind sent
requests that every worker found expired."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from infergate.redis_server import RedisServer

from tests.helpers import Cluster, as_yaml, auth, http, policy, wait_for

# libfaketime, preloaded by `env` (which execs: the faketime command forks,
# and its child outlives a SIGTERM sent to it).
LIBFAKETIME = next(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"), None)
pytestmark = pytest.mark.skipif(
    LIBFAKETIME is None, reason="faketime (Debian's package) is not installed"
)
AHEAD = ["env", f"LD_PRELOAD={LIBFAKETIME}", "FAKETIME=+3s"]
BEHIND = ["env", f"LD_PRELOAD={LIBFAKETIME}", "FAKETIME=-3s"]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Cluster]:
    """A gateway on the right time and one 3 s behind; one worker, 3 s ahead."""
    with Cluster(tmp_path_factory.mktemp("skew"), module_redis.url, as_yaml(policy())) as c:
        c.stop_workers()  # (a gateway is ready only once a worker is)
        c.add_worker(wrapper=AHEAD)
        behind = c.add_gateway(wrapper=BEHIND)
        wait_for(lambda: _ok(c.urls[0]), 60, "the skewed worker to serve")
        wait_for(lambda: _ok(behind), 60, "the skewed gateway to serve")
        yield c


def _infer(url: str, text: str, timeout_ms: int = 2_000) -> tuple[int, dict]:
    status, _, body = http(
        "POST", url + "/v1/inference", {"input": text, "timeout_ms": timeout_ms}, auth("paid")
    )
    return status, body


def _ok(url: str) -> bool:
    try:
        return _infer(url, "ready?")[0] == 200
    except OSError:  # not listening yet
        return False


@pytest.mark.parametrize("gateway", [0, 1], ids=["gateway-on-time", "gateway-3s-behind"])
def test_requests_with_less_time_left_than_the_skew_are_served(
    cluster: Cluster, gateway: int
) -> None:
    url = cluster.urls[gateway]
    answers = [_infer(url, f"skewed {gateway} {i}") for i in range(40)]
    assert [status for status, _ in answers] == [200] * 40, answers[:3]
    assert all(
        body["output"].endswith(f"skewed {gateway} {i}") for i, (_, body) in enumerate(answers)
    )


def test_a_skewed_process_says_how_far_off_it_is(cluster: Cluster) -> None:
    """Its log names the offset (Redis's clock minus its own)."""
    line = wait_for(
        lambda: next(
            (ln for ln in cluster.workers[-1].output().splitlines() if '"clock.off"' in ln), None
        ),
        15,
        "the worker's clock.off line",
    )
    assert -3_100 < json.loads(line)["offset_ms"] < -2_900, line  # (3 s ahead)
