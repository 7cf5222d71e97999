"""Prometheus metrics: every name infergate exports, in one place.

Each process serves its own metrics on its own port (``--metrics-port``;
``up`` gives each child the next port): a scrape sees each process once,
whatever shares the HTTP port, and sums over processes are exact. That is
simpler and truer than prometheus-client's multiprocess mode, which keeps
files per pid and cannot say a dead process's gauges are gone. Every process
registers only its own role's metrics, in a registry of its own.

Units are base units (seconds, requests); labels are bounded: tier (three,
or ``none`` before a key is known), HTTP status code, a refusal reason, a
worker state. Never a key, a request or a process id.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from infergate.base import clock
from infergate.base.tiers import TIERS
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# No `_created` series beside every counter and histogram: they double what a
# scrape carries and no query of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Resolve the 100 ms floor, the pacing interval above it and every tier's budget.
LATENCY_BUCKETS_S = (
    0.05, 0.1, 0.11, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
)  # fmt: skip
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_TIME_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.11,
    0.125,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100)

NO_TIER = "none"


class LivePolicyLike(Protocol):
    """What the metrics read of a live policy (``policies.live.LivePolicy``)."""

    error: str | None

    def on_refused(self, callback: Callable[[], None]) -> None: ...


REFUSAL_REASONS = (
    "capacity",
    "key_share",
    "quota",
    "budget",
    "no_worker",
    "redis",
    "redis_memory",
    "direct_full",
    "draining",
)
DROP_REASONS = ("expired", "cancelled", "malformed")
WORKER_STATES = ("idle", "busy", "draining", "upstream_down")


class Common:
    """What every process exports."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.redis_up = Gauge(
            "infergate_redis_up", "1 while this process reaches Redis", registry=registry
        )
        self.clock_offset = Gauge(
            "infergate_clock_offset_seconds",
            "Redis's clock (the fleet's) minus this host's, as last measured",
            registry=registry,
        )
        self.clock_offset.set_function(lambda: clock.offset_ms() / 1000.0)


