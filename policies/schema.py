"""The policy's typed sections. Field names and defaults here are the
document's; ``policies/example.yaml`` shows and explains every one."""

from typing import Any, Literal

import msgspec


class Budget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # What one key may use each period (UTC, on Redis's clock; a week starts
    # on Monday): GPU time (its requests' measured shares of their batches),
    # tokens (input plus output), or both. Reserved as a request is admitted,
    # the unused part given back as it is answered; at the cap, 429
    # BUDGET_EXCEEDED until the period ends.
    gpu_seconds: float | None = None
    tokens: int | None = None
    period: Literal["day", "week", "month"] = "month"


class Tier(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # How long a request may wait in total before it is answered 504.
    deadline_ms: int = 10_000
    # Longest input, in characters; longer is 400 INVALID_INPUT.
    max_input_chars: int = 4_096
    # Admission: the latency this tier promises (its wait and its own batch);
    # a request that cannot be answered within it is refused with 503.
    latency_budget_ms: int = 1_000
    # Rate limits in the `limits` notation, e.g. ["100/second", "5000/minute"].
    rate_limits: list[str] = msgspec.field(default_factory=list)
    # Optional cost limit on input characters, e.g. "200000/minute".
    cost_limit: str | None = None
    # Token limits, input plus output in the model's tokens, e.g.
    # ["100000/minute"]: reserved as a request is admitted, the unused part
    # given back as it is answered; a hard bound across every gateway.
    token_limits: list[str] = msgspec.field(default_factory=list)
    # Each of its keys' budget (a key's own overrides it).
    budget: Budget | None = None
    # The share of every batch reserved for this tier when it has work (0-1).
    min_batch_share: float = 0.0
    # An asynchronous job (POST /v1/jobs) not started by then is 'expired'.
    job_deadline_ms: int = 3_600_000


class KeyEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    tier: str
    # Hex SHA-256 of the secret key; the plaintext is never stored.
    sha256: str
    disabled: bool = False
    admin: bool = False
    # Overrides the tier's rate limits (token limits, budget) for this key when given.
    rate_limits: list[str] | None = None
    token_limits: list[str] | None = None
    budget: Budget | None = None
    # Its share of its tier against the tier's other keys with requests
    # waiting (fair queuing), relative to theirs: 2 gets twice a 1's share.
    weight: float = 1.0


class Batching(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_batch_size: int = 100
    # Space hand-offs batch_time/workers apart while less than a full batch waits,
    # so workers run staggered instead of in lockstep (see dispatcher/service.py).
    pacing: bool = True


class Capacity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Admission plans for the fleet running at this fraction of its measured capacity.
    target_utilization: float = 0.85


class Autoscale(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # The worker count the fleet needs is demand / (per-worker capacity x this):
    # below admission's target, so workers are added before requests are refused.
    target_utilization: float = 0.7
    # The signal falls only after demand has stayed lower this long (GPU cold
    # starts take minutes: removing a worker too soon costs more than keeping it).
    scale_down_after_s: float = 300.0


class Jobs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # A finished job's result (or error) is kept this long, then gone.
    result_ttl_s: float = 600.0
    # More queued jobs than this for one key: 429 until some run.
    max_queued_per_key: int = 1_000
    # A batch of jobs alone runs only while this many other workers stay idle
    # (or no synchronous batch ran for 2 s), so synchronous requests never wait
    # behind a batch of jobs. Jobs always fill the free slots of other batches.
    headroom_workers: int = 1


class Sharing(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Who may share an answer: "key" (only requests of the same key), "tier"
    # or "shared" (everyone). Wider scopes save more GPU time but tell a
    # client, by a fast answer, that someone else sent the same input (SECURITY.md).
    scope: str = "key"
    # Identical requests in flight at one gateway (in the scope) wait for one
    # result instead of taking a slot each.
    collapse: bool = True
    # Answers are kept this long and served by the gateway without queueing
    # (0: off; the default, because a sampling model's users expect a fresh
    # sample each time; infergate's transformers backend decodes greedily).
    cache_ttl_s: float = 0.0


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Request bodies larger than this are refused with 413.
    max_body_bytes: int = 65_536
    # The share of a gateway's connections one key may hold with requests
    # that wait (synchronous inferences, job long polls); one more is 429.
    key_connection_share: float = 0.25
    # Past this share of Redis's maxmemory new work is refused (503), the
    # lowest tier first: free at the mark, paid a third of the way on to
    # full, enterprise two thirds. 1: Redis's own refusal alone. A Redis with
    # no maxmemory has no mark.
    redis_memory_high_water: float = 0.8


class Direct(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Direct mode: while a gateway cannot reach Redis, it serves these tiers'
    # requests itself, batched, when their model's backend is a server it can
    # call (http:, kserve-v2:, openai:); every other request gets 503 as
    # before. Empty: off.
    tiers: list[str] = msgspec.field(default_factory=list)
    # The most requests one gateway holds in direct mode at once (waiting
    # or in a call); one more gets 503.
    max_requests: int = 64


class Workers(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # A backend call running past this is a hung worker (it exits, the batch is retried).
    hang_timeout_ms: int = 2_000
    # Batches one worker keeps in flight (its slots): 1 for a backend in the
    # worker's process; an engine that batches by itself (openai:URL) keeps
    # its GPU full with several.
    concurrency: int = 1
    # Runs of a batch before it is dead-lettered and its requests get INFERENCE_FAILED.
    # Each run of a batch that hangs costs about hang_timeout_ms + the heartbeat TTL
    # + a reaper interval (2 + 1 + 0.5 s by default): with the defaults the last
    # run ends after about 7 s, inside a 10 s deadline. A request whose deadline
    # is shorter than that gets 504 TIMEOUT first.
    max_attempts: int = 2


class Usage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Usage per key (requests, input characters, GPU time), kept per hour for
    # this long (GET /v1/admin/usage, `infergate usage`). Read by workers at start.
    retention_days: float = 35.0


class Model(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model the deployment serves: who may use it, how its workers run
    it (``infergate worker --model-name NAME`` reads these; its flags win),
    and its own batching and worker settings (default: the policy's)."""

    # Who may use it: these tiers (empty: every tier), and of them these
    # keys by id (empty: every key of those tiers).
    tiers: list[str] = msgspec.field(default_factory=list)
    keys: list[str] = msgspec.field(default_factory=list)
    # simulated, transformers, python:pkg.module:attr (the team's code), or a
    # server the workers call with the whole batch: http:URL, kserve-v2:URL,
    # openai:URL (policies/backends.py); ``options`` go to it (a python
    # backend's keyword arguments, a server's model name, timeout, credentials).
    backend: str = "simulated"
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    # transformers: the model's folder (or hub id), the GGUF file in it, the
    # most new tokens per input (a request's max_tokens may ask for fewer),
    # and the torch device (default: cuda when present).
    path: str | None = None
    gguf_file: str | None = None
    max_new_tokens: int = 16
    device: str | None = None
    # simulated: its time per batch.
    sim_latency_ms: float = 100.0
    batching: Batching | None = None
    workers: Workers | None = None


class Jwt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Bearer tokens that are JWTs, beside API keys: signed by the identity
    provider's keys (its JWKS, from a file or a URL, read off the request
    path), for this issuer and audience; a claim names the key id and one
    the tier."""

    issuer: str
    audience: str | list[str]
    jwks_file: str | None = None
    jwks_url: str | None = None
    # The claim whose value is the key id (quotas, usage, fairness), and the
    # one whose value is the tier.
    key_claim: str = "sub"
    tier_claim: str = "tier"
    # Asymmetric only: never "none", never an HMAC.
    algorithms: list[str] = msgspec.field(default_factory=lambda: ["RS256", "ES256"])
    # Clock skew allowed on exp and nbf.
    leeway_s: float = 30.0
    # The tiers a token may claim (empty: every tier of the policy).
    tiers: list[str] = msgspec.field(default_factory=list)
    # The key set is read again this often, and on a kid it lacks (at most once a minute).
    refresh_s: float = 300.0


class Auth(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    jwt: Jwt | None = None


class ChatTemplate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A conversation as the backend's one input: ``prefix``, then each
    message as ``message`` with ``{role}`` and ``{content}`` replaced, then ``suffix``."""

    message: str
    prefix: str = ""
    suffix: str = ""


class OpenAI(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # How /v1/chat/completions renders a conversation (none: the last user
    # message's content alone).
    chat_template: ChatTemplate | None = None


class Document(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The YAML document as written."""

    tiers: dict[str, Tier]
    keys: list[KeyEntry] = msgspec.field(default_factory=list)
    batching: Batching = msgspec.field(default_factory=Batching)
    capacity: Capacity = msgspec.field(default_factory=Capacity)
    autoscale: Autoscale = msgspec.field(default_factory=Autoscale)
    jobs: Jobs = msgspec.field(default_factory=Jobs)
    sharing: Sharing = msgspec.field(default_factory=Sharing)
    limits: Limits = msgspec.field(default_factory=Limits)
    direct: Direct = msgspec.field(default_factory=Direct)
    workers: Workers = msgspec.field(default_factory=Workers)
    usage: Usage = msgspec.field(default_factory=Usage)
    # The models served (none: one, ``default``, run as the workers' flags
    # say), and the one a request that names none gets (default: the first).
    models: dict[str, Model] = msgspec.field(default_factory=dict)
    default_model: str | None = None
    auth: Auth = msgspec.field(default_factory=Auth)
    openai: OpenAI = msgspec.field(default_factory=OpenAI)


DEFAULT_MODEL = "default"
ONE_MODEL = {DEFAULT_MODEL: Model()}  # (read per request: made once)


class Policy(msgspec.Struct, frozen=True):
    """A validated document plus what is derived from it once."""

    document: Document
    # Short content hash, shown in /v1/status so operators know which policy runs.
    version: str
    source: str
    keys_by_digest: dict[str, KeyEntry]
    # Each model's view (``for_model``), made once.
    views: dict[str, "Policy"] = msgspec.field(default_factory=dict)

    @property
    def models(self) -> dict[str, Model]:
        """The models served, by name (``default`` when the policy lists none)."""
        return self.document.models or ONE_MODEL

    @property
    def default_model(self) -> str:
        return self.document.default_model or next(iter(self.models))

    def may_use(self, key: KeyEntry, model: str) -> bool:
        entry = self.models[model]
        return (not entry.tiers or key.tier in entry.tiers) and (
            not entry.keys or key.id in entry.keys
        )

    def for_model(self, model: str) -> "Policy":
        """This policy as one model's processes see it: its batching and
        worker settings in place of the policy's (the same policy if it has
        none of its own, or is not listed)."""
        view = self.views.get(model)
        if view is not None:
            return view
        entry = self.document.models.get(model)
        if entry is None or (entry.batching is None and entry.workers is None):
            view = self
        else:
            document = msgspec.structs.replace(
                self.document,
                batching=entry.batching or self.document.batching,
                workers=entry.workers or self.document.workers,
            )
            view = Policy(document, self.version, self.source, self.keys_by_digest)
        self.views[model] = view
        return view

    @property
    def tiers(self) -> dict[str, Tier]:
        return self.document.tiers

    def key_for_digest(self, digest: str) -> KeyEntry | None:
        return self.keys_by_digest.get(digest)

    def latency_budgets_s(self) -> dict[str, float]:
        return {name: tier.latency_budget_ms / 1000.0 for name, tier in self.tiers.items()}

    def reserved_slots(self, tier: str) -> int:
        """Slots of every batch reserved for a tier: at least one for any share."""
        share = self.document.tiers[tier].min_batch_share
        max_batch = self.document.batching.max_batch_size
        return max(1, round(share * max_batch)) if share > 0 else 0
