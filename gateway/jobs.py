"""Asynchronous jobs: submit now, fetch later, from any gateway.

A job is an accepted request whose answer is stored instead of sent: its
envelope waits in its tier's job queue (after every synchronous queue), runs
in the batch slots synchronous traffic leaves free, and its result is
written on its record by the same transaction that acknowledges its batch
(``finish_jobs.lua``), never by a gateway. A gateway that dies after the
submit changes nothing. Only the key that submitted a job can see it: any
other key gets 404, exactly as for an id that never existed.

    POST   /v1/jobs             202 {job_id, status: "queued", location}
    GET    /v1/jobs/{id}?wait_s=N   the job; waits up to N s for it to finish
    DELETE /v1/jobs/{id}        cancel it while it is queued (409 once started)
"""

import asyncio
import re
from collections import OrderedDict, defaultdict

import msgspec
from infergate.base import clock, logs, wire
from infergate.base.errors import STORE_ERRORS
from infergate.base.queue.gateway import Place
from infergate.gateway import reservations
from infergate.gateway.api import InferenceResponse, JobAccepted, JobView, Parameters
from infergate.gateway.calls import Call, OnDisconnect
from infergate.gateway.charging import charge_quota, check_reservation, gpu_job_reservation
from infergate.gateway.checks import check_memory, fit_fleet
from infergate.gateway.costs import MeasuredCall
from infergate.gateway.errors import (
    ERRORS,
    ApiError,
    ErrorDetail,
    error_from_result,
    redis_full,
)
from infergate.gateway.inference import Inference
from infergate.gateway.service import Gateway, Shard

log = logs.get(__name__)

MAX_WAIT_S = 20.0  # a long poll's bound; clients poll again after it
RECHECK_S = 1.0  # a long poll re-reads the record this often (a missed notice costs this)
FINAL = frozenset({"succeeded", "failed", "cancelled", "expired"})
_JOB_ID = re.compile(r"^[0-9a-f]{32}\Z")
_IS = defaultdict(
    lambda: "has started",
    {
        "running": "is running",
        "succeeded": "has finished",
        "failed": "has failed",
        "expired": "has expired",
    },
)
RETRY_TOO_MANY_JOBS_MS = 5_000
# The jobs whose results this gateway learned from, the latest (a job read
# again teaches nothing more).
LEARNED_JOBS = 10_000


