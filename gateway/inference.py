"""The request path of POST /v1/inference: who, what, enqueue, wait, answer.

The key is checked before the body is read; the result cache and an
identical request in flight are asked before the queue; capacity is a local
estimate (no round trip), then the quota is charged and the envelope queued
in one step; the request waits on its reply, its deadline or its client's
disconnect, whichever comes first.
"""

import asyncio
from collections.abc import Coroutine
from typing import Any

import msgspec
from infergate.base import clock, logs, tracing, wire
from infergate.base.errors import STORE_ERRORS
from infergate.base.metrics import NO_TIER
from infergate.base.queue.gateway import Place
from infergate.gateway import reservations
from infergate.gateway.api import (
    BadRequestBody,
    InferenceRequest,
    InferenceResponse,
    Metadata,
    decode_inference_request,
)
from infergate.gateway.calls import Call, OnDisconnect
from infergate.gateway.charging import (
    charge_quota,
    over_share,
    settle,
)
from infergate.gateway.checks import check_capacity, check_input, check_parameters, fit_fleet
from infergate.gateway.direct_serving import serve_directly
from infergate.gateway.errors import ApiError, error_from_result
from infergate.gateway.models import ModelLane
from infergate.gateway.request import Request
from infergate.gateway.reserving import (
    answer_cut,
    left_for_take,
    measured,
    reserve,
    reserved_by,
    settle_failed,
    settle_when_answered,
)
from infergate.gateway.service import Gateway
from infergate.gateway.sharing import Share
from infergate.gateway.waiting import cancel, wait_for_reply
from infergate.policies import KeyEntry, Policy, Tier

log = logs.get(__name__)
_tracer = tracing.tracer(__name__)

RETRY_DRAINING_MS = 100


