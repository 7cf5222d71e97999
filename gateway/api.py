"""The request and response bodies of the public API (they make the OpenAPI document)."""

from typing import Annotated, Any

import msgspec
from infergate.base.queue.dead_letters import DeadLetter
from infergate.base.queue.usage import KeyUsage
from infergate.gateway.errors import ErrorDetail
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, RequestBody, Schema

MAX_TOKENS = 4_096


class Parameters(msgspec.Struct, forbid_unknown_fields=True):
    """What a request may ask of the model. Every backend honours both, per
    request; any other is refused (400, naming it), never ignored."""

    max_tokens: (
        Annotated[
            int,
            msgspec.Meta(
                ge=1,
                le=MAX_TOKENS,
                description="The most tokens of the output (the backend's tokenizer's, "
                "or words); at most the model's own bound.",
            ),
        ]
        | None
    ) = None
    temperature: (
        Annotated[
            float,
            msgspec.Meta(
                ge=0,
                le=2,
                description="Sampling temperature; 0 (the default) is greedy. Above 0 "
                "a request is never collapsed with another nor served from the cache.",
            ),
        ]
        | None
    ) = None


class InferenceRequest(msgspec.Struct, forbid_unknown_fields=True):
    input: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            description="The string to process (its tier sets the longest allowed).",
        ),
    ]
    timeout_ms: (
        Annotated[
            int,
            msgspec.Meta(
                ge=1, le=600_000, description="Shortens the tier's deadline for this request."
            ),
        ]
        | None
    ) = None
    model: (
        Annotated[
            str,
            msgspec.Meta(
                min_length=1,
                max_length=200,
                description="The model to run (GET /v1/models); default: the policy's.",
            ),
        ]
        | None
    ) = None
    parameters: Parameters | None = None


_request_decoder = msgspec.json.Decoder(InferenceRequest)


class BadRequestBody(ValueError):
    """The body is not an InferenceRequest; the message says where and why."""


