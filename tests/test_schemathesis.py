"""Property-based checks of the served OpenAPI document with schemathesis,
against a real stack: whatever the generated request, the gateway answers
with a documented status and the documented body, never a 500. Bounded to a
few dozen examples per operation."""

from collections.abc import Iterator

import pytest
import schemathesis

# Imported here, at collection time, not lazily inside a test: pytest rewrites
# these modules as it imports them, and CPython 3.11.7's AST constructor can
# fail ("AST constructor recursion depth mismatch") when that happens deep in
# a test's stack, as it did on a fresh install in CI.
import schemathesis.generation.jsonschema.strategy
from hypothesis import HealthCheck, given, settings
from infergate.redis_server import RedisServer
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.helpers import SECRETS, Stack, policy_yaml


@pytest.fixture(scope="module")
def live_stack(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Stack]:
    server = module_redis
    stack = Stack(
        tmp_path_factory.mktemp("schemathesis"),
        server.url,
        workers=2,
        latency_ms=5,
        policy=policy_yaml(),
    )
    yield stack
    stack.stop()


def no_internal_error(ctx, response, case) -> bool:
    assert response.status_code != 500 or response.json()["error"]["code"] == "INFERENCE_FAILED", (
        response.text
    )
    assert response.status_code in {
        200,
        202,
        400,
        401,
        403,
        404,
        405,
        409,
        413,
        415,
        429,
        500,
        503,
        504,
    }
    assert "x-request-id" in response.headers
    return True


def _check_every_operation(url: str, headers: dict[str, str], max_examples: int) -> int:
    """Each operation of the served document, fed hypothesis examples;
    schemathesis's checks (no 5xx, documented status codes, content types and
    bodies) run on every response. (Its pytest plugin does not load under
    pytest 9, so the operations are driven directly.)"""
    api = schemathesis.openapi.from_url(url + "/schema/openapi.json")
    operations = 0
    for result in api.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(
            max_examples=max_examples,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def run(case) -> None:
            # Two built-in checks give way to our own: a schema-valid input
            # longer than its tier's max_input_chars is rightly 400 (that limit
            # lives in the policy, not the document), and 503/504 are
            # documented answers (a 1 ms timeout_ms is a valid request that
            # rightly ends 504). What must never happen is an unplanned 500.
            case.call_and_validate(
                headers=headers,
                excluded_checks=[positive_data_acceptance, not_a_server_error],
                additional_checks=[no_internal_error],
            )

        run()
    return operations


def test_documented_behaviour_with_an_admin_key(live_stack: Stack) -> None:
    assert (
        _check_every_operation(live_stack.url, {"Authorization": "Bearer " + SECRETS["admin"]}, 30)
        >= 6
    )


def test_documented_behaviour_without_a_key(live_stack: Stack) -> None:
    assert _check_every_operation(live_stack.url, {}, 15) >= 6


def test_malformed_bodies_and_headers(live_stack: Stack) -> None:
    from tests.helpers import http

    url = live_stack.url + "/v1/inference"
    key = {"Authorization": "Bearer " + SECRETS["free"], "Content-Type": "application/json"}
    cases = [
        (key, b"\x80\x81\x82"),
        (key, b"[1, 2, 3]"),
        (key, b'{"input": null}'),
        (key, b'{"input": ["a"]}'),
        (key, b'{"input": "x", "timeout_ms": "soon"}'),
        (key, b'{"input": "x", "timeout_ms": 1e400}'),
        (key, b"null"),
        (key, b""),
        ({**key, "Content-Type": "text/plain"}, b"hello"),
        ({"Authorization": "Bearer", "Content-Type": "application/json"}, b'{"input": "x"}'),
        (
            {
                "Authorization": "bearer   " + SECRETS["free"] + "  ",
                "Content-Type": "application/json",
            },
            b'{"input": "x"}',
        ),
        ({"Authorization": "Token abc", "Content-Type": "application/json"}, b'{"input": "x"}'),
    ]
    for headers, body in cases:
        status, resp_headers, parsed = http("POST", url, raw=body, headers=headers)
        assert status in (200, 400, 401, 415), (headers, body, status, parsed)
        assert "x-request-id" in resp_headers
        if status != 200:
            assert parsed["error"]["code"] in {
                "INVALID_INPUT",
                "UNAUTHENTICATED",
                "UNSUPPORTED_MEDIA_TYPE",
            }
    status, _, parsed = http("POST", url, raw=b'{"input": "' + b"x" * 100_000 + b'"}', headers=key)
    assert status == 413
    assert parsed["error"]["code"] == "PAYLOAD_TOO_LARGE"
    # A huge body is refused from its Content-Length before it is read, and the
    # connection closed: the client may see the 413 or a reset while it is still
    # sending. Either way the gateway carries on.
    try:
        status = http("POST", url, raw=b'{"input": "' + b"x" * 5_000_000 + b'"}', headers=key)[0]
        assert status == 413
    except OSError:
        pass
    assert (
        http("POST", url, {"input": "still here"}, {"Authorization": "Bearer " + SECRETS["free"]})[
            0
        ]
        == 200
    )
