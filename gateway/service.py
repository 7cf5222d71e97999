"""The gateway's work for one request: who, what, enqueue, wait, answer.

One instance per gateway process holds the Redis client, the reply router,
the fleet view and the active policy.
"""

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.exceptions

from dispatcher import wire
from dispatcher.broker import Broker, connect
from dispatcher.fleet import FleetView
from dispatcher.heartbeat import Heartbeater
from dispatcher.keys import TIERS, Keys
from gateway.admission import Admission
from gateway.api import (
    AdminPolicy,
    InferenceRequest,
    InferenceResponse,
    ReloadResult,
    StatusResponse,
    WorkerStatus,
)
from gateway.errors import ApiError
from gateway.quota import Quota
from gateway.replies import ReplyRouter
from infergate import clock, logs, tracing
from infergate.settings import ProcessSettings
from policies import KeyEntry, Policy
from policies.live import LivePolicy

log = logs.get(__name__)
_tracer = tracing.tracer(__name__)

RETRY_NO_WORKER_MS = 1_000
RETRY_REDIS_MS = 1_000
RETRY_DRAINING_MS = 100


def redis_unreachable() -> ApiError:
    return ApiError("SERVICE_OVERLOADED", "the queue store is unreachable", RETRY_REDIS_MS)


Receive = Callable[[], Awaitable[Any]]


class ClientGone(Exception):
    """The client closed its connection while its request waited."""