class Inference:
    """A gateway's request path (its state, the gateway's)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

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
            self.count_refused(exc)
            raise
        answered, duration, queue_wait = self.gw.metrics.answered[response.tier]
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

    def count_refused(self, exc: ApiError) -> None:
        """A request answered with an error, in infergate_requests_total."""
        self.gw.metrics.requests.labels(exc.tier or NO_TIER, str(exc.status)).inc()

    async def _infer(self, call: Call, started: float) -> tuple[InferenceResponse, dict[str, str]]:
        if self.gw.draining:
            self.gw.metrics.refusals.labels(NO_TIER, "draining").inc()
            raise ApiError(
                "SERVICE_OVERLOADED", "this gateway is shutting down; retry", RETRY_DRAINING_MS
            )
        policy = self.gw.policy.current
        key = self.gw.authenticate(call.authorization, policy)  # before the body is parsed
        holds = None if call.held else self.gw.holds
        try:
            if holds is not None:
                holds.acquire(key.id, policy.document.limits.key_connection_share)
        except ApiError as exc:
            exc.tier = key.tier
            raise
        try:
            return await self._serve(call, started, policy, key)
        except ApiError as exc:
            exc.tier = key.tier
            raise
        finally:
            if holds is not None:
                holds.release(key.id)

    def read_body(
        self, raw: bytes | InferenceRequest, policy: Policy, key: KeyEntry
    ) -> tuple[InferenceRequest, Tier, ModelLane]:
        """The request body, checked against the key's tier (400), and the
        lane of the model it names (404, 403): not yet against its fleet."""
        try:
            body = decode_inference_request(raw) if isinstance(raw, bytes) else raw
        except BadRequestBody as exc:
            raise ApiError("INVALID_INPUT", str(exc)) from None
        tier = policy.tiers[key.tier]
        check_input(body.input, key.tier, tier)
        lane = self.gw.lanes.route(policy, key, body.model)
        return body, tier, lane

    async def _serve(
        self, call: Call, started: float, policy: Policy, key: KeyEntry
    ) -> tuple[InferenceResponse, dict[str, str]]:
        body, tier, lane = self.read_body(call.request or call.body, policy, key)
        direct = policy.document.direct.tiers  # (Redis away: direct mode, or 503 below)
        if direct and key.tier in direct and not self.gw.ready_for_replies(lane.shard):
            batcher = self.gw.direct.serves(policy, key.tier, lane.name)
            if batcher is not None:
                check_parameters(body.parameters, lane, policy.models[lane.name])  # (no read)
                result = await serve_directly(self.gw, lane, key, tier, body, batcher)
                return respond(call, started, key, lane, result), {}
        await fit_fleet(body.parameters, lane, policy.models[lane.name])
        await lane.fleet.fresh()  # (before the cache: the model its answers are kept for)
        params = body.parameters
        model = policy.models[lane.name]
        cut_to = answer_cut(lane, key, tier, params, model)
        share = Share.of(policy, key, body.input, params, call.conversation, cut_to)
        cached = None if share is None or share.digest is None else await _cached(lane, share)
        if cached is not None:
            headers = await _charge_cached(self.gw, call, lane, key, tier, body.input, cached)
            self.gw.metrics.cache_hits.labels(key.tier).inc()
            return respond(call, started, key, lane, cached), headers
        allowance = check_capacity(self.gw, lane, policy.for_model(lane.name), key)
        deadline_ms = (
            tier.deadline_ms if body.timeout_ms is None else min(tier.deadline_ms, body.timeout_ms)
        )
        request = Request(
            call.request_id, key, tier, lane, body.input, deadline_ms, started, share, allowance
        )
        if params is not None:
            request.max_tokens = params.max_tokens or 0
            request.temperature = params.temperature or 0.0
        request.count_input = call.count_input
        request.conversation = call.conversation
        reserve(self.gw, request, cut_to, whole=call.charged is None)
        if call.charged is not None:  # (one of a list: charged with it, not again)
            request.quota_headers, request.charged = call.charged.headers, call.charged
            request.reservation = call.charged.reservation_of(call.request_id)
        try:
            result = await self._collapsed_or_run(request, call.on_disconnect)
        except ApiError as exc:
            exc.headers.update(request.quota_headers or {})
            if exc.code == "INFERENCE_FAILED":  # (its input, or its leader's, failed)
                await settle_failed(request)
            raise
        used, gpu_us = reservations.used(result, request.input_bound), reservations.gpu_used(result)
        measured(request, result, gpu_us)
        if result.served_by == "collapsed":  # (no worker counts it: this gateway does)
            self.gw.shares.answered_here(
                key, lane.name, len(request.text), used - result.tokens, result.tokens
            )
        await settle(lane, request.reservation, used, gpu_us)
        return respond(call, started, key, lane, result), request.quota_headers or {}

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
        identity, collapsing = share.identity, request.lane.collapsing
        while collapsing.leading(identity) and _remaining_s(request) > 0:
            await self._admit(request)  # a follower pays its own way, once
            try:
                followed = await collapsing.follow(identity, _remaining_s(request))
            except asyncio.CancelledError:  # (it ran nothing: all it reserved goes back)
                await settle_failed(request)
                raise
            if followed is not None:
                self.gw.metrics.requests_joined.labels(request.key.tier).inc()
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

    async def _admit(self, request: "Request", envelope: wire.Envelope | None = None) -> None:
        """Charge the request's quota, once, and queue its envelope (when it
        has one): the two in one round trip the first time."""
        lane = request.lane
        if request.quota_headers is not None:
            if envelope is not None:
                try:
                    await _answered(self._enqueue(lane, envelope, request), request)
                except ApiError:
                    lane.admission.released(request.key.tier)  # counted when it was let in
                    raise
            if request.charged is not None:  # (its share of its list's charge is spent)
                request.charged.use(request.id)
                request.charged = None
                self.gw.count_admitted(request.key, lane)
            return
        key, queue_on = request.key, None if envelope is None else envelope.tier
        data, beside = (b"", None) if envelope is None else lane.queue.stored(envelope)
        try:
            quota = await charge_quota(
                self.gw,
                lane,
                key,
                request.tier,
                len(request.text),
                queue_on,
                data,
                beside,
                request.allowance,
                request.reserve,
                request.reserve_gpu_us,
            )
            request.quota_headers, request.reservation = quota.headers(), quota.reservation
        except ApiError:
            lane.admission.released(key.tier)  # counted when it was let in
            raise
        self.gw.count_admitted(key, lane)

    async def _run(self, request: "Request", on_disconnect: OnDisconnect | None) -> wire.Result:
        now_ms = clock.now_ms()
        request_id, key = request.id, request.key
        share = request.share
        # What is left of the deadline (a follower that ran on its own has used some).
        deadline_ms = round(_remaining_s(request) * 1000)
        if deadline_ms <= 0:  # (a follower's time ran out: it never queued)
            await settle_failed(request)
            raise ApiError("TIMEOUT", f"no result within the {request.deadline_ms} ms deadline")
        envelope = wire.Envelope(
            id=request_id,
            gateway=self.gw.id,
            tier=key.tier,
            key_id=key.id,
            input=request.text,
            enqueued_ms=now_ms,
            deadline_ms=now_ms + deadline_ms,
            trace=tracing.current_traceparent(),
            cache_key=share.digest if share else None,
            cache_ttl_ms=share.cache_ttl_ms if share else 0,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            count_input=request.count_input,
            conversation=request.conversation,
        )
        future = self.gw.replies.park(request_id, request.lane.shard)
        try:
            try:
                await self._admit(request, envelope)
            except asyncio.CancelledError:  # (its admit may still be on its way: withdrawn)
                await cancel(request.lane.queue, envelope, left_for_take(request))
                raise
            reserved = reserved_by(request)
            result = await wait_for_reply(
                request.lane.queue,
                future,
                envelope,
                _remaining_s(request),
                on_disconnect,
                reserved,
                deadline_ms=request.deadline_ms,
            )
        except (ApiError, asyncio.CancelledError) as exc:
            if not isinstance(exc, ApiError) or exc.code in ("TIMEOUT", "CLIENT_CLOSED"):
                settle_when_answered(self.gw, request, envelope.deadline_ms)
            raise
        finally:
            self.gw.replies.forget(request_id)
        if result.error is not None:
            log.warning(
                "request.failed",
                request_id=request_id,
                batch_id=result.batch_id,
                code=result.error.code,
            )
            await settle_failed(request)
            raise error_from_result(result.error)
        return result

    async def _enqueue(self, lane: ModelLane, envelope: wire.Envelope, request: "Request") -> None:
        """Queue the envelope of a request whose quota is charged already (an
        identical request's follower that runs on its own, one of a list of
        prompts), within its key's share of its tier, as an admit is."""
        key = request.key
        place = Place(
            key.id,
            max(1, len(request.text)),
            key.weight,
            request.allowance,
            self.gw.shares.recent_weight(key.tier, model=lane.label) if request.allowance else 0.0,
        )
        try:
            queued = await lane.queue.enqueue(envelope.tier, *lane.queue.stored(envelope), place)
        except STORE_ERRORS as exc:
            logs.limited(log, "request.enqueue_failed", level="warning", error=type(exc).__name__)
            raise self.gw.store_failed(exc, lane.shard) from exc
        if not queued:
            if request.charged is not None:  # (not queued: its list gives its part back)
                request.charged.sending.discard(request.id)
            else:  # (charged apart: a follower that runs on its own)
                await settle_failed(request)
            self.gw.count_refused(key, "key_share", lane, for_capacity=False)
            raise over_share(key, lane)


