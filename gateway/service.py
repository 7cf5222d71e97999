"""The gateway's work for one request: who, what, enqueue, wait, answer.

One instance per gateway process holds the Redis client, the reply router,
the fleet view and the active policy.
"""

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from infergate.base import clock, logs, tracing, wire
from infergate.base.errors import STORE_ERRORS, UNAVAILABLE
from infergate.base.fleet import FleetView, fleet_reading, worker_capacity_rps
from infergate.base.heartbeat import Heartbeater
from infergate.base.loops import Supervised
from infergate.base.metrics import (
    NO_TIER,
    FleetCollector,
    FleetReading,
    GatewayMetrics,
    watch_policy_and_redis,
)
from infergate.base.probes import Probes
from infergate.base.queue.gateway import GatewayQueue
from infergate.base.queue.inputs import Beside
from infergate.base.queue.policy_copy import keep_policy
from infergate.base.queue.store import Store
from infergate.base.settings import ProcessSettings
from infergate.base.tiers import TIERS
from infergate.gateway.admission import Admission
from infergate.gateway.api import (
    AdminPolicy,
    BadRequestBody,
    DeadLetters,
    DeadLettersPurged,
    InferenceRequest,
    InferenceResponse,
    ReloadResult,
    StatusResponse,
    WorkerStatus,
    decode_inference_request,
)
from infergate.gateway.errors import ApiError, error_from_result
from infergate.gateway.quota import Quota
from infergate.gateway.replies import ReplyRouter
from infergate.gateway.sharing import Cache, Collapsing, input_digest, scope_owner
from infergate.policies import KeyEntry, Policy, Tier
from infergate.policies.live import LivePolicy
from infergate.policies.loader import digest
from prometheus_client import CollectorRegistry

log = logs.get(__name__)
_tracer = tracing.tracer(__name__)

RETRY_NO_WORKER_MS = 1_000
RETRY_REDIS_MS = 1_000
RETRY_DRAINING_MS = 100
KNOWN_KEYS_MAX = 10_000

# The fleet counters /v1/status always shows (0 until something happens).
COUNTERS = (
    "batches_formed",
    "requests_batched",
    "expired_dropped",
    "cancelled_dropped",
    "malformed_dropped",
    "requeued",
    "batches_retried",
    "batches_dead_lettered",
)


def redis_unreachable() -> ApiError:
    return ApiError("SERVICE_OVERLOADED", "the queue store is unreachable", RETRY_REDIS_MS)


# Registers what to run if the client disconnects while its request waits
# (None clears it). The HTTP edge runs it from the connection's loss: no task
# per request reading the connection for a disconnect.
OnDisconnect = Callable[[Callable[[], None] | None], None]


@dataclass(frozen=True)
class Call:
    """One call of /v1/inference, as the HTTP layer hands it over."""

    request_id: str
    authorization: str | None
    body: bytes
    on_disconnect: OnDisconnect | None = None
    # W3C trace context from the caller (used only when tracing is on).
    traceparent: str | None = None
    tracestate: str | None = None


class ClientGone(Exception):
    """The client closed its connection while its request waited."""


def _fail(future: "asyncio.Future[wire.Result]", error: type[Exception]) -> None:
    if not future.done():
        future.set_exception(error())


@dataclass(frozen=True)
class Share:
    """How a request may share its answer (``sharing`` in the policy)."""

    # The input within its scope: who may share it, and the text (a dict key
    # of this process; no hashing on the request path unless the cache is on).
    identity: tuple[str, str]
    collapse: bool
    cache_ttl_ms: int
    # The cache's key (a SHA-256 of the identity), only with the cache on.
    digest: str | None

    @classmethod
    def of(cls, policy: Policy, key: KeyEntry, text: str) -> "Share | None":
        sharing = policy.document.sharing
        cache_ttl_ms = round(sharing.cache_ttl_s * 1000)
        if not sharing.collapse and cache_ttl_ms <= 0:
            return None
        owner = scope_owner(sharing.scope, key)
        digest = input_digest(owner, text) if cache_ttl_ms > 0 else None
        return cls((owner, text), sharing.collapse, cache_ttl_ms, digest)


@dataclass
class Request:
    """One admitted request on its way to a worker."""

    id: str
    key: KeyEntry
    tier: Tier
    text: str
    deadline_ms: int
    started: float
    share: Share | None
    # The x-ratelimit-* headers, once the request's quota is charged: by its
    # first enqueue (the same round trip), or before it follows another.
    quota_headers: dict[str, str] | None = None