class PolicyWatching(Common):
    """What the processes that follow the policy file export (gateways, dispatchers)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.policy_reload_errors = Counter(
            "infergate_policy_reload_errors",
            "Policy files refused (invalid, unreadable, too big) since start",
            registry=registry,
        )
        self.policy_file_ok = Gauge(
            "infergate_policy_file_ok",
            "1 while the policy file is valid (or is the policy in force)",
            registry=registry,
        )


class GatewayMetrics(PolicyWatching):
    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.forming = Forming(registry)
        self.cache_hits = Counter(
            "infergate_cache_hits",
            "Requests answered from the result cache, without queueing (GPU slots saved)",
            ["tier"],
            registry=registry,
        )
        self.requests_joined = Counter(
            "infergate_requests_joined",
            "Requests that waited for an identical one in flight at their gateway (slots saved)",
            ["tier"],
            registry=registry,
        )
        self.cache_bypassed = Counter(
            "infergate_cache_bypassed",
            "Cache reads that failed (Redis): the request was served without the cache",
            registry=registry,
        )
        self.jobs_submitted = Counter(
            "infergate_jobs_submitted",
            "Asynchronous jobs accepted (POST /v1/jobs), by tier",
            ["tier"],
            registry=registry,
        )
        self.requests = Counter(
            "infergate_requests",
            "Requests answered, by tier and HTTP status code",
            ["tier", "code"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "infergate_request_duration_seconds",
            "Time from a request's arrival to its answer (200s), by tier",
            ["tier"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "infergate_queue_wait_seconds",
            "Time a request waited in Redis before its batch started, by tier",
            ["tier"],
            buckets=QUEUE_BUCKETS_S,
            registry=registry,
        )
        self.refusals = Counter(
            "infergate_admission_refusals",
            "Requests refused at admission, by tier and reason",
            ["tier", "reason"],
            registry=registry,
        )
        self.edge_faults = Counter(
            "infergate_edge_faults",
            "Requests the HTTP edge failed to read through a fault of its own, not the "
            "client's (an internal of uvicorn or httptools it relies on that moved)",
            registry=registry,
        )
        self.replies_ignored = Counter(
            "infergate_replies_ignored",
            "Replies for requests no longer waiting here (a retried batch's duplicate, or late)",
            registry=registry,
        )
        self.fairness = Gauge(
            "infergate_fairness_jain",
            "Fairness between the keys of a tier that were refused in the last 10 s: Jain's "
            "index of their admitted requests over their weights (1: even shares; 1/n: one "
            "key got all), 1 when fewer than two were refused",
            ["tier"],
            registry=registry,
        )
        self.redis_memory_use = Gauge(
            "infergate_redis_memory_use",
            "Redis's used memory over its maxmemory, the highest among shards, as this "
            "gateway last read it (0: no maxmemory, or unread); new work is refused past "
            "limits.redis_memory_high_water, free first",
            registry=registry,
        )
        self.redis_memory_high_water = Gauge(
            "infergate_redis_memory_high_water",
            "The policy's limits.redis_memory_high_water: free work is refused from it",
            registry=registry,
        )
        self.direct_mode = Gauge(
            "infergate_direct_mode",
            "1 while this gateway serves the policy's direct.tiers itself, Redis being "
            "unreachable (direct mode); 0 otherwise",
            registry=registry,
        )
        self.budget_keys = Gauge(
            "infergate_budget_keys",
            "Keys this gateway charged that have used at least `mark` of a budget in its "
            "current period (1: refused for it, 429 BUDGET_EXCEEDED)",
            ["mark"],
            registry=registry,
        )
        self.direct_requests = Counter(
            "infergate_direct_requests_total",
            "Requests this gateway took in direct mode (served by the model's server without "
            "Redis), by tier",
            ["tier"],
            registry=registry,
        )
        self.keys_refused = Gauge(
            "infergate_keys_refused",
            "Keys of a tier refused at least once in the last 10 s (at this gateway)",
            ["tier"],
            registry=registry,
        )
        for tier in TIERS:
            for reason in REFUSAL_REASONS:
                self.refusals.labels(tier, reason)
            self.fairness.labels(tier).set(1.0)
            self.keys_refused.labels(tier).set(0)
        # The success path's three series per tier, resolved once (not per request).
        self.answered = {
            tier: (
                self.requests.labels(tier, "200"),
                self.request_duration.labels(tier),
                self.queue_wait.labels(tier),
            )
            for tier in TIERS
        }


class TakeCounts(Protocol):
    @property
    def size(self) -> int: ...
    @property
    def expired(self) -> int: ...
    @property
    def cancelled(self) -> int: ...
    @property
    def malformed(self) -> int: ...


class Forming:
    """Batches formed, and envelopes dropped while forming them: by
    dispatchers for idle workers, by workers for their own next batch, and
    by gateways for a lone request they hand straight to an idle worker (the
    same series in all, so their sum is the fleet's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches_formed = Counter(
            "infergate_batches_formed", "Batches handed to workers", registry=registry
        )
        self.requests_batched = Counter(
            "infergate_requests_batched", "Requests handed to workers in batches", registry=registry
        )
        self.dropped = Counter(
            "infergate_dropped",
            "Envelopes dropped before any worker saw them, by reason",
            ["reason"],
            registry=registry,
        )
        self._dropped = {reason: self.dropped.labels(reason) for reason in DROP_REASONS}

    def handed_one(self) -> None:
        """A request a gateway handed straight to an idle worker, a batch of its own."""
        self.batches_formed.inc()
        self.requests_batched.inc()

    def count(self, taken: TakeCounts) -> None:
        if taken.size:
            self.batches_formed.inc()
            self.requests_batched.inc(taken.size)
        for reason, count in (
            ("expired", taken.expired),
            ("cancelled", taken.cancelled),
            ("malformed", taken.malformed),
        ):
            if count:
                self._dropped[reason].inc(count)


class DispatcherMetrics(PolicyWatching):
    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.forming = Forming(registry)
        self.batches_retried = Counter(
            "infergate_batches_retried",
            "Batches of dead or hung workers run again",
            registry=registry,
        )
        self.batches_dead_lettered = Counter(
            "infergate_batches_dead_lettered",
            "Batches given up on after workers.max_attempts runs (their requests get 500)",
            registry=registry,
        )
        self.envelopes_requeued = Counter(
            "infergate_envelopes_requeued",
            "Envelopes of dead dispatchers returned to their queues",
            registry=registry,
        )
        # The autoscaling signal (base/autoscale.py): what an HPA or KEDA scales
        # on, for the model the dispatcher batches (each model scales on its own).
        self.desired_workers = Gauge(
            "infergate_autoscale_desired_workers",
            "Workers the fleet needs: demand / (per-worker capacity x target utilization), "
            "held at its peak over autoscale.scale_down_after_s",
            ["model"],
            registry=registry,
        )
        self.demand_rps = Gauge(
            "infergate_autoscale_demand_rps",
            "Requests per second asked of the gateways (admitted + refused for capacity)",
            ["model"],
            registry=registry,
        )
        self.worker_capacity_rps = Gauge(
            "infergate_autoscale_worker_capacity_rps",
            "Measured requests per second one worker can serve at the policy's batch size",
            ["model"],
            registry=registry,
        )


