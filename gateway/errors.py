"""The one error shape clients see, and the status code of each error code.

HTTP status codes are chosen here and nowhere else:
``{"error": {"code", "type", "message", "request_id", "retry_after_ms"}}``.
"""

import math

import msgspec
from infergate.base import wire

# code -> (HTTP status, OpenAI-style type)
ERRORS: dict[str, tuple[int, str]] = {
    "INVALID_INPUT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "KEY_DISABLED": (403, "permission_error"),
    "FORBIDDEN": (403, "permission_error"),
    "NOT_FOUND": (404, "invalid_request_error"),
    "MODEL_NOT_FOUND": (404, "invalid_request_error"),
    "METHOD_NOT_ALLOWED": (405, "invalid_request_error"),
    "CONFLICT": (409, "invalid_request_error"),
    "REQUEST_TIMEOUT": (408, "invalid_request_error"),
    "PAYLOAD_TOO_LARGE": (413, "invalid_request_error"),
    "UNSUPPORTED_MEDIA_TYPE": (415, "invalid_request_error"),
    "RATE_LIMITED": (429, "rate_limit_error"),
    "BUDGET_EXCEEDED": (429, "insufficient_quota"),
    "HEADERS_TOO_LARGE": (431, "invalid_request_error"),
    "INFERENCE_FAILED": (500, "server_error"),
    "INTERNAL": (500, "server_error"),
    "SERVICE_OVERLOADED": (503, "overloaded_error"),
    "TIMEOUT": (504, "timeout_error"),
    # Never seen by a client (it has gone); in logs and metrics only.
    "CLIENT_CLOSED": (499, "client_closed"),
}


class ErrorDetail(msgspec.Struct, omit_defaults=True):
    code: str
    type: str
    message: str
    request_id: str
    retry_after_ms: int | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class ApiError(Exception):
    """Raised inside the gateway; rendered as the error shape above."""

    def __init__(
        self,
        code: str,
        message: str,
        retry_after_ms: int | None = None,
        headers: dict[str, str] | None = None,
        param: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        # False: no retry can succeed (x-should-retry: false); None: by its status.
        self.retryable = retryable
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.headers = headers or {}
        # The caller's tier once its key is known (for the metrics).
        self.tier: str | None = None
        # The request field at fault, where one is (OpenAI's ``param``).
        self.param = param

    @property
    def status(self) -> int:
        return ERRORS[self.code][0]

    def body(self, request_id: str) -> ErrorBody:
        return ErrorBody(
            ErrorDetail(
                self.code, ERRORS[self.code][1], self.message, request_id, self.retry_after_ms
            )
        )

    def all_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after_ms is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_ms / 1000)))
            headers["retry-after-ms"] = str(self.retry_after_ms)
        return headers


Headers = list[tuple[bytes, bytes]]

JSON = (b"content-type", b"application/json")


def render(error: ApiError, request_id: str) -> tuple[int, Headers, bytes]:
    """The one rendering of an error, whatever sends it (the edge, the
    middleware, Litestar's handlers, the inference route): its status, its
    headers (content type, retry-after; the sender adds content-length,
    x-request-id and its own) and its JSON body."""
    headers = [JSON]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in error.all_headers().items()]
    return error.status, headers, msgspec.json.encode(error.body(request_id))


# Codes a worker or the reaper may put on a result; anything else it sends
# is answered as INFERENCE_FAILED (the wire is not trusted to pick a status).
RESULT_CODES = frozenset({"INFERENCE_FAILED", "TIMEOUT", "SERVICE_OVERLOADED"})


def error_from_result(error: wire.ErrorInfo) -> ApiError:
    """The client's error for a result that carries one, by its code (a
    503 says when to retry, as every 503 does)."""
    code = error.code if error.code in RESULT_CODES else "INFERENCE_FAILED"
    retry_ms = RETRY_RESULT_MS if code == "SERVICE_OVERLOADED" else None
    return ApiError(code, error.message or "the backend failed", retry_ms)


# A result refused for want of capacity (a model's server that did not
# answer, an input Redis no longer held): worth another try a second on.
RETRY_RESULT_MS = 1_000


RETRY_REDIS_MS = 1_000


def redis_unreachable() -> ApiError:
    return ApiError("SERVICE_OVERLOADED", "the queue store is unreachable", RETRY_REDIS_MS)


def input_not_kept() -> ApiError:
    return ApiError(
        "SERVICE_OVERLOADED",
        "the queue store did not keep the request's input (it is at its memory limit or "
        "evicting): nothing was charged",
        RETRY_REDIS_MS,
    )


RETRY_REDIS_FULL_MS = 5_000


def redis_full() -> ApiError:
    return ApiError(
        "SERVICE_OVERLOADED",
        "the queue store is out of memory (Redis maxmemory): new work is refused until it frees",
        RETRY_REDIS_FULL_MS,
    )


def redis_memory_high(use: float, tier: str) -> ApiError:
    return ApiError(
        "SERVICE_OVERLOADED",
        f"the queue store's memory is {use:.0%} used, past the {tier} tier's high-water "
        f"mark: new {tier} work is refused until it frees",
        RETRY_REDIS_FULL_MS,
    )
