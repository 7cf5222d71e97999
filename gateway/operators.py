"""What operators ask a gateway (admin keys only): the policy in force, a
reload, the dead letters, usage per key, and the fleet at a glance."""

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from infergate.base import clock, logs, periods
from infergate.base.errors import STORE_ERRORS
from infergate.base.fleet import worker_capacity_rps
from infergate.base.queue import usage
from infergate.base.tiers import TIERS
from infergate.gateway.api import (
    AdminPolicy,
    BudgetReport,
    DeadLetters,
    DeadLettersPurged,
    KeyBudget,
    ReloadResult,
    StatusResponse,
    UsageReport,
    WorkerStatus,
)
from infergate.gateway.errors import ApiError, redis_unreachable
from infergate.gateway.quota import budget_of
from infergate.gateway.service import Gateway
from infergate.policies import KeyEntry

log = logs.get(__name__)

DAY_MS = 86_400_000

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


class Operators:
    """A gateway's operator endpoints."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    def admin(self, authorization: str | None) -> KeyEntry:
        key = self.gw.authenticate(authorization, self.gw.policy.current)
        if not key.admin:
            raise ApiError(
                "FORBIDDEN", "this endpoint needs an admin key (admin: true in the policy)"
            )
        return key

    def admin_policy(self) -> AdminPolicy:
        policy = self.gw.policy.current
        document: dict[str, Any] = msgspec.to_builtins(policy.document)
        for key in document.get("keys", []):
            key.pop("sha256", None)
        return AdminPolicy(policy.version, Path(policy.source).name, self.gw.policy.error, document)

    async def reload_policy(self) -> ReloadResult:
        changed = await self.gw.policy.reload()
        return ReloadResult(changed, self.gw.policy.current.version, self.gw.policy.error)

    async def dead_letters(
        self, limit: int, model: str | None = None, shard: int = 0
    ) -> DeadLetters:
        lane = self.gw.lanes.named(self.gw.policy.current, model, shard)
        try:
            total, batches = await lane.queue.dead_letters(limit)
        except STORE_ERRORS as exc:
            raise self.gw.store_failed(exc, shard) from exc
        return DeadLetters(total, batches)

    async def purge_dead_letters(
        self, model: str | None = None, shard: int = 0
    ) -> DeadLettersPurged:
        lane = self.gw.lanes.named(self.gw.policy.current, model, shard)
        try:
            purged = await lane.queue.purge_dead_letters()
        except STORE_ERRORS as exc:
            raise self.gw.store_failed(exc, shard) from exc
        log.info("admin.dead_letters_purged", purged=purged)
        return DeadLettersPurged(purged)

    async def usage(
        self,
        key_id: str | None,
        since: str | None,
        sort: usage.Order,
        model: str | None = None,
        by: usage.By = "all",
    ) -> UsageReport:
        """Usage per key (and per hour or day, ``by``) from ``since`` (epoch
        seconds or ISO 8601; default a day ago; no earlier than the policy
        keeps it), most first by ``sort`` (within each period)."""
        now_ms = clock.now_ms()
        kept_ms = round(self.gw.policy.current.document.usage.retention_days * DAY_MS)
        since_ms = max(now_ms - DAY_MS if since is None else _epoch_ms(since), now_ms - kept_ms)
        since_ms = min(since_ms, now_ms)
        # A row counts the whole of its period: a day's from its midnight (UTC).
        since_ms -= since_ms % usage.PERIOD_MS.get(by, usage.HOUR_MS)
        policy = self.gw.policy.current
        self.gw.lanes.named(policy, model)  # (404 for a model not served)
        name = policy.default_model if model is None else model
        # Every shard's: a key's usage is on its shard, or on two for a while
        # after a shard is added.
        stores = [shard.store.of_model(name) for shard in self.gw.shards]
        try:
            rows = await usage.read(stores, since_ms, now_ms, key_id, by)
        except STORE_ERRORS as exc:
            raise redis_unreachable() from exc  # (a read: which shard failed changes nothing)
        rows.sort(key=lambda r: (r.period or "", -getattr(r, sort), r.key_id))
        return UsageReport(_iso(since_ms), _iso(now_ms), rows)

    async def budgets(self, key_id: str | None = None) -> BudgetReport:
        """Every budgeted key's budgets (or ``key_id``'s) in their current
        periods, read from their shards: spent and left."""
        policy = self.gw.policy.current
        now_ms = clock.now_ms()
        rows: list[KeyBudget] = []
        for key in policy.document.keys:
            budget = budget_of(key, policy.tiers[key.tier])
            if budget is None or (key_id is not None and key.id != key_id):
                continue
            shard = self.gw.shard_of(key.id)
            charges = shard.quota.budget_charges(key.id, budget)
            try:
                spent = await shard.queue.spent([c.counter for c in charges], now_ms)
            except STORE_ERRORS as exc:
                raise redis_unreachable() from exc
            ends = _iso(periods.ends_ms(now_ms, budget.period))
            for charge, used in zip(charges, spent, strict=True):
                amount, left = charge.counter.amount, max(0, charge.counter.amount - used)
                if charge.kind == "gpu_budget":  # (counted in microseconds)
                    row = ("gpu_seconds", amount / 1e6, used / 1e6, left / 1e6)
                else:
                    row = ("tokens", amount, used, left)
                rows.append(KeyBudget(key.id, key.tier, *row, budget.period, ends))
        return BudgetReport(_iso(now_ms), rows)

    async def status(self, model: str | None = None, shard: int = 0) -> StatusResponse:
        lane = self.gw.lanes.named(self.gw.policy.current, model, shard)
        try:
            fleet = await lane.store.fleet_status()
        except STORE_ERRORS as exc:
            raise self.gw.store_failed(exc, shard) from exc
        # (admission's figures from a view as fresh as a request's: at rest
        # the view is read only once a heartbeat's life)
        await lane.fleet.fresh()
        policy = self.gw.policy.current.for_model(lane.name)
        max_batch = policy.document.batching.max_batch_size
        stats = fleet.counters
        workers = fleet.alive["worker"]
        batches = stats.get("batches_formed", 0)
        batched = stats.get("requests_batched", 0)
        return StatusResponse(
            gateway_id=self.gw.id,
            policy_version=policy.version,
            policy_error=self.gw.policy.error,
            redis_ok=True,
            workers_alive=len(workers),
            workers_busy=sum(w.busy for w in workers),
            workers=[
                WorkerStatus(
                    id=w.id,
                    busy=w.busy,
                    draining=w.draining,
                    upstream_down=w.upstream_down,
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
            pending_here=len(self.gw.replies.pending),
            replies_ignored=self.gw.replies.duplicates,
            capacity_rps=round(lane.admission.capacity_rps(policy), 1),
            estimated_wait_ms={
                t: (None if w == float("inf") else round(w, 1))
                for t in TIERS
                for w in [lane.admission.estimate_wait_ms(policy, t)]
            },
        )


def _epoch_ms(text: str) -> int:
    """``since`` as epoch ms: epoch seconds, or an ISO 8601 time (UTC if no zone)."""
    try:
        if text.isdigit():
            return int(text[:12]) * 1000 if len(text) <= 12 else 10**15
        at = datetime.fromisoformat(text)
        return round((at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp() * 1000)
    except (ValueError, OverflowError):
        raise ApiError(
            "INVALID_INPUT",
            "since must be epoch seconds or an ISO 8601 time, e.g. 2026-11-27T09:00Z",
        ) from None


def _iso(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="seconds")