BACKEND_IDLE_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


class WorkerMetrics(Common):
    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.forming = Forming(registry)
        self.batch_size = Histogram(
            "infergate_batch_size",
            "Requests per batch run by the backend",
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.backend_inputs = Counter(
            "infergate_backend_inputs",
            "Inputs the backend was given (identical inputs of a batch count once)",
            registry=registry,
        )
        self.requests_collapsed = Counter(
            "infergate_requests_collapsed",
            "Requests answered from an identical input's slot in their batch (GPU slots saved)",
            registry=registry,
        )
        self.batch_duration = Histogram(
            "infergate_batch_duration_seconds",
            "Backend time per call",
            buckets=BATCH_TIME_BUCKETS_S,
            registry=registry,
        )
        self.batches_failed = Counter(
            "infergate_batches_failed",
            "Batches answered INFERENCE_FAILED as a whole (unreadable, or failed outside the backend)",
            registry=registry,
        )
        self.inference_failures = Counter(
            "infergate_inference_failures",
            "Requests the backend failed on, after isolating the input",
            registry=registry,
        )
        self.busy = Gauge("infergate_worker_busy", "1 while running a batch", registry=registry)
        self.backend_idle = Histogram(
            "infergate_worker_backend_idle_seconds",
            "How long the backend sat idle before each call (under load: the gap between batches)",
            buckets=BACKEND_IDLE_BUCKETS_S,
            registry=registry,
        )


@dataclass(frozen=True)
class FleetReading:
    """The fleet as one process sees it, read at scrape time."""

    queue_depth: dict[str, int]
    workers: dict[str, int]  # by state
    capacity_rps: float  # planned: measured x target utilization
    estimated_wait_s: dict[str, float]  # +Inf when the tier would be refused
    policy_version: str
    latency_budget_s: dict[str, float]  # each tier's, from the policy (for the alerts)


class FleetCollector(Collector):
    """Gauges computed when scraped, from a process's fleet view."""

    def __init__(self, read: Callable[[], dict[str, FleetReading]]) -> None:
        self.read = read  # each model's reading, by model name

    def collect(self) -> Iterable[Metric]:
        readings = self.read()
        if not readings:
            return
        depth = GaugeMetricFamily(
            "infergate_queue_depth", "Requests queued, by model and tier", labels=["model", "tier"]
        )
        workers = GaugeMetricFamily(
            "infergate_workers", "Live workers, by model and state", labels=["model", "state"]
        )
        capacity = GaugeMetricFamily(
            "infergate_capacity_requests_per_second",
            "Planned capacity, by model: the serving workers' measured rate x target utilization",
            labels=["model"],
        )
        wait = GaugeMetricFamily(
            "infergate_estimated_wait_seconds",
            "Admission's estimate of the queueing delay a new request would see, by model and tier",
            labels=["model", "tier"],
        )
        for model, reading in readings.items():
            for tier, n in reading.queue_depth.items():
                depth.add_metric([model, tier], n)
            for state in WORKER_STATES:
                workers.add_metric([model, state], reading.workers.get(state, 0))
            capacity.add_metric([model], reading.capacity_rps)
            for tier, seconds in reading.estimated_wait_s.items():
                wait.add_metric([model, tier], seconds)
        reading = next(iter(readings.values()))
        info = GaugeMetricFamily(
            "infergate_policy_info", "The policy in force (its version)", labels=["version"]
        )
        info.add_metric([reading.policy_version], 1)
        budget = GaugeMetricFamily(
            "infergate_latency_budget_seconds",
            "Each tier's admission budget for queueing delay, from the policy",
            labels=["tier"],
        )
        for tier, seconds in reading.latency_budget_s.items():
            budget.add_metric([tier], seconds)
        yield from (depth, workers, capacity, wait, info, budget)


def watch_policy_and_redis(
    metrics: PolicyWatching, policy: LivePolicyLike, redis_ok: Callable[[], bool]
) -> None:
    """The gauges every process reads at scrape time, and the reload-error count."""
    metrics.redis_up.set_function(lambda: 1.0 if redis_ok() else 0.0)
    metrics.policy_file_ok.set_function(lambda: 1.0 if policy.error is None else 0.0)
    policy.on_refused(metrics.policy_reload_errors.inc)
