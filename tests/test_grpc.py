"""The gRPC API beside HTTP, with the real grpcio client against a real stack:
the same answers, errors and quotas as HTTP; the call's deadline is the
request's; a cancelled call leaves the queue; the health service and
reflection; and a hostile client (huge messages, many streams, garbage)
leaves it serving. The generated code is what its .proto makes."""

import asyncio
import concurrent.futures
import filecmp
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from infergate.base.grpc_api import inference_pb2, inference_pb2_grpc
from infergate.gateway.grpc_infer import _Withdrawal
from infergate.redis_server import RedisServer

from tests.helpers import SECRETS, Cluster, auth, http, key_entry, policy_yaml, wait_for

ROOT = Path(__file__).resolve().parent.parent
LATENCY_MS = 600  # (a batch long enough for a call to be cancelled while one runs)
LIMITED = "grpc-limited-secret"


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Cluster]:
    limited = key_entry("lim", "paid", LIMITED, rate_limits=["3/minute"])
    doc = policy_yaml(extra_keys=(limited,))
    with Cluster(
        tmp_path_factory.mktemp("grpc"), module_redis.url, doc, latency_ms=LATENCY_MS, grpc=True
    ) as c:
        yield c


@pytest.fixture(scope="module")
def channel(cluster: Cluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_ports[0]}") as ch:
        grpc.channel_ready_future(ch).result(timeout=10)
        yield ch