def decode_inference_request(body: bytes) -> InferenceRequest:
    """Strict, typed decoding: wrong types (``"500"``, ``1e3`` for an integer),
    unknown fields, invalid UTF-8 and malformed JSON are all refused. The
    schema is flat, so nested JSON is refused at its first level, without
    recursing into it however deep it goes."""
    try:
        return _request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequestBody(f"invalid request body: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise BadRequestBody("the request body is not valid JSON in UTF-8") from None


def _openapi_schema(js: dict[str, Any], defs: dict[str, Any]) -> Schema:
    """msgspec's JSON schema of a struct, as Litestar's OpenAPI ``Schema``
    (the structs it refers to written in place)."""
    if "$ref" in js:
        return _openapi_schema(defs[js["$ref"].rsplit("/", 1)[-1]], defs)
    renames = {
        "minLength": "min_length",
        "maxLength": "max_length",
        "minimum": "minimum",
        "maximum": "maximum",
        "description": "description",
        "title": "title",
        "required": "required",
    }
    fields: dict[str, Any] = {dst: js[src] for src, dst in renames.items() if src in js}
    if "type" in js:
        fields["type"] = OpenAPIType(js["type"])
    if "properties" in js:
        fields["properties"] = {k: _openapi_schema(v, defs) for k, v in js["properties"].items()}
    if "items" in js:
        fields["items"] = _openapi_schema(js["items"], defs)
    extra = js.get("additionalProperties")
    if isinstance(extra, dict):
        fields["additional_properties"] = _openapi_schema(extra, defs)
    elif extra is not None:
        fields["additional_properties"] = extra
    if "anyOf" in js:
        fields["any_of"] = [_openapi_schema(v, defs) for v in js["anyOf"]]
    return Schema(**fields)


def request_body(struct: type) -> RequestBody:
    """The OpenAPI request body of a route that reads its body itself (as raw bytes)."""
    js = msgspec.json.schema(struct)
    return RequestBody(
        content={
            "application/json": OpenAPIMediaType(
                schema=_openapi_schema(js["$defs"][struct.__name__], js["$defs"])
            )
        },
        required=True,
    )


def inference_request_body() -> RequestBody:
    """The OpenAPI request body of /v1/inference."""
    return request_body(InferenceRequest)


class Metadata(msgspec.Struct, omit_defaults=True):
    # The output's length in the backend's tokens (its tokenizer's, or words).
    tokens_used: int
    latency_ms: float
    # The backend's fingerprint: what decided the output.
    model_version: str
    # The input's length in them (the OpenAI routes' usage; not sent here).
    input_tokens: int | None = None
    # The backend answered with nothing: said, not left to an empty string
    # (an instruct model often ends at once on a prompt outside its chat
    # template: /v1/chat/completions renders one for it).
    empty: bool = False


class InferenceResponse(msgspec.Struct, omit_defaults=True):
    request_id: str
    output: str
    latency_ms: float
    tier: str
    batch_size: int
    queue_ms: int
    # "model": its own slot of a backend call; "collapsed": an identical
    # input's slot in the same batch; "cache": the result cache.
    served_by: str
    # The model that answered (a job's result leaves both out).
    model: str | None = None
    metadata: Metadata | None = None


class ModelCard(msgspec.Struct):
    id: str
    # When this gateway started serving it (seconds since the epoch).
    created: int = 0
    object: str = "model"
    owned_by: str = "infergate"


class ModelList(msgspec.Struct):
    """The models the calling key may use."""

    data: list[ModelCard]
    object: str = "list"


class JobAccepted(msgspec.Struct):
    job_id: str
    status: str
    location: str


class JobView(msgspec.Struct, omit_defaults=True):
    """A job as its owner sees it: ``queued``, ``running``, ``succeeded``
    (with the synchronous reply's fields), ``failed`` (with the error shape),
    ``cancelled`` or ``expired``."""

    job_id: str
    status: str
    tier: str
    created_ms: int
    done_ms: int | None = None
    result: InferenceResponse | None = None
    error: ErrorDetail | None = None


class Readiness(msgspec.Struct):
    ready: bool
    redis_ok: bool
    workers_alive: int
    draining: bool
    # Redis refuses writes for want of memory: new work is refused (503).
    redis_full: bool = False
    # Redis's used memory over its maxmemory, the highest among shards (0:
    # no maxmemory, or unread); past limits.redis_memory_high_water new work
    # is refused, free first.
    redis_memory_use: float = 0.0
    # The Redis shards, and those this gateway can serve keys on now (ready
    # while one is: a shard that is down refuses only its own keys).
    shards: int = 1
    shards_ready: int = 1
    # Redis is unreachable and this gateway serves the policy's direct.tiers
    # itself (direct mode): ready for them, 503 for the rest.
    direct_mode: bool = False


class WorkerStatus(msgspec.Struct):
    id: str
    busy: bool
    # Finishing its batch before it exits; not counted as capacity.
    draining: bool
    # The server its backend calls does not answer: it takes nothing meanwhile,
    # and is not counted as capacity.
    upstream_down: bool
    batches_done: int
    requests_done: int
    delivered_rps: float
    # Measured batch time, and the most it can deliver at the live policy's batch size.
    batch_ms: float
    capacity_rps: float


class StatusResponse(msgspec.Struct):
    gateway_id: str
    policy_version: str
    redis_ok: bool
    workers_alive: int
    workers_busy: int
    workers: list[WorkerStatus]
    dispatchers_alive: int
    gateways_alive: int
    queue_depth: dict[str, int]
    batches_formed: int
    requests_batched: int
    mean_batch_size: float
    expired_dropped: int
    # Every fleet counter: batches_formed, requests_batched, expired_dropped,
    # cancelled_dropped, requeued, batches_retried, batches_dead_lettered, ...
    counters: dict[str, int]
    pending_here: int
    # Replies for requests no longer waiting here (a retried batch's duplicate, or late after a 504).
    replies_ignored: int
    # Admission: planned capacity (measured x target utilization) and the
    # estimated queueing delay a new request of each tier would see.
    capacity_rps: float
    estimated_wait_ms: dict[str, float | None]
    policy_error: str | None = None


class AdminPolicy(msgspec.Struct):
    version: str
    source: str
    error: str | None
    # The active document; key digests are left out.
    policy: dict[str, object]


class ReloadResult(msgspec.Struct):
    changed: bool
    version: str
    error: str | None


class DeadLetters(msgspec.Struct):
    """The dead-letter list: its size and its newest batches (no inputs)."""

    total: int
    batches: list[DeadLetter]


class UsageReport(msgspec.Struct):
    """What each key used from ``since`` (whole hours) to now: answered
    requests, their input characters and tokens, their output tokens, their
    share of GPU time, refusals; a row per key, or per key and hour or day."""

    since: str
    until: str
    keys: list[KeyUsage]


class KeyBudget(msgspec.Struct):
    """One budget of one key in its current period: what it allows, what is
    spent (answered requests' use, and the reservations of those in flight),
    and what is left."""

    key_id: str
    tier: str
    unit: str  # "tokens" or "gpu_seconds"
    budget: int | float
    spent: int | float
    left: int | float
    period: str
    ends: str  # when the period ends (ISO 8601, UTC)


class BudgetReport(msgspec.Struct):
    at: str
    keys: list[KeyBudget]


class DeadLettersPurged(msgspec.Struct):
    purged: int