def _remaining_s(request: "Request") -> float:
    """What is left of the request's deadline, in seconds."""
    return request.deadline_ms / 1000.0 - clock.elapsed_s(request.started)


async def _cached(lane: ModelLane, share: "Share | None") -> wire.Result | None:
    """The result cache's answer, if it is on and holds one for this
    input and the model's fleet."""
    if share is None or share.digest is None:
        return None
    fingerprint = lane.fleet.fingerprint()
    if fingerprint is None:
        return None
    output = await lane.cache.get(share.digest, fingerprint)
    if output is None:
        return None
    tokens = len(output.split())  # (the words: the tokens are the worker's to count)
    return wire.Result("", "", 0, "", 0, 0, output=output, served_by="cache", tokens=tokens)


async def _charge_cached(
    gw: Gateway,
    call: Call,
    lane: ModelLane,
    key: KeyEntry,
    tier: Tier,
    text: str,
    cached: wire.Result,
) -> dict[str, str]:
    """A cached answer's charge (what it used: its input's bound and the
    answer's tokens, no GPU time), or its share of its list's, and its
    usage; its headers."""
    bound = reservations.input_bound(text, call.conversation)
    gw.shares.answered_here(key, lane.name, len(text), bound, cached.tokens)
    if call.charged is not None:  # (one of a list: charged with it; its part settled)
        call.charged.use(call.request_id)
        reserved = call.charged.reservation_of(call.request_id)
        await settle(lane, reserved, reservations.used(cached, bound), 0)
        return call.charged.headers
    tokens = 0
    if lane.quota.reserves_tokens(key, tier):
        tokens = bound + cached.tokens
    return (await charge_quota(gw, lane, key, tier, len(text), tokens=tokens)).headers()


def _failed(exc: ApiError) -> wire.Result:
    """A leader's failure, as the result its followers get."""
    return wire.Result("", "", 0, "", 0, 0, error=wire.ErrorInfo(exc.code, exc.message))


def respond(
    call: Call, started: float, key: KeyEntry, lane: ModelLane, result: wire.Result
) -> InferenceResponse:
    """The answer to a request, from its result; counted as served."""
    lane.served += 1
    latency_ms = round(clock.elapsed_ms(started), 2)
    version = lane.fleet.fingerprint_of(result.worker) or lane.fleet.fingerprint() or ""
    metadata = Metadata(result.tokens, latency_ms, version, empty=not result.output)
    if call.count_input and call.request is not None:
        # (A cached answer, or one collapsed onto a request that did not ask,
        # has no count from the worker: its words stand in, as for tokens_used.)
        metadata.input_tokens = result.input_tokens or len(call.request.input.split())
    return InferenceResponse(
        request_id=call.request_id,
        output=result.output or "",
        latency_ms=latency_ms,
        tier=key.tier,
        batch_size=result.batch_size,
        queue_ms=result.queue_ms,
        served_by=result.served_by,
        model=lane.name,
        metadata=metadata,
    )


async def _answered(enqueue: Coroutine[Any, Any, None], request: "Request") -> None:
    """The enqueue of a request charged already: cancelled meanwhile (its
    list failed, its client left), it still waits for the answer, so that
    whether it queued is known: refused, what it reserved goes back (with
    its list, or at once: ``Inference._enqueue``); queued, it is the take's
    to give back as it drops it (``reserving.left_for_take``)."""
    listed = request.charged
    if listed is not None:
        listed.sending.add(request.id)
    task = asyncio.ensure_future(enqueue)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])  # (a round trip: its answer)
        if listed is not None and not task.cancelled() and task.exception() is None:
            listed.use(request.id)
        raise