def _key(secret: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", "Bearer " + secret),)


def _infer(
    channel: grpc.Channel, secret: str | None, timeout: float = 10, **fields: object
) -> tuple[inference_pb2.InferResponse, dict[str, str]]:
    stub = inference_pb2_grpc.InferenceStub(channel)
    metadata = _key(secret) if secret else ()
    answer, call = stub.Infer.with_call(
        inference_pb2.InferRequest(**fields), metadata=metadata, timeout=timeout
    )
    return answer, dict(call.trailing_metadata())


def _error(channel: grpc.Channel, secret: str | None, **fields: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        _infer(channel, secret, **fields)
    return raised.value


def test_grpc_and_http_give_the_same_answers_errors_and_quotas(
    cluster: Cluster, channel: grpc.Channel
) -> None:
    answer, trailers = _infer(channel, SECRETS["paid"], input="the same input")
    status, _, body = cluster.infer("paid", "the same input")
    assert status == 200
    assert answer.output == body["output"]
    assert (answer.tier, answer.served_by, answer.model) == ("paid", "model", "default")
    assert answer.batch_size >= 1
    assert answer.latency_ms > 0
    assert answer.model_version == body["metadata"]["model_version"]
    assert trailers["x-request-id"] == answer.request_id

    codes = {
        "no key": (_error(channel, None, input="x"), grpc.StatusCode.UNAUTHENTICATED),
        "unknown key": (_error(channel, "nobody", input="x"), grpc.StatusCode.UNAUTHENTICATED),
        "disabled": (
            _error(channel, SECRETS["disabled"], input="x"),
            grpc.StatusCode.PERMISSION_DENIED,
        ),
        "empty": (_error(channel, SECRETS["paid"], input=""), grpc.StatusCode.INVALID_ARGUMENT),
        "too long": (
            _error(channel, SECRETS["free"], input="x" * 1001),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "no model": (
            _error(channel, SECRETS["paid"], input="x", model="nope"),
            grpc.StatusCode.NOT_FOUND,
        ),
        "max_tokens 0": (
            _error(
                channel,
                SECRETS["paid"],
                input="x",
                parameters=inference_pb2.Parameters(max_tokens=0),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    }
    for name, (error, code) in codes.items():
        assert error.code() == code, (name, error.code(), error.details())
        assert dict(error.trailing_metadata() or ())["x-error-code"], name

    # One quota, whichever way a request comes: 3 a minute.
    assert cluster.infer(LIMITED, "quota 1")[0] == 200
    _, trailers = _infer(channel, LIMITED, input="quota 2")
    assert trailers["x-ratelimit-limit-requests"] == "3"
    assert trailers["x-ratelimit-remaining-requests"] == "1"
    _infer(channel, LIMITED, input="quota 3")
    over = _error(channel, LIMITED, input="quota 4")
    assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(over.trailing_metadata() or ())
    assert trailers["x-error-code"] == "RATE_LIMITED"
    assert int(trailers["retry-after-ms"]) > 0
    assert trailers["grpc-retry-pushback-ms"] == trailers["retry-after-ms"]
    assert trailers["x-ratelimit-remaining-requests"] == "0"
    assert cluster.infer(LIMITED, "quota 5")[0] == 429


def test_the_call_s_deadline_is_the_request_s(cluster: Cluster, channel: grpc.Channel) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as raised:
        _infer(channel, SECRETS["paid"], timeout=LATENCY_MS / 1000 / 3, input="too short")
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 2
    # A deadline shorter than the time left to serve it is a 504 from the gateway.
    error = _error(channel, SECRETS["paid"], input="x", timeout_ms=1)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # A deadline longer than any request may wait leaves the tier's in force.
    assert _infer(channel, SECRETS["paid"], timeout=3600, input="a long deadline")[0].output


def test_a_client_gone_while_its_request_is_admitted_withdraws_it() -> None:
    """The request registers its withdrawal only once queued: a call
    cancelled before then runs it at once (as the HTTP edge does for a
    connection already lost), and one cancelled after, when it goes."""

    async def check() -> list[str]:
        ran: list[str] = []
        early = _Withdrawal()
        early.client_gone()
        early.hook(lambda: ran.append("early"))
        late = _Withdrawal()
        late.hook(lambda: ran.append("late"))
        late.client_gone()
        done = _Withdrawal()
        done.hook(lambda: ran.append("answered"))
        done.hook(None)  # (answered: the request took its hook back)
        done.client_gone()
        await asyncio.sleep(0)  # pacing: one loop turn, where call_soon runs the early one
        return ran

    assert sorted(asyncio.run(check())) == ["early", "late"]


def _status(cluster: Cluster) -> dict:
    return http("GET", cluster.urls[0] + "/v1/status", headers=auth("admin"))[2]


def test_a_cancelled_call_is_withdrawn_from_the_queue(
    cluster: Cluster, channel: grpc.Channel
) -> None:
    dropped = _status(cluster)["counters"].get("cancelled_dropped", 0)
    stub = inference_pb2_grpc.InferenceStub(channel)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # The one worker busy with a batch: the call waits in the queue.
        busy = pool.submit(cluster.infer, "enterprise", "the worker's batch")
        wait_for(lambda: _status(cluster)["workers_busy"] == 1, 10, "the worker busy")
        future = stub.Infer.future(
            inference_pb2.InferRequest(input="cancelled while queued"),
            metadata=_key(SECRETS["free"]),
        )
        time.sleep(LATENCY_MS / 1000 / 6)  # pacing: the call is admitted and waits
        assert future.cancel()
        assert busy.result(10)[0] == 200
    wait_for(
        lambda: _status(cluster)["counters"].get("cancelled_dropped", 0) == dropped + 1,
        10,
        "the cancelled request dropped before any worker ran it",
    )
    assert not any("cancelled while queued" in w.output() for w in cluster.workers)


def test_health_and_reflection(cluster: Cluster, channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "infergate.v1.Inference"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    [reply] = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for s in reply.list_services_response.service}
    assert {"infergate.v1.Inference", "grpc.health.v1.Health"} <= names
    # A stream held open would hold a slot for ever: Watch is not served.
    for _ in range(30):
        with pytest.raises(grpc.RpcError) as raised:
            next(iter(health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)))
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as unknown:
        health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    # Reflection streams held open: a few at once, and the service answers past them.
    stop = threading.Event()
    held = [stub.ServerReflectionInfo(iter(stop.wait, True), timeout=60) for _ in range(20)]
    try:
        # (16 at once: the other four refused at once)
        wait_for(lambda: sum(s.done() for s in held) == 4, 10, "four streams refused")
        assert all(s.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for s in held if s.done())
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert _infer(channel, SECRETS["paid"], input="past the streams")[0].output
    finally:
        stop.set()
        for stream in held:
            stream.cancel()


def test_a_hostile_client_leaves_it_serving(cluster: Cluster, channel: grpc.Channel) -> None:
    port = cluster.grpc_ports[0]
    # A message over the policy's body limit: refused before it is read whole.
    huge = _error(channel, SECRETS["enterprise"], input="x" * 100_000)
    assert huge.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Metadata past its bound.
    stub = inference_pb2_grpc.InferenceStub(channel)
    with pytest.raises(grpc.RpcError):
        stub.Infer(
            inference_pb2.InferRequest(input="x"),
            metadata=(*_key(SECRETS["paid"]), ("x-junk", "j" * 40_000)),
            timeout=5,
        )
    # Garbage on the port, and a connection that sends half a preface and stalls.
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 4096, b"PRI * HTTP/2.0\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(junk)
    stalled = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        # Many calls at once on one connection: each
        # answered, none hung.
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            calls = [
                pool.submit(_infer, channel, SECRETS["enterprise"], 30, input=f"many {i}")
                for i in range(150)
            ]
            outputs = {c.result(timeout=60)[0].output for c in calls}
        assert len(outputs) == 150
    finally:
        stalled.close()
    assert _infer(channel, SECRETS["paid"], input="still serving")[0].output
    assert http("GET", cluster.urls[0] + "/readyz")[0] == 200


def test_the_generated_code_is_what_the_proto_makes(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    layout = tmp_path / "in" / "infergate" / "base" / "grpc_api"
    layout.mkdir(parents=True)
    shutil.copy(ROOT / "base" / "grpc_api" / "inference.proto", layout)
    (tmp_path / "out").mkdir()
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", "-I", str(tmp_path / "in"),
            f"--python_out={tmp_path / 'out'}", f"--pyi_out={tmp_path / 'out'}",
            f"--grpc_python_out={tmp_path / 'out'}",
            "infergate/base/grpc_api/inference.proto",
        ],
        check=True,
        cwd=tmp_path,
    )  # fmt: skip
    made = tmp_path / "out" / "infergate" / "base" / "grpc_api"
    for name in ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py"):
        assert filecmp.cmp(made / name, ROOT / "base" / "grpc_api" / name, shallow=False), (
            f"{name} is stale: run `make proto`"
        )


def test_a_message_that_is_not_one_is_invalid_argument(channel: grpc.Channel) -> None:
    """Bytes that are no InferRequest, and fields this API does not have, are
    the client's mistake (INVALID_ARGUMENT, as HTTP's 400), never UNKNOWN."""
    raw = channel.unary_unary(
        "/infergate.v1.Inference/Infer",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    for junk in (
        b"\x0a\x02\xff\xfe",
        b"\x0a\x05ab",
        b"\x0a\x01a\x98\x06\x01",
        b"\x22\x03\x98\x06\x01",
    ):
        with pytest.raises(grpc.RpcError) as raised:
            raw(junk, metadata=_key(SECRETS["paid"]), timeout=5)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, junk
    # The key first, as HTTP checks it before the body.
    with pytest.raises(grpc.RpcError) as raised:
        raw(b"\x0a\x02\xff\xfe", timeout=5)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