@dataclass(frozen=True)
class GatewaySettings(ProcessSettings):
    # The fleet view behind admission: queue depths at most this old, plus what
    # this gateway admitted since. Short, so a burst is seen within a few batches.
    fleet_refresh_ms: int = 50


class Gateway:
    def __init__(self, settings: GatewaySettings, policy: LivePolicy) -> None:
        self.settings = settings
        self.id = settings.process_id
        self.policy = policy
        self.store = Store.connect(
            settings.redis_url, settings.namespace, name="gateway:" + self.id
        )
        self.queue = GatewayQueue(self.store, self.id, lambda: self.metrics.forming.handed_one())
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.replies = ReplyRouter(self.queue, on_ignored=self.metrics.replies_ignored.inc)
        self.fleet = FleetView(self.store, settings.fleet_refresh_ms)
        self.quota = Quota(self.queue)
        self.collapsing = Collapsing()
        self.cache = Cache(self.queue, self.metrics.cache_bypassed.inc)
        self.admission = Admission(self.fleet)
        policy.keep_with(self._keep_policy)
        watch_policy_and_redis(self.metrics, policy, lambda: self.fleet.redis_ok)
        # Read on the event loop once a second; the scrape thread only reads the result.
        self._reading: FleetReading | None = None
        self.registry.register(FleetCollector(lambda: self._reading))
        self.metrics_reading = Supervised("metrics-reading", self._refresh_reading, 1.0)
        self.started_ms = clock.now_ms()
        self.served = 0
        # Demand, for the autoscaling signal (base/autoscale.py): admitted, and
        # refused for capacity. Carried by the heartbeat, never a command per request.
        self.admitted = 0
        self.refused_for_capacity = 0
        self.draining = False
        # Why the HTTP edge failed to read a request through its own fault
        # (``edge_failed``); such a gateway is not ready.
        self.edge_fault: str | None = None
        # Secrets already matched to a key of the active policy (``_key_of``).
        self._keys_policy: Policy | None = None
        self._keys_known: dict[str, KeyEntry] = {}
        self.heartbeat = Heartbeater(
            self.store,
            lambda: wire.Heartbeat(
                "gateway",
                self.id,
                self.started_ms,
                clock.now_ms(),
                requests_done=self.served,
                admitted=self.admitted,
                refused=self.refused_for_capacity,
            ),
            settings.heartbeat_interval_ms,
            settings.heartbeat_ttl_ms,
        )

    async def _refresh_reading(self) -> None:
        self._reading = self._fleet_reading()

    def _fleet_reading(self) -> FleetReading | None:
        policy = self.policy.current
        doc = policy.document
        reading = fleet_reading(
            self.fleet,
            doc.batching.max_batch_size,
            doc.capacity.target_utilization,
            policy.version,
            policy.latency_budgets_s(),
        )
        if reading is None:
            return None
        waits = {t: self.admission.estimate_wait_ms(policy, t) / 1000.0 for t in TIERS}
        return dataclasses.replace(reading, estimated_wait_s=waits)

    def ready_for_replies(self) -> bool:
        """Redis answers, the fleet view is fresh, AND this gateway listens on
        its reply channel: a request admitted while the subscription is down
        (after a Redis restart) would have its reply published to no one."""
        return self.fleet.redis_ok and self.replies.listening()

    def ready(self) -> bool:
        """Takes requests now: ready for replies, a worker alive, not draining."""
        return (
            self.ready_for_replies()
            and self.fleet.workers_alive > 0
            and not self.draining
            and self.edge_fault is None
        )

    def edge_failed(self, cause: str) -> None:
        """The edge could not read a request through its own fault: counted,
        and the gateway stays not ready (a fast path that fails one request
        fails them all) until it is restarted."""
        self.metrics.edge_faults.inc()
        self.edge_fault = cause

    def probes(self) -> Probes:
        return Probes(alive=self.heartbeat.alive, ready=self.ready)

    async def _keep_policy(self, policy: Policy, text: str) -> None:
        await keep_policy(self.store, policy.version, text)

    async def start(self) -> None:
        if self.policy.error is None:
            try:
                await self.policy.keep()
            except STORE_ERRORS as exc:
                log.warning("policy.keep_failed", error=type(exc).__name__)
        self.policy.start()
        await self.fleet.start()
        await self.replies.start()
        self.heartbeat.start()
        self.metrics_reading.start()
        log.info("gateway.started", gateway_id=self.id, policy_version=self.policy.current.version)

    async def stop(self) -> None:
        await self.metrics_reading.stop()
        await self.policy.stop()
        await self.heartbeat.stop()
        await self.replies.stop()
        await self.fleet.stop()
        try:
            await self.store.retire("gateway", self.id)
        except STORE_ERRORS as exc:
            log.warning("gateway.retire_failed", error=type(exc).__name__)
        await self.store.close()
        log.info("gateway.stopped", gateway_id=self.id)

    # -- one request ---------------------------------------------------------

    def authenticate(self, authorization: str | None, policy: Policy) -> KeyEntry:
        if not authorization:
            raise ApiError("UNAUTHENTICATED", "missing API key; send 'Authorization: Bearer <key>'")
        scheme, _, secret = authorization.strip().partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            raise ApiError(
                "UNAUTHENTICATED",
                "malformed Authorization header; send 'Authorization: Bearer <key>'",
            )
        key = self._key_of(secret, policy)
        if key is None:
            raise ApiError("UNAUTHENTICATED", "unknown API key")
        if key.disabled:
            raise ApiError("KEY_DISABLED", "this API key is disabled")
        return key

    def _key_of(self, secret: str, policy: Policy) -> KeyEntry | None:
        """The policy's key for ``secret``. A secret already matched is
        remembered (no SHA-256 per request): only secrets of the policy's own
        keys, so the memory is as bounded as the policy; a new policy
        forgets them all."""
        if policy is not self._keys_policy:
            self._keys_policy, self._keys_known = policy, {}
        key = self._keys_known.get(secret)
        if key is None:
            key = policy.key_for_digest(digest(secret))
            if key is not None and len(self._keys_known) < KNOWN_KEYS_MAX:
                self._keys_known[secret] = key
        return key

    async def infer(self, call: Call) -> tuple[InferenceResponse, dict[str, str]]:
        """Who, capacity, quota (docs/configuration.md: how admission decides), then enqueue
        and wait. Returns the response and the headers it carries; counts it."""
        started = clock.monotonic_s()
        trace_id = None
        try:
            if tracing.enabled:
                response, headers, trace_id = await self._infer_traced(call, started)
            else:
                response, headers = await self._infer(call, started)
        except ApiError as exc:
            self.metrics.requests.labels(exc.tier or NO_TIER, str(exc.status)).inc()
            raise
        answered, duration, queue_wait = self.metrics.answered[response.tier]
        answered.inc()
        exemplar = {"trace_id": trace_id} if trace_id else None
        duration.observe(clock.elapsed_s(started), exemplar)
        queue_wait.observe(response.queue_ms / 1000.0)
        return response, headers

    async def _infer_traced(
        self, call: Call, started: float
    ) -> tuple[InferenceResponse, dict[str, str], str | None]:
        """``_infer`` inside a span that joins the caller's trace when it sent one."""
        parent = tracing.context_from(call.traceparent, call.tracestate)
        with _tracer.start_as_current_span("gateway.inference", context=parent) as span:
            span.set_attribute("infergate.request_id", call.request_id)
            try:
                response, headers = await self._infer(call, started)
            except ApiError as exc:
                span.set_attribute("http.response.status_code", exc.status)
                span.set_attribute("infergate.error_code", exc.code)
                raise
            span.set_attribute("http.response.status_code", 200)
            span.set_attribute("infergate.tier", response.tier)
            span.set_attribute("infergate.batch_size", response.batch_size)
            span.set_attribute("infergate.queue_ms", response.queue_ms)
            return response, headers, tracing.trace_id(span)

    async def _infer(self, call: Call, started: float) -> tuple[InferenceResponse, dict[str, str]]:
        if self.draining:
            self.metrics.refusals.labels(NO_TIER, "draining").inc()
            raise ApiError(
                "SERVICE_OVERLOADED", "this gateway is shutting down; retry", RETRY_DRAINING_MS
            )
        policy = self.policy.current
        key = self.authenticate(call.authorization, policy)  # before the body is parsed
        try:
            return await self._serve(call, started, policy, key)
        except ApiError as exc:
            exc.tier = key.tier
            raise

    def read_body(self, raw: bytes, policy: Policy, key: KeyEntry) -> tuple[InferenceRequest, Tier]:
        """The request body, checked against the key's tier (400 if not fit)."""
        try:
            body = decode_inference_request(raw)
        except BadRequestBody as exc:
            raise ApiError("INVALID_INPUT", str(exc)) from None
        tier = policy.tiers[key.tier]
        check_input(body.input, key.tier, tier)
        return body, tier

    async def _serve(
        self, call: Call, started: float, policy: Policy, key: KeyEntry
    ) -> tuple[InferenceResponse, dict[str, str]]:
        body, tier = self.read_body(call.body, policy, key)
        share = Share.of(policy, key, body.input)
        cached = None if share is None or share.digest is None else await self._cached(share)
        if cached is not None:
            headers = await self.charge_quota(key, tier, len(body.input))
            self.metrics.cache_hits.labels(key.tier).inc()
            return self._response(call, started, key, cached), headers
        self._check_capacity(policy, key.tier)
        deadline_ms = (
            tier.deadline_ms if body.timeout_ms is None else min(tier.deadline_ms, body.timeout_ms)
        )
        request = Request(call.request_id, key, tier, body.input, deadline_ms, started, share)
        try:
            result = await self._collapsed_or_run(request, call.on_disconnect)
        except ApiError as exc:
            exc.headers.update(request.quota_headers or {})
            raise
        return self._response(call, started, key, result), request.quota_headers or {}

    def _response(
        self, call: Call, started: float, key: KeyEntry, result: wire.Result
    ) -> InferenceResponse:
        self.served += 1
        return InferenceResponse(
            request_id=call.request_id,
            output=result.output or "",
            latency_ms=round(clock.elapsed_ms(started), 2),
            tier=key.tier,
            batch_size=result.batch_size,
            queue_ms=result.queue_ms,
            served_by=result.served_by,
        )

    async def _cached(self, share: "Share | None") -> wire.Result | None:
        """The result cache's answer, if it is on and holds one for this
        input and the fleet's model."""
        if share is None or share.digest is None:
            return None
        fingerprint = self.fleet.fingerprint()
        if fingerprint is None:
            return None
        output = await self.cache.get(share.digest, fingerprint)
        if output is None:
            return None
        return wire.Result("", "", 0, "", 0, 0, output=output, served_by="cache")

    async def _collapsed_or_run(
        self, request: "Request", on_disconnect: OnDisconnect | None
    ) -> wire.Result:
        """Wait for an identical request already in flight here, or run this
        one (and let identical ones that arrive meanwhile wait for it). A
        leader that ends without a result hands over to one of its followers,
        and the others follow that one."""
        share = request.share
        if share is None or not share.collapse:
            return await self._run(request, on_disconnect)
        identity, collapsing = share.identity, self.collapsing
        while collapsing.leading(identity) and self._remaining_s(request) > 0:
            await self._admit(request)  # a follower pays its own way, once
            followed = await collapsing.follow(identity, self._remaining_s(request))
            if followed is not None:
                self.metrics.requests_joined.labels(request.key.tier).inc()
                if followed.error is not None:
                    raise error_from_result(followed.error)
                return msgspec.structs.replace(followed, served_by="collapsed")
        leader = collapsing.lead(identity)
        result: wire.Result | None = None
        try:
            result = await self._run(request, on_disconnect)
            return result
        except ApiError as exc:
            if exc.code == "INFERENCE_FAILED":  # the input's own failure: the same for all
                result = _failed(exc)
            raise
        finally:
            collapsing.end(identity, leader, result)

    @staticmethod
    def _remaining_s(request: "Request") -> float:
        return request.deadline_ms / 1000.0 - clock.elapsed_s(request.started)

    def _check_capacity(self, policy: Policy, tier_name: str) -> None:
        """Redis and a worker are there, and the tier's queue fits its budget.
        A local estimate with no Redis round trip, made before the quota is
        charged, so under overload a refusal costs next to nothing."""
        refused = self.metrics.refusals
        if not self.ready_for_replies():
            refused.labels(tier_name, "redis").inc()
            raise redis_unreachable()
        if self.fleet.workers_alive == 0:
            refused.labels(tier_name, "no_worker").inc()
            self.refused_for_capacity += 1
            raise ApiError(
                "SERVICE_OVERLOADED", "no healthy worker is available", RETRY_NO_WORKER_MS
            )
        decision = self.admission.decide(policy, tier_name)
        if not decision.admitted:
            refused.labels(tier_name, "capacity").inc()
            self.refused_for_capacity += 1
            budget_ms = policy.tiers[tier_name].latency_budget_ms
            raise ApiError(
                "SERVICE_OVERLOADED",
                f"the {tier_name} tier is at capacity: about {decision.wait_ms:.0f} ms of work is "
                f"queued ahead, over its {budget_ms} ms budget",
                decision.retry_after_ms,
            )
        self.admission.admitted(tier_name)

    async def _admit(self, request: "Request", envelope: wire.Envelope | None = None) -> None:
        """Charge the request's quota, once, and queue its envelope (when it
        has one): the two in one round trip the first time."""
        if request.quota_headers is not None:
            if envelope is not None:
                await self._enqueue(envelope)
            return
        key, queue_on = request.key, None if envelope is None else envelope.tier
        data, beside = (b"", None) if envelope is None else self.queue.stored(envelope)
        try:
            request.quota_headers = await self.charge_quota(
                key, request.tier, len(request.text), queue_on, data, beside
            )
        except ApiError:
            self.admission.released(key.tier)  # counted when it was let in
            raise
        self.admitted += 1

    async def charge_quota(
        self,
        key: KeyEntry,
        tier: Tier,
        input_chars: int,
        queue_on: str | None = None,
        envelope: bytes = b"",
        beside: Beside | None = None,
    ) -> dict[str, str]:
        """Charge the key's limits (and queue ``envelope`` on ``queue_on``, with
        its long input ``beside`` it, in the same step); returns the
        x-ratelimit-* headers, or raises 429."""
        try:
            quota = await self.quota.charge(key, tier, input_chars, queue_on, envelope, beside)
        except STORE_ERRORS as exc:
            self.metrics.refusals.labels(key.tier, "redis").inc()
            if isinstance(exc, UNAVAILABLE):  # not a script's own error: Redis itself
                self.fleet.mark_unreachable()
            raise redis_unreachable() from exc
        headers = quota.headers()
        if not quota.allowed:
            self.metrics.refusals.labels(key.tier, "quota").inc()
            raise ApiError(
                "RATE_LIMITED",
                f"rate limit {quota.refused_by} exceeded for this key",
                quota.retry_after_ms,
                headers,
            )
        return headers

    async def _run(self, request: "Request", on_disconnect: OnDisconnect | None) -> wire.Result:
        now_ms = clock.now_ms()
        request_id, key = request.id, request.key
        share = request.share
        # What is left of the deadline (a follower that ran on its own has used some).
        deadline_ms = round(self._remaining_s(request) * 1000)
        if deadline_ms <= 0:
            raise ApiError("TIMEOUT", f"no result within the {request.deadline_ms} ms deadline")
        envelope = wire.Envelope(
            id=request_id,
            gateway=self.id,
            tier=key.tier,
            key_id=key.id,
            input=request.text,
            enqueued_ms=now_ms,
            deadline_ms=now_ms + deadline_ms,
            trace=tracing.current_traceparent(),
            cache_key=share.digest if share else None,
            cache_ttl_ms=share.cache_ttl_ms if share else 0,
        )
        future = self.replies.park(request_id)
        try:
            await self._admit(request, envelope)
            result = await self._wait(future, envelope, self._remaining_s(request), on_disconnect)
        finally:
            self.replies.forget(request_id)
        if result.error is not None:
            log.warning(
                "request.failed",
                request_id=request_id,
                batch_id=result.batch_id,
                code=result.error.code,
            )
            raise error_from_result(result.error)
        return result

    async def _enqueue(self, envelope: wire.Envelope) -> None:
        try:
            await self.queue.enqueue(envelope.tier, *self.queue.stored(envelope))
        except STORE_ERRORS as exc:
            log.warning("request.enqueue_failed", request_id=envelope.id, error=type(exc).__name__)
            self.fleet.mark_unreachable()
            raise redis_unreachable() from exc

    async def _wait(
        self,
        future: asyncio.Future[wire.Result],
        envelope: wire.Envelope,
        remaining_s: float,
        on_disconnect: OnDisconnect | None,
    ) -> wire.Result:
        """The request's reply, or 504 at its deadline, or a cancel if the
        client leaves: one timer, and the edge's disconnect callback."""
        timer = asyncio.get_running_loop().call_later(
            max(0.0, remaining_s), _fail, future, TimeoutError
        )
        if on_disconnect is not None:
            on_disconnect(lambda: _fail(future, ClientGone))
        try:
            return await future
        except TimeoutError:
            timeout_ms = envelope.deadline_ms - envelope.enqueued_ms
            raise ApiError("TIMEOUT", f"no result within the {timeout_ms} ms deadline") from None
        except ClientGone:
            await self._cancel(envelope)
            raise ApiError("CLIENT_CLOSED", "the client disconnected") from None
        finally:
            timer.cancel()
            if on_disconnect is not None:
                on_disconnect(None)

    async def _cancel(self, envelope: wire.Envelope) -> None:
        """The client left: mark the request so ``take`` drops it (and its
        long input) before a worker sees it. One already in a batch runs;
        its input goes with the answer."""
        request_id = envelope.id
        try:
            await self.queue.cancel(request_id, envelope.deadline_ms)
            log.info("request.cancelled", request_id=request_id)
        except STORE_ERRORS as exc:
            log.warning("request.cancel_failed", request_id=request_id, error=type(exc).__name__)

    # -- operators ---------------------------------------------------------------

    def admin(self, authorization: str | None) -> KeyEntry:
        key = self.authenticate(authorization, self.policy.current)
        if not key.admin:
            raise ApiError(
                "FORBIDDEN", "this endpoint needs an admin key (admin: true in the policy)"
            )
        return key

    def admin_policy(self) -> AdminPolicy:
        policy = self.policy.current
        document: dict[str, Any] = msgspec.to_builtins(policy.document)
        for key in document.get("keys", []):
            key.pop("sha256", None)
        return AdminPolicy(policy.version, Path(policy.source).name, self.policy.error, document)

    async def reload_policy(self) -> ReloadResult:
        changed = await self.policy.reload()
        return ReloadResult(changed, self.policy.current.version, self.policy.error)

    async def dead_letters(self, limit: int) -> DeadLetters:
        try:
            total, batches = await self.queue.dead_letters(limit)
        except STORE_ERRORS as exc:
            raise redis_unreachable() from exc
        return DeadLetters(total, batches)

    async def purge_dead_letters(self) -> DeadLettersPurged:
        try:
            purged = await self.queue.purge_dead_letters()
        except STORE_ERRORS as exc:
            raise redis_unreachable() from exc
        log.info("admin.dead_letters_purged", purged=purged)
        return DeadLettersPurged(purged)

    async def status(self) -> StatusResponse:
        try:
            fleet = await self.store.fleet_status()
        except STORE_ERRORS as exc:
            raise redis_unreachable() from exc
        policy = self.policy.current
        max_batch = policy.document.batching.max_batch_size
        stats = fleet.counters
        workers = fleet.alive["worker"]
        batches = stats.get("batches_formed", 0)
        batched = stats.get("requests_batched", 0)
        return StatusResponse(
            gateway_id=self.id,
            policy_version=policy.version,
            policy_error=self.policy.error,
            redis_ok=True,
            workers_alive=len(workers),
            workers_busy=sum(w.busy for w in workers),
            workers=[
                WorkerStatus(
                    id=w.id,
                    busy=w.busy,
                    draining=w.draining,
                    batches_done=w.batches_done,
                    requests_done=w.requests_done,
                    delivered_rps=w.delivered_rps,
                    batch_ms=w.batch_ms,
                    capacity_rps=round(worker_capacity_rps(w, max_batch), 1),
                )
                for w in workers
            ],
            dispatchers_alive=len(fleet.alive["dispatcher"]),
            gateways_alive=len(fleet.alive["gateway"]),
            queue_depth=fleet.queue_depth,
            batches_formed=batches,
            requests_batched=batched,
            mean_batch_size=round(batched / batches, 2) if batches else 0.0,
            expired_dropped=stats.get("expired_dropped", 0),
            counters={name: stats.get(name, 0) for name in COUNTERS} | stats,
            pending_here=len(self.replies.pending),
            replies_ignored=self.replies.duplicates,
            capacity_rps=round(self.admission.capacity_rps(policy), 1),
            estimated_wait_ms={
                t: (None if w == float("inf") else round(w, 1))
                for t in TIERS
                for w in [self.admission.estimate_wait_ms(policy, t)]
            },
        )


def _failed(exc: ApiError) -> wire.Result:
    """A leader's failure, as the result its followers get."""
    return wire.Result("", "", 0, "", 0, 0, error=wire.ErrorInfo(exc.code, exc.message))


def check_input(text: str, tier_name: str, tier: Tier) -> None:
    if not text:
        raise ApiError("INVALID_INPUT", "input must be a non-empty string")
    if len(text) > tier.max_input_chars:
        raise ApiError(
            "INVALID_INPUT",
            f"input is {len(text)} characters; the {tier_name} tier allows {tier.max_input_chars}",
        )
