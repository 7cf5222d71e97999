"""Prometheus metrics against a real Prometheus: the request counters of two
gateway processes add up to exactly what was sent, by tier and status; every
alert and dashboard expression parses and names series a real scrape has;
the alert rules pass promtool."""

import json
import re
import shutil
import subprocess
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from infergate.base.ports import free_port
from infergate.redis_server import RedisServer

from tests.helpers import MAX_BODY_BYTES, SECRETS, Cluster, http, policy_yaml, wait_for

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "infergate.json"

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="Debian's prometheus package is not installed (.ci/run installs it)",
)


def expressions() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads(DASHBOARD.read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return exprs


@needs_prometheus
def test_the_alert_rules_pass_promtool() -> None:
    out = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 10 rules found" in out.stdout


class Prometheus:
    """A real Prometheus server scraping the given ports every second."""

    def __init__(self, tmp: Path, ports: list[int]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {
                    "job_name": "infergate",
                    "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}],
                }
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._ready, 30, "Prometheus to be ready")

    def _ready(self) -> bool:
        try:
            return http("GET", self.url + "/-/ready", timeout=1)[0] == 200
        except OSError:
            return False

    def query(self, expr: str) -> dict:
        status, _, body = http("GET", self.url + "/api/v1/query?query=" + urllib.parse.quote(expr))
        assert status == 200, (expr, body)
        assert body["status"] == "success", (expr, body)
        return body["data"]

    def names(self) -> set[str]:
        return set(http("GET", self.url + "/api/v1/label/__name__/values")[2]["data"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def fleet(tmp_path: Path, own_redis: RedisServer) -> Iterator[Cluster]:
    c = Cluster(
        tmp_path, own_redis.url, policy_yaml(), gateways=2, workers=2, latency_ms=20, metrics=True
    )
    yield c
    c.stop()


def _send_known_load(c: Cluster) -> Counter[tuple[str, str]]:
    sent: Counter[tuple[str, str]] = Counter()
    for i in range(30):
        for tier, n in (("enterprise", 1), ("paid", 2), ("free", 3)):
            if i % n == 0:
                status = c.infer(tier, f"{tier}-{i}", i % 2)[0]
                assert status == 200
                sent[(tier, "200")] += 1
    for i in range(5):
        assert c.infer("no-such-key", "x", i % 2)[0] == 401
        sent[("none", "401")] += 1
    for i in range(3):
        assert c.infer("disabled", "x", i % 2)[0] == 403
        sent[("none", "403")] += 1
    for i in range(4):
        status = http(
            "POST",
            c.urls[i % 2] + "/v1/inference",
            raw=b'{"input": 5}',
            headers={"Authorization": "Bearer " + SECRETS["paid"]},
        )[0]
        assert status == 400
        sent[("paid", "400")] += 1
    for i in range(2):  # over the body limit: refused before the key is read
        status = http(
            "POST",
            c.urls[i % 2] + "/v1/inference",
            raw=b'{"input": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}',
        )[0]
        assert status == 413
        sent[("none", "413")] += 1
    return sent


@needs_prometheus
def test_metrics_agree_with_a_known_load_and_every_expression_is_real(
    fleet: Cluster, tmp_path: Path
) -> None:
    c = fleet
    assert c.metrics_ports is not None
    sent = _send_known_load(c)
    prom = Prometheus(tmp_path, list(c.metrics_ports.values()))
    try:
        total = sum(sent.values())
        every = len(c.metrics_ports)
        wait_for(
            lambda: (
                (r := prom.query('count(up{job="infergate"} == 1)')["result"])
                and int(r[0]["value"][1]) == every
            ),
            20,
            "Prometheus to scrape every process",
        )
        wait_for(
            lambda: (
                (r := prom.query("sum(infergate_requests_total)")["result"])
                and float(r[0]["value"][1]) == total
            ),
            20,
            "Prometheus to scrape every request",
        )
        by = prom.query("sum by (tier, code) (infergate_requests_total)")["result"]
        seen = {(r["metric"]["tier"], r["metric"]["code"]): int(float(r["value"][1])) for r in by}
        assert seen == dict(sent)
        # Both gateway processes were counted, each once.
        per_gateway = prom.query("sum by (instance) (infergate_requests_total)")["result"]
        assert len(per_gateway) == 2
        # Every success went through one batch, and took one latency sample.
        ok = sum(n for (_, code), n in sent.items() if code == "200")
        batched = prom.query("sum(infergate_requests_batched_total)")["result"]
        assert int(float(batched[0]["value"][1])) == ok
        counted = prom.query("sum(infergate_request_duration_seconds_count)")["result"]
        assert int(float(counted[0]["value"][1])) == ok
        # Every alert and dashboard expression parses and names real series.
        names = prom.names()
        for expr in expressions():
            prom.query(expr)
            for name in re.findall(r"\binfergate_[a-z_]+", expr):
                assert name in names, f"{name} (in {expr}) is not exported"
    finally:
        prom.stop()