class Jobs:
    def __init__(self, gateway: Gateway, inference: Inference) -> None:
        self.gateway = gateway
        self._learned: OrderedDict[str, None] = OrderedDict()
        self.inference = inference

    async def submit(self, call: Call) -> tuple[JobAccepted, dict[str, str]]:
        """Who, input, quota, then the job is queued: never refused for
        capacity (it waits for spare capacity), only by the quota and by the
        bound on jobs queued per key."""
        gw = self.gateway
        policy = gw.policy.current
        key = gw.authenticate(call.authorization, policy)
        shard = gw.shard_of(key.id)
        if shard.store.full:
            raise redis_full()
        check_memory(gw, shard.index, key, None)
        body, tier, lane = self.inference.read_body(call.body, policy, key)
        await fit_fleet(body.parameters, lane, policy.models[lane.name])
        params = body.parameters or Parameters()
        max_tokens, input_bound, reserve, reserve_gpu_us = params.max_tokens or 0, 0, 0, 0
        gpu = lane.quota.reserves_gpu(key, tier)
        if lane.quota.reserves_tokens(key, tier) or gpu:  # (settled as it finishes)
            max_tokens = reservations.output_bound(max_tokens, policy.models[lane.name])
            input_bound = reservations.input_bound(body.input)
            reserve = input_bound + max_tokens
        if gpu:
            reserve_gpu_us = gpu_job_reservation(lane, key, input_bound, max_tokens)
        if reserve or reserve_gpu_us:
            check_reservation(gw, lane, key, tier, len(body.input), reserve, reserve_gpu_us)
        quota = await charge_quota(
            gw, lane, key, tier, len(body.input), tokens=reserve, gpu_us=reserve_gpu_us
        )
        headers = quota.headers()
        now_ms = clock.now_ms()
        deadline_ms = tier.job_deadline_ms
        if body.timeout_ms is not None:
            deadline_ms = min(deadline_ms, body.timeout_ms)
        job_id = wire.new_job_id()
        envelope = wire.Envelope(
            job_id,
            gw.id,
            key.tier,
            key.id,
            body.input,
            now_ms,
            now_ms + deadline_ms,
            job=True,
            max_tokens=max_tokens,
            temperature=params.temperature or 0.0,
            count_input=bool(reserve),
        )
        jobs = policy.document.jobs
        try:
            cost = lane.quota.costs.expected(key.id, len(body.input))
            accepted = await lane.queue.enqueue_job(
                envelope,
                jobs.max_queued_per_key,
                round(jobs.result_ttl_s * 1000),
                Place(key.id, cost, key.weight),
                quota.reservation.units() if quota.reservation else (),
                input_bound,
                lane.name,
            )
            if not accepted:
                await shard.quota.refund(key, tier, len(body.input))
                await shard.quota.settle(quota.reservation, 0, 0)
                headers = _refunded(headers)
        except STORE_ERRORS as exc:
            raise gw.store_failed(exc, shard.index) from exc
        if not accepted:
            raise ApiError(
                "RATE_LIMITED",
                f"this key has {jobs.max_queued_per_key} jobs queued already (the policy's "
                "jobs.max_queued_per_key); wait for some to start",
                RETRY_TOO_MANY_JOBS_MS,
                headers,
            )
        gw.metrics.jobs_submitted.labels(key.tier).inc()
        location = f"/v1/jobs/{job_id}"
        log.info("job.queued", job_id=job_id, tier=key.tier)
        return JobAccepted(job_id, "queued", location), {**headers, "location": location}

    async def fetch(
        self,
        authorization: str | None,
        job_id: str,
        wait_s: float,
        on_disconnect: OnDisconnect | None = None,
    ) -> JobView:
        """The job as its owner sees it; with ``wait_s``, once it has finished
        or that long has passed (at most ``MAX_WAIT_S``), or its client left
        (its hold on the key's share of connections goes with it)."""
        policy = self.gateway.policy.current
        key = self.gateway.authenticate(authorization, policy)
        if not wait_s > 0:  # (NaN too)
            return await self._read(job_id, key.id)
        holds = self.gateway.holds
        holds.acquire(key.id, policy.document.limits.key_connection_share)  # a long poll waits
        try:
            gone = asyncio.Event()
            if on_disconnect is not None:
                on_disconnect(gone.set)
            return await self._poll(job_id, key.id, wait_s, gone)
        finally:
            if on_disconnect is not None:
                on_disconnect(None)
            holds.release(key.id)

    async def _poll(self, job_id: str, key_id: str, wait_s: float, gone: asyncio.Event) -> JobView:
        deadline = clock.monotonic_s() + min(wait_s, MAX_WAIT_S)
        while True:
            view = await self._read(job_id, key_id)
            left = deadline - clock.monotonic_s()
            if view.status in FINAL or left <= 0 or self.gateway.draining or gone.is_set():
                return view
            await self._wait(job_id, min(left, RECHECK_S), gone)

    async def _wait(self, job_id: str, timeout_s: float, gone: asyncio.Event) -> None:
        """Until the job is said done, ``timeout_s`` passes, or the client left."""
        done = asyncio.ensure_future(self.gateway.replies.wait_job(job_id, timeout_s))
        left = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait((done, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            left.cancel()

    async def cancel(self, authorization: str | None, job_id: str) -> JobView:
        key = self.gateway.authenticate(authorization, self.gateway.policy.current)
        if not _JOB_ID.match(job_id):
            raise _not_found()
        shard = self.gateway.shard_of(key.id)
        try:
            status = await shard.queue.cancel_job(job_id, key.id)
        except STORE_ERRORS as exc:
            raise self.gateway.store_failed(exc, shard.index) from exc
        if status is None:  # (on another shard, if its key moved since: _locate)
            shard, _ = await self._locate(job_id, key.id, skip=shard)
            try:
                status = await shard.queue.cancel_job(job_id, key.id)
            except STORE_ERRORS as exc:
                raise self.gateway.store_failed(exc, shard.index) from exc
            if status is None:
                raise _not_found()
        if status != "cancelled":
            raise ApiError(
                "CONFLICT", f"only a queued job can be cancelled; this one {_IS[status]}"
            )
        log.info("job.cancelled", job_id=job_id)
        return await self._read(job_id, key.id)

    async def _read(self, job_id: str, key_id: str) -> JobView:
        if not _JOB_ID.match(job_id):
            raise _not_found()
        _, record = await self._locate(job_id, key_id)
        view, result = _view(job_id, record)
        if view.result is not None and result is not None and result.served_by == "model":
            self._learn(job_id, key_id, record, result)
        return view

    def _learn(self, job_id: str, key_id: str, record: dict[str, str], result: wire.Result) -> None:
        """What a job that reserved teaches its key's costs, as a request's
        answer does (``reserving.measured``): a key that sends only jobs is
        estimated once one is read, not held to one job at a time with what
        is left of its budget. Once a job, however often it is read."""
        lane = self.gateway.lanes.of_key(record.get("model", ""), key_id)
        if lane is None or "input_bound" not in record or job_id in self._learned:
            return  # (no reservation: nothing drawn from the line)
        self._learned[job_id] = None
        if len(self._learned) > LEARNED_JOBS:
            self._learned.popitem(last=False)
        bound = (_int(record["input_bound"]), result.tokens)
        lane.quota.costs.learned(key_id, MeasuredCall.of(result), bound)

    async def _locate(
        self, job_id: str, key_id: str, skip: Shard | None = None
    ) -> tuple[Shard, dict[str, str]]:
        """The shard that holds a key's job, and its record: the key's own
        shard, else (a shard added since the job was submitted moved the key,
        and the job stayed where it was, to run and finish there) the others,
        in turn; ``skip``: one already asked. Another key's job reads exactly
        as no job (404); so does none anywhere, but only once every shard has
        said so: one that could not be asked may hold it (503)."""
        home = self.gateway.shard_of(key_id)
        order = [home, *(s for s in self.gateway.shards if s is not home)]
        failed: tuple[BaseException, int] | None = None
        for shard in order:
            if shard is skip:
                continue
            try:
                record = await shard.queue.job(job_id)
            except STORE_ERRORS as exc:
                if shard is home:
                    raise self.gateway.store_failed(exc, shard.index) from exc
                failed = failed or (exc, shard.index)
                continue
            if record.get("key_id") == key_id:
                return shard, record
        if failed is not None:
            raise self.gateway.store_failed(*failed) from failed[0]
        raise _not_found()


def _refunded(headers: dict[str, str]) -> dict[str, str]:
    """The x-ratelimit-* headers once the request's charge was given back."""
    remaining = headers.get("x-ratelimit-remaining-requests")
    limit = headers.get("x-ratelimit-limit-requests")
    if remaining is None or limit is None:
        return headers
    return {**headers, "x-ratelimit-remaining-requests": str(min(int(limit), int(remaining) + 1))}


def _not_found() -> ApiError:
    return ApiError("NOT_FOUND", "no such job (or it expired, or it is another key's)")


def _view(job_id: str, record: dict[str, str]) -> tuple[JobView, wire.Result | None]:
    """The job as its owner sees it, and its result as the worker wrote it
    (None before it finished, or unreadable)."""
    created_ms = _int(record.get("created_ms"))
    status = record.get("status", "queued")
    if status == "queued" and clock.now_ms() >= _int(record.get("deadline_ms")):
        status = "expired"  # not started in time: ``take`` drops it when it gets there
    view = JobView(job_id, status, record.get("tier", ""), created_ms)
    if status not in ("succeeded", "failed") or "result" not in record:
        return view, None
    try:
        result = wire.decode_result(record["result"])
    except msgspec.DecodeError:
        log.error("job.result_unreadable", job_id=job_id)
        return msgspec.structs.replace(view, status="failed", error=_detail(job_id, None)), None
    done_ms = _int(record.get("done_ms"))
    view = msgspec.structs.replace(view, done_ms=done_ms)
    if result.error is not None:
        return msgspec.structs.replace(view, error=_detail(job_id, result.error)), result
    response = InferenceResponse(
        request_id=job_id,
        output=result.output or "",
        latency_ms=float(max(0, done_ms - created_ms)),
        tier=view.tier,
        batch_size=result.batch_size,
        queue_ms=result.queue_ms,
        served_by=result.served_by,
    )
    return msgspec.structs.replace(view, result=response), result


def _detail(job_id: str, error: wire.ErrorInfo | None) -> ErrorDetail:
    exc = error_from_result(error or wire.ErrorInfo("INFERENCE_FAILED", "unreadable result"))
    return ErrorDetail(exc.code, ERRORS[exc.code][1], exc.message, job_id)


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0