async def _watch_disconnect(receive: Receive, future: asyncio.Future[wire.Result]) -> None:
    """Fails ``future`` with ClientGone when the client disconnects. (The
    body has been read, so the next ASGI message is the disconnect.)"""
    while not future.done():
        message = await receive()
        if message.get("type") == "http.disconnect":
            if not future.done():
                future.set_exception(ClientGone())
            return


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
        self.keys = Keys(settings.namespace)
        self.redis = connect(settings.redis_url, name="gateway:" + self.id)
        self.broker = Broker(self.redis, self.keys)
        self.replies = ReplyRouter(self.redis, self.keys.reply_channel(self.id))
        self.fleet = FleetView(self.broker, settings.fleet_refresh_ms)
        self.quota = Quota(self.redis, self.keys.ratelimit_prefix())
        self.admission = Admission(self.fleet)
        self.started_ms = clock.now_ms()
        self.served = 0
        self.draining = False
        self.heartbeat = Heartbeater(
            self.broker,
            lambda: wire.Heartbeat(
                "gateway", self.id, self.started_ms, clock.now_ms(), requests_done=self.served
            ),
            settings.heartbeat_interval_ms,
            settings.heartbeat_ttl_ms,
        )

    def ready_for_replies(self) -> bool:
        """Redis answers AND this gateway is subscribed to its reply channel: a
        request admitted while the subscription is down (after a Redis restart)
        would have its reply published to no one."""
        return self.fleet.redis_ok and self.replies.subscribed.is_set()

    async def start(self) -> None:
        self.policy.start()
        await self.fleet.start()
        await self.replies.start()
        self.heartbeat.start()
        log.info("gateway.started", gateway_id=self.id, policy_version=self.policy.current.version)

    async def stop(self) -> None:
        await self.policy.stop()
        await self.heartbeat.stop()
        await self.replies.stop()
        await self.fleet.stop()
        try:
            await self.broker.retire("gateway", self.id)
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning("gateway.retire_failed", error=type(exc).__name__)
        await self.redis.aclose()
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
        key = policy.key_for_digest(
            hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()
        )
        if key is None:
            raise ApiError("UNAUTHENTICATED", "unknown API key")
        if key.disabled:
            raise ApiError("KEY_DISABLED", "this API key is disabled")
        return key

    async def infer(
        self,
        request_id: str,
        authorization: str | None,
        body: InferenceRequest,
        receive: Receive | None = None,
    ) -> tuple[InferenceResponse, dict[str, str]]:
        """Who, capacity, quota (see README: how admission decides), then enqueue and wait.
        Returns the response and the headers it carries."""
        if not tracing.enabled:
            return await self._infer(request_id, authorization, body, receive)
        with _tracer.start_as_current_span("gateway.inference") as span:
            span.set_attribute("infergate.request_id", request_id)
            try:
                response, headers = await self._infer(request_id, authorization, body, receive)
            except ApiError as exc:
                span.set_attribute("http.response.status_code", exc.status)
                span.set_attribute("infergate.error_code", exc.code)
                raise
            span.set_attribute("http.response.status_code", 200)
            span.set_attribute("infergate.tier", response.tier)
            span.set_attribute("infergate.batch_size", response.batch_size)
            span.set_attribute("infergate.queue_ms", response.queue_ms)
            return response, headers

    async def _infer(
        self,
        request_id: str,
        authorization: str | None,
        body: InferenceRequest,
        receive: Receive | None,
    ) -> tuple[InferenceResponse, dict[str, str]]:
        started = clock.monotonic_s()
        if self.draining:
            raise ApiError(
                "SERVICE_OVERLOADED", "this gateway is shutting down; retry", RETRY_DRAINING_MS
            )
        policy = self.policy.current
        key = self.authenticate(authorization, policy)
        tier = policy.tiers[key.tier]
        if not body.input:
            raise ApiError("INVALID_INPUT", "input must be a non-empty string")
        if len(body.input) > tier.max_input_chars:
            raise ApiError(
                "INVALID_INPUT",
                f"input is {len(body.input)} characters; the {key.tier} tier allows {tier.max_input_chars}",
            )
        deadline_ms = (
            tier.deadline_ms if body.timeout_ms is None else min(tier.deadline_ms, body.timeout_ms)
        )
        if not self.ready_for_replies():
            raise redis_unreachable()
        if self.fleet.workers_alive == 0:
            raise ApiError(
                "SERVICE_OVERLOADED", "no healthy worker is available", RETRY_NO_WORKER_MS
            )
        # Capacity first: a local estimate with no Redis round trip, so under
        # overload a refusal costs next to nothing (and consumes no quota).
        decision = self.admission.decide(policy, key.tier)
        if not decision.admitted:
            raise ApiError(
                "SERVICE_OVERLOADED",
                f"the {key.tier} tier is at capacity: about {decision.wait_ms:.0f} ms of work is "
                f"queued ahead, over its {tier.latency_budget_ms} ms budget",
                decision.retry_after_ms,
            )
        try:
            quota = await self.quota.charge(key, tier, len(body.input))
        except (redis.exceptions.RedisError, OSError) as exc:
            self.fleet.mark_unreachable()
            raise redis_unreachable() from exc
        headers = quota.headers()
        if not quota.allowed:
            raise ApiError(
                "RATE_LIMITED",
                f"rate limit {quota.refused_by} exceeded for this key",
                quota.retry_after_ms,
                headers,
            )
        self.admission.admitted(key.tier)
        try:
            result = await self._run(request_id, key, body.input, deadline_ms, started, receive)
        except ApiError as exc:
            exc.headers.update(headers)
            raise
        self.served += 1
        response = InferenceResponse(
            request_id=request_id,
            output=result.output or "",
            latency_ms=round(clock.elapsed_ms(started), 2),
            tier=key.tier,
            batch_size=result.batch_size,
            queue_ms=result.queue_ms,
        )
        return response, headers

    async def _run(
        self,
        request_id: str,
        key: KeyEntry,
        text: str,
        deadline_ms: int,
        started: float,
        receive: Receive | None,
    ) -> wire.Result:
        now_ms = clock.now_ms()
        envelope = wire.Envelope(
            id=request_id,
            gateway=self.id,
            tier=key.tier,
            key_id=key.id,
            input=text,
            enqueued_ms=now_ms,
            deadline_ms=now_ms + deadline_ms,
            trace=tracing.current_traceparent(),
        )
        future = self.replies.park(request_id)
        try:
            try:
                await self.broker.enqueue(key.tier, wire.encode(envelope))
            except (redis.exceptions.RedisError, OSError) as exc:
                log.warning(
                    "request.enqueue_failed", request_id=request_id, error=type(exc).__name__
                )
                self.fleet.mark_unreachable()
                raise redis_unreachable() from exc
            remaining_s = deadline_ms / 1000.0 - (clock.monotonic_s() - started)
            watcher = (
                asyncio.ensure_future(_watch_disconnect(receive, future))
                if receive is not None
                else None
            )
            try:
                async with asyncio.timeout(max(0.0, remaining_s)):
                    result = await future
            except TimeoutError:
                raise ApiError(
                    "TIMEOUT", f"no result within the {deadline_ms} ms deadline"
                ) from None
            except ClientGone:
                await self._cancel(request_id, envelope.deadline_ms)
                raise ApiError("CLIENT_CLOSED", "the client disconnected") from None
            finally:
                if watcher is not None:
                    watcher.cancel()
        finally:
            self.replies.forget(request_id)
        if result.error is not None:
            log.warning(
                "request.failed",
                request_id=request_id,
                batch_id=result.batch_id,
                code=result.error.code,
            )
            raise ApiError("INFERENCE_FAILED", result.error.message)
        return result

    async def _cancel(self, request_id: str, deadline_ms: int) -> None:
        """The client left: mark the request so ``take`` drops it before a worker sees it."""
        try:
            await self.broker.cancel(request_id, deadline_ms)
            log.info("request.cancelled", request_id=request_id)
        except (redis.exceptions.RedisError, OSError) as exc:
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
        return AdminPolicy(policy.version, policy.source, self.policy.error, document)

    def reload_policy(self) -> ReloadResult:
        changed = self.policy.reload()
        return ReloadResult(changed, self.policy.current.version, self.policy.error)

    async def status(self) -> StatusResponse:
        try:
            workers = await self.broker.alive("worker")
            dispatchers = await self.broker.alive("dispatcher")
            gateways = await self.broker.alive("gateway")
            snapshot = await self.broker.fleet_snapshot(clock.now_ms())
            stats = await self.broker.stats()
        except (redis.exceptions.RedisError, OSError) as exc:
            raise redis_unreachable() from exc
        policy = self.policy.current
        batches = stats.get("batches_formed", 0)
        batched = stats.get("requests_batched", 0)
        return StatusResponse(
            gateway_id=self.id,
            policy_version=self.policy.current.version,
            policy_error=self.policy.error,
            redis_ok=True,
            workers_alive=len(workers),
            workers_busy=sum(w.busy for w in workers),
            workers=[
                WorkerStatus(
                    w.id, w.busy, w.batches_done, w.requests_done, w.delivered_rps, w.capacity_rps
                )
                for w in workers
            ],
            dispatchers_alive=len(dispatchers),
            gateways_alive=len(gateways),
            queue_depth=snapshot.queue_depth,
            batches_formed=batches,
            requests_batched=batched,
            mean_batch_size=round(batched / batches, 2) if batches else 0.0,
            expired_dropped=stats.get("expired_dropped", 0),
            counters=stats,
            pending_here=len(self.replies.pending),
            replies_ignored=self.replies.duplicates,
            capacity_rps=round(self.admission.capacity_rps(policy), 1),
            estimated_wait_ms={
                t: (None if w == float("inf") else round(w, 1))
                for t in TIERS
                for w in [self.admission.estimate_wait_ms(policy, t)]
            },
        )
