"""OpenTelemetry: with INFERGATE_TRACING=console, a request's gateway span and
the worker's batch span that served it are exported, linked by trace id."""

import json
import urllib.request
from pathlib import Path

from infergate.redis_server import RedisServer

from tests.helpers import Cluster, Proc, auth, http, policy_yaml, wait_for


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


def test_a_callers_trace_is_joined_and_the_dispatcher_and_worker_link_to_it(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    c = Cluster(
        tmp_path,
        own_redis.url,
        policy_yaml(),
        env={"INFERGATE_TRACING": "console"},
        metrics=True,
    )
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_id = "00f067aa0ba902b7"
    try:
        status, _, _ = http(
            "POST",
            c.urls[0] + "/v1/inference",
            {"input": "joined"},
            {
                **auth("paid"),
                "traceparent": f"00-{trace_id}-{parent_id}-01",
                "tracestate": "vendor=opaque",
            },
        )
        assert status == 200
        gateway_span = wait_for(
            lambda: next(
                (s for s in spans(c.gateways[0]) if s["name"] == "gateway.inference"), None
            ),
            5,
            "the gateway span",
        )
        # Inside the caller's trace, as a child of the caller's span.
        assert gateway_span["context"]["trace_id"] == "0x" + trace_id
        assert gateway_span["parent_id"] == "0x" + parent_id
        assert "key=vendor, value=opaque" in gateway_span["context"]["trace_state"]
        span_id = gateway_span["context"]["span_id"]

        def linked(proc: Proc, name: str) -> dict | None:
            return next(
                (
                    s
                    for s in spans(proc)
                    if s["name"] == name
                    and any(link["context"]["span_id"] == span_id for link in s["links"])
                ),
                None,
            )

        # Its batch was formed by a dispatcher, or (nothing queued, the
        # worker idle) by the gateway itself: one of the two says so.
        handed = [e["name"] for e in gateway_span["events"]] == ["handed_straight"]
        if not handed:
            assert wait_for(
                lambda: linked(c.dispatchers[0], "dispatcher.batch"), 5, "dispatcher span"
            )
        assert wait_for(lambda: linked(c.workers[0], "worker.batch"), 5, "worker span")
        # The latency histogram carries the trace id as an exemplar (OpenMetrics).
        assert c.metrics_ports is not None
        port = next(p for name, p in c.metrics_ports.items() if name.startswith("gateway"))
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/metrics",
            headers={"Accept": "application/openmetrics-text; version=1.0.0"},
        )
        text = urllib.request.urlopen(req, timeout=5).read().decode()
        assert f'trace_id="{trace_id}"' in text
        # A malformed traceparent starts a trace of its own, and is no error.
        status, _, _ = http(
            "POST",
            c.urls[0] + "/v1/inference",
            {"input": "fresh"},
            {**auth("paid"), "traceparent": "00-zzzz-not-a-trace-01"},
        )
        assert status == 200
    finally:
        c.stop()
