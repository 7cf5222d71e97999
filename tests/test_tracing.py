"""OpenTelemetry: with INFERGATE_TRACING=console, a request's gateway span and
the worker's batch span that served it are exported, linked by trace id."""

import json
from pathlib import Path

from infergate.redis_server import RedisServer

from tests.helpers import Cluster, Proc, policy_yaml, wait_for


def spans(proc: Proc) -> list[dict]:
    out = []
    for line in proc.output().splitlines():
        if line.startswith('{"name"'):
            out.append(json.loads(line))
    return out


def test_a_request_and_its_batch_are_traced_and_linked(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    server = own_redis
    c = Cluster(tmp_path, server.url, policy_yaml(), env={"INFERGATE_TRACING": "console"})
    try:
        status, headers, body = c.infer("paid", "trace me")
        assert status == 200
        gateway_span = wait_for(
            lambda: next(
                (s for s in spans(c.gateways[0]) if s["name"] == "gateway.inference"), None
            ),
            5,
            "the gateway span",
        )
        assert gateway_span["attributes"]["infergate.request_id"] == headers["x-request-id"]
        assert gateway_span["attributes"]["infergate.tier"] == "paid"
        trace_id = gateway_span["context"]["trace_id"]
        batch_span = wait_for(
            lambda: next(
                (s for s in spans(c.workers[0]) if s["name"] == "worker.batch" and s["links"]), None
            ),
            5,
            "the worker's batch span",
        )
        assert [link["context"]["trace_id"] for link in batch_span["links"]] == [trace_id]
        assert batch_span["attributes"]["infergate.batch_size"] == body["batch_size"]
    finally:
        c.stop()
