"""Unit tests of the gateway's two doors: capacity admission (arithmetic on a
fleet snapshot set by hand, no Redis) and per-key quotas (``limits`` on a real
Redis, no infergate process)."""

import asyncio
import math
import re
from collections.abc import AsyncIterator, Iterable
from typing import Any, cast

import msgspec
import pytest
from infergate.base.fleet import FleetView
from infergate.base.queue.gateway import Admitted, GatewayQueue
from infergate.base.queue.store import FleetSnapshot, Store
from infergate.base.wire import Heartbeat
from infergate.gateway.admission import Admission, Decision
from infergate.gateway.quota import Quota, QuotaResult, _result
from infergate.policies import KeyEntry, Policy, parse_policy

from tests.helpers import as_yaml, key_entry, policy

INF = float("inf")

# -- admission ---------------------------------------------------------------


def worker(n: int, batch_ms: float, draining: bool = False) -> Heartbeat:
    return Heartbeat(
        role="worker", id=f"w{n}", started_ms=0, beat_ms=0, batch_ms=batch_ms, draining=draining
    )


def snapshot(
    workers: Iterable[Heartbeat], enterprise: int = 0, paid: int = 0, free: int = 0
) -> FleetSnapshot:
    return FleetSnapshot(
        workers=list(workers),
        queue_depth={"enterprise": enterprise, "paid": paid, "free": free},
        taken_ms=0,
    )


def fleet(snap: FleetSnapshot | None) -> FleetView:
    # Only refresh() touches the store, and these tests set the snapshot themselves.
    view = FleetView(cast(Store, object()), refresh_ms=50)
    view.snapshot = snap
    return view


def admission_policy(
    *,
    max_batch: int = 100,
    utilization: float = 0.5,
    free_share: float = 0.0,
    budgets: dict[str, int] | None = None,
) -> Policy:
    tiers = {tier: {"latency_budget_ms": ms} for tier, ms in (budgets or {}).items()}
    return parse_policy(
        as_yaml(
            policy(
                max_batch_size=max_batch,
                free_share=free_share,
                capacity={"target_utilization": utilization},
                tiers=tiers,
            )
        )
    )


def four_workers() -> list[Heartbeat]:
    """4 x (100 / 0.25 s) = 1600 rps measured; at 0.5 utilization 800 rps planned.
    The fleet starts 800 x 0.25 = 200 requests in one batch time."""
    return [worker(i, 250.0) for i in range(4)]


def waits(admission: Admission, pol: Policy) -> dict[str, float]:
    return {t: admission.estimate_wait_ms(pol, t) for t in ("enterprise", "paid", "free")}


def test_capacity_is_max_batch_over_batch_time_of_serving_workers_times_utilization() -> None:
    # 10 / 0.1 s = 100 rps, 10 / 0.2 s = 50 rps; the draining one (10 / 0.05 s =
    # 200 rps) and the one that measured no batch time yet add nothing.
    workers = [worker(1, 100.0), worker(2, 200.0), worker(3, 50.0, draining=True), worker(4, 0.0)]
    view = fleet(snapshot(workers, enterprise=15))
    assert view.capacity_rps(10) == pytest.approx(150.0)
    assert view.batch_ms() == pytest.approx(150.0)  # mean of the serving, measured ones
    admission = Admission(view)
    assert admission.capacity_rps(admission_policy(max_batch=10, utilization=0.5)) == (
        pytest.approx(75.0)
    )
    assert admission.capacity_rps(admission_policy(max_batch=10, utilization=1.0)) == (
        pytest.approx(150.0)
    )
    # 15 queued at 75 rps: 200 ms.
    assert admission.estimate_wait_ms(
        admission_policy(max_batch=10, utilization=0.5), "enterprise"
    ) == pytest.approx(200.0)


def test_draining_or_dead_workers_lower_capacity_and_raise_the_wait() -> None:
    pol = admission_policy()
    view = fleet(snapshot(four_workers(), enterprise=60))
    admission = Admission(view)
    assert admission.capacity_rps(pol) == pytest.approx(800.0)
    assert admission.estimate_wait_ms(pol, "enterprise") == pytest.approx(75.0)
    # One starts draining: 3 x 400 x 0.5 = 600 rps.
    drained = [*four_workers()[:3], worker(3, 250.0, draining=True)]
    view.snapshot = snapshot(drained, enterprise=60)
    assert admission.capacity_rps(pol) == pytest.approx(600.0)
    assert admission.estimate_wait_ms(pol, "enterprise") == pytest.approx(100.0)
    # Two died (gone from the snapshot): 400 rps, the wait doubles.
    view.snapshot = snapshot(four_workers()[:2], enterprise=60)
    assert admission.capacity_rps(pol) == pytest.approx(400.0)
    assert admission.estimate_wait_ms(pol, "enterprise") == pytest.approx(150.0)


@pytest.mark.parametrize(
    "snap",
    [
        None,
        snapshot([]),
        snapshot([worker(1, 250.0, draining=True), worker(2, 100.0, draining=True)]),
        snapshot([worker(1, 0.0)]),
    ],
    ids=["no-snapshot", "no-workers", "all-draining", "no-batch-time-measured"],
)
def test_no_capacity_means_infinite_wait_and_refusal_with_retry_after(
    snap: FleetSnapshot | None,
) -> None:
    pol = admission_policy(budgets={"enterprise": 10_000, "paid": 10_000, "free": 10_000})
    admission = Admission(fleet(snap))
    assert admission.capacity_rps(pol) == 0.0
    for tier in ("enterprise", "paid", "free"):
        assert admission.estimate_wait_ms(pol, tier) == INF
        # No batch time is measured by any serving worker: retry after 100 ms.
        assert admission.decide(pol, tier) == Decision(False, INF, 100)


def test_wait_counts_own_and_higher_tiers_only() -> None:
    pol = admission_policy()
    view = fleet(snapshot(four_workers(), enterprise=50, paid=25, free=25))
    admission = Admission(view)
    # 50 / 800 s, (50 + 25) / 800 s, (50 + 25 + 25) / 800 s.
    assert waits(admission, pol) == pytest.approx(
        {"enterprise": 62.5, "paid": 93.75, "free": 125.0}
    )
    # Lower tiers' queues do not delay a higher tier.
    view.snapshot = snapshot(four_workers(), enterprise=50, paid=25, free=150)
    assert waits(admission, pol) == pytest.approx(
        {"enterprise": 62.5, "paid": 93.75, "free": 281.25}
    )


def test_admitted_since_the_snapshot_count_ahead_until_a_new_snapshot() -> None:
    pol = admission_policy()
    first = snapshot(four_workers(), enterprise=50, paid=25, free=25)
    view = fleet(first)
    admission = Admission(view)
    for _ in range(25):
        admission.admitted("enterprise")
    # 25 more enterprise: ahead of every tier.
    assert waits(admission, pol) == pytest.approx(
        {"enterprise": 93.75, "paid": 125.0, "free": 156.25}
    )
    for _ in range(25):
        admission.admitted("free")
    # 25 more free: ahead of free only.
    assert waits(admission, pol) == pytest.approx(
        {"enterprise": 93.75, "paid": 125.0, "free": 187.5}
    )
    # decide() counts nothing.
    for _ in range(10):
        admission.decide(pol, "enterprise")
    assert waits(admission, pol) == pytest.approx(
        {"enterprise": 93.75, "paid": 125.0, "free": 187.5}
    )
    # The same view assigned again is not a new one: the counts stay.
    view.snapshot = first
    assert waits(admission, pol) == pytest.approx(
        {"enterprise": 93.75, "paid": 125.0, "free": 187.5}
    )
    # A new snapshot (equal content, new object) already holds what was admitted.
    view.snapshot = snapshot(four_workers(), enterprise=50, paid=25, free=25)
    assert waits(admission, pol) == pytest.approx(
        {"enterprise": 62.5, "paid": 93.75, "free": 125.0}
    )
    # admitted() right after a new snapshot counts from zero, not on top of the old counts.
    for _ in range(25):
        admission.admitted("enterprise")
    view.snapshot = snapshot(four_workers(), enterprise=50, paid=25, free=25)
    admission.admitted("paid")
    assert waits(admission, pol) == pytest.approx(
        {"enterprise": 62.5, "paid": 95.0, "free": 126.25}
    )


@pytest.mark.parametrize(
    ("share", "slots", "slot_wait_ms"),
    [
        (0.1, 10, 375.0),  # 30 / (800 x 10/100) s
        (0.25, 25, 150.0),  # 30 / (800 x 25/100) s
        (0.004, 1, 3750.0),  # any share reserves at least one slot: 30 / 8 s
    ],
)
def test_tier_with_min_batch_share_counts_on_its_reserved_slots_once_above_fills_a_batch(
    share: float, slots: int, slot_wait_ms: float
) -> None:
    pol = admission_policy(free_share=share)
    assert pol.reserved_slots("free") == slots
    view = fleet(snapshot(four_workers(), enterprise=49, paid=50, free=30))
    admission = Admission(view)
    # 99 above: less than a full batch, the plain estimate (99 + 30) / 800 s.
    assert admission.estimate_wait_ms(pol, "free") == pytest.approx(161.25)
    # 100 above: a full batch; free counts on its reserved slots only.
    view.snapshot = snapshot(four_workers(), enterprise=50, paid=50, free=30)
    assert admission.estimate_wait_ms(pol, "free") == pytest.approx(slot_wait_ms)
    # Far more than the fleet starts in one batch time above: still the guaranteed rate.
    view.snapshot = snapshot(four_workers(), enterprise=600, paid=400, free=30)
    assert admission.estimate_wait_ms(pol, "free") == pytest.approx(slot_wait_ms)
    # What this gateway admitted counts too: one more paid makes 99 above a full batch...
    view.snapshot = snapshot(four_workers(), enterprise=49, paid=50, free=30)
    admission.admitted("paid")
    assert admission.estimate_wait_ms(pol, "free") == pytest.approx(slot_wait_ms)
    # ...and 10 more free are 40 on the reserved slots.
    for _ in range(10):
        admission.admitted("free")
    assert admission.estimate_wait_ms(pol, "free") == pytest.approx(slot_wait_ms * 40 / 30)
    # Tiers without a share are not counted on slots: 100 above paid is < 200.
    assert admission.estimate_wait_ms(pol, "paid") == pytest.approx(125.0)


def test_tier_without_share_is_refused_once_more_is_queued_above_than_one_batch_time_starts() -> (
    None
):
    pol = admission_policy(budgets={"enterprise": 5000, "paid": 5000, "free": 5000})
    # 800 rps x 0.25 s = 200 > max_batch 100: the threshold is 200.
    view = fleet(snapshot(four_workers(), enterprise=100, paid=99, free=1))
    admission = Admission(view)
    assert admission.estimate_wait_ms(pol, "free") == pytest.approx(250.0)  # 200 / 800 s
    view.snapshot = snapshot(four_workers(), enterprise=100, paid=101, free=1)
    assert admission.estimate_wait_ms(pol, "free") == INF
    # Refused at any budget, retry after one (mean measured) batch time.
    assert admission.decide(pol, "free") == Decision(False, INF, 250)
    # Paid has 100 above it: below 200, a plain estimate.
    assert admission.estimate_wait_ms(pol, "paid") == pytest.approx(251.25)
    # What this gateway admitted counts as queued above.
    view.snapshot = snapshot(four_workers(), enterprise=100, paid=99, free=1)
    admission.admitted("enterprise")
    admission.admitted("paid")
    assert admission.estimate_wait_ms(pol, "free") == INF
    # Enterprise has nothing above it: never refused this way.
    view.snapshot = snapshot(four_workers(), enterprise=1000)
    assert admission.estimate_wait_ms(pol, "enterprise") == pytest.approx(1250.0)
    view.snapshot = snapshot(four_workers(), enterprise=201)
    assert admission.estimate_wait_ms(pol, "paid") == INF


def test_threshold_for_a_tier_without_share_is_at_least_one_full_batch() -> None:
    # One worker: 100 / 0.25 s x 0.5 = 200 rps, which starts only 50 per batch
    # time; the threshold is max(max_batch 100, 50) = 100.
    pol = admission_policy()
    view = fleet(snapshot([worker(1, 250.0)], enterprise=60, free=1))
    admission = Admission(view)
    assert admission.estimate_wait_ms(pol, "free") == pytest.approx(305.0)  # 61 / 200 s
    view.snapshot = snapshot([worker(1, 250.0)], enterprise=99, free=1)
    assert admission.estimate_wait_ms(pol, "free") == pytest.approx(500.0)  # 100 / 200 s
    view.snapshot = snapshot([worker(1, 250.0)], enterprise=101, free=1)
    assert admission.estimate_wait_ms(pol, "free") == INF


def test_exactly_one_batch_time_queued_above_is_already_refused() -> None:
    pol = admission_policy()
    # 200 above, exactly what 800 rps starts in 0.25 s: as much as one batch
    # time can start, so free (no reserved share) waits until they drain.
    view = fleet(snapshot(four_workers(), enterprise=100, paid=100, free=1))
    admission = Admission(view)
    assert admission.estimate_wait_ms(pol, "free") == float("inf")
    one_less = fleet(snapshot(four_workers(), enterprise=100, paid=99, free=1))
    assert Admission(one_less).estimate_wait_ms(pol, "free") == pytest.approx(250.0)


def test_decide_admits_iff_the_wait_is_within_the_tier_budget() -> None:
    view = fleet(snapshot(four_workers(), enterprise=100))
    admission = Admission(view)
    # 100 / 800 s = exactly 125 ms for enterprise.
    at_budget = admission_policy(budgets={"enterprise": 125})
    assert admission.decide(at_budget, "enterprise") == Decision(True, 125.0, 0)
    over = admission_policy(budgets={"enterprise": 124})
    # 1 ms over: retry after max(batch time 250, 1) ms.
    assert admission.decide(over, "enterprise") == Decision(False, 125.0, 250)
    # Each tier answers to its own budget: paid and free wait 125 ms too.
    mixed = admission_policy(budgets={"enterprise": 100, "paid": 200, "free": 125})
    assert admission.decide(mixed, "enterprise") == Decision(False, 125.0, 250)
    assert admission.decide(mixed, "paid") == Decision(True, 125.0, 0)
    assert admission.decide(mixed, "free") == Decision(True, 125.0, 0)
    # Far over: retry after the excess, 1000 - 99 = 901 ms > 250.
    view.snapshot = snapshot(four_workers(), enterprise=800)
    far = admission_policy(budgets={"enterprise": 99})
    assert admission.decide(far, "enterprise") == Decision(False, 1000.0, 901)


# -- quota -------------------------------------------------------------------

HEADER_RESET = re.compile(r"^\d+\.\d{3}s$")


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    s = Store.connect(redis_url, "t", name="test")
    try:
        yield s
    finally:
        await s.close()


def quota_on(s: Store) -> Quota:
    return Quota(GatewayQueue(s, "gw"))


def quota_policy(**kw: Any) -> Policy:
    return parse_policy(as_yaml(policy(**kw)))


def key_of(pol: Policy, key_id: str) -> KeyEntry:
    return next(k for k in pol.document.keys if k.id == key_id)


def free_tier(**fields: Any) -> Policy:
    return quota_policy(tiers={"free": fields})


async def charge_n(
    quota: Quota, pol: Policy, key_id: str, n: int, chars: int = 10
) -> list[QuotaResult]:
    key = key_of(pol, key_id)
    return [await quota.charge(key, pol.tiers[key.tier], chars) for _ in range(n)]


async def test_quota_admits_exactly_the_limit_and_counts_remaining_down(store: Store) -> None:
    pol = free_tier(rate_limits=["5/minute"])
    quota = quota_on(store)
    results = await charge_n(quota, pol, "fre", 7)
    assert [r.allowed for r in results] == [True] * 5 + [False] * 2
    assert [r.limit for r in results] == [5] * 7
    assert [r.remaining for r in results] == [4, 3, 2, 1, 0, 0, 0]
    for r in results:
        headers = r.headers()
        assert set(headers) == {
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        }
        assert headers["x-ratelimit-limit-requests"] == "5"
        assert headers["x-ratelimit-remaining-requests"] == str(r.remaining)
        assert HEADER_RESET.match(headers["x-ratelimit-reset-requests"])
        assert r.reset_s is not None
        assert 0 < r.reset_s <= 60
    for r in results[5:]:
        assert r.refused_by is not None
        assert "5 per 1 minute" in r.refused_by
        assert "requests" in r.refused_by
    # Another key of the same tier has its own count.
    other = await charge_n(quota, free_tier(rate_limits=["5/minute"]), "pai", 1)
    assert other[0].allowed


async def test_refusal_retry_after_is_positive_and_within_the_window(store: Store) -> None:
    quota = quota_on(store)
    minute = free_tier(rate_limits=["2/minute"])
    refused = (await charge_n(quota, minute, "fre", 3))[-1]
    assert not refused.allowed
    assert refused.retry_after_ms is not None
    assert 0 < refused.retry_after_ms <= 60_000
    second = quota_policy(tiers={"paid": {"rate_limits": ["1/second"]}})
    refused = (await charge_n(quota, second, "pai", 2))[-1]
    assert not refused.allowed
    assert refused.retry_after_ms is not None
    assert 0 < refused.retry_after_ms <= 1_000
    # An allowed request names no retry.
    assert (await charge_n(quota, minute, "ent", 1))[0].retry_after_ms is None


async def test_a_refused_request_is_refunded_on_every_limit(store: Store) -> None:
    pol = free_tier(rate_limits=["3/minute", "1/second"])
    quota = quota_on(store)
    first, *refused = await charge_n(quota, pol, "fre", 5)
    assert first.allowed
    # Refused by 1/second: each refusal must not consume the 3/minute limit.
    for r in refused:
        assert not r.allowed
        assert r.refused_by is not None
        assert "1 per 1 second" in r.refused_by
    # Had those 4 refusals been counted, the 3/minute limit would refuse now.
    await asyncio.sleep(1.1)  # pacing: into the next 1/second window
    second = (await charge_n(quota, pol, "fre", 1))[0]
    assert second.allowed, second
    await asyncio.sleep(1.1)  # pacing: into the next 1/second window
    third = (await charge_n(quota, pol, "fre", 1))[0]
    assert third.allowed, third
    await asyncio.sleep(1.1)  # pacing: into the next 1/second window
    fourth = (await charge_n(quota, pol, "fre", 1))[0]
    assert not fourth.allowed
    assert fourth.refused_by is not None
    assert "3 per 1 minute" in fourth.refused_by


async def test_cost_limit_charges_input_characters_and_refunds_refusals(store: Store) -> None:
    pol = free_tier(rate_limits=["3/minute"], cost_limit="100/minute")
    key = key_of(pol, "fre")
    tier = pol.tiers["free"]
    quota = quota_on(store)
    assert (await quota.charge(key, tier, 60)).allowed
    refused = await quota.charge(key, tier, 60)
    assert not refused.allowed
    assert refused.refused_by is not None
    assert "input characters" in refused.refused_by
    assert "100 per 1 minute" in refused.refused_by
    # Its headers show the request limit as refunded: 1 of 3 used.
    assert (refused.limit, refused.remaining) == (3, 2)
    assert refused.retry_after_ms is not None
    assert 0 < refused.retry_after_ms <= 60_000
    # The refused 60 were refunded: 40 fit exactly (60 + 40 = 100).
    forty = await quota.charge(key, tier, 40)
    assert forty.allowed
    # The refused request's request charge was refunded too: this is the third of 3/minute.
    third = await quota.charge(key, tier, 0)
    assert third.allowed
    assert third.remaining == 0
    # Now both are full: one more character is refused, and so is one more request.
    over = await quota.charge(key, tier, 1)
    assert not over.allowed


async def test_cost_limit_alone_counts_characters_and_sends_no_request_headers(
    store: Store,
) -> None:
    pol = free_tier(cost_limit="100/minute")
    key = key_of(pol, "fre")
    quota = quota_on(store)
    results = [await quota.charge(key, pol.tiers["free"], 25) for _ in range(5)]
    assert [r.allowed for r in results] == [True] * 4 + [False]
    assert results[0].headers() == {}
    assert results[-1].refused_by is not None
    assert "input characters" in results[-1].refused_by


async def test_a_key_rate_limits_override_its_tier(store: Store) -> None:
    special = key_entry("special", "free", "special-secret", rate_limits=["2/minute"])
    pol = quota_policy(tiers={"free": {"rate_limits": ["5/minute"]}}, extra_keys=(special,))
    quota = quota_on(store)
    own = await charge_n(quota, pol, "special", 4)
    assert [r.allowed for r in own] == [True, True, False, False]
    assert [r.limit for r in own] == [2] * 4
    # The tier's other key still gets the tier's 5.
    tiered = await charge_n(quota, pol, "fre", 6)
    assert [r.allowed for r in tiered] == [True] * 5 + [False]
    assert tiered[0].limit == 5


async def test_concurrent_charges_admit_exactly_the_quota(store: Store) -> None:
    pol = free_tier(rate_limits=["20/minute"])
    key = key_of(pol, "fre")
    tier = pol.tiers["free"]
    quota = quota_on(store)
    results: list[QuotaResult] = await asyncio.gather(
        *(quota.charge(key, tier, 10) for _ in range(50))
    )
    assert sum(r.allowed for r in results) == 20
    assert all(
        r.retry_after_ms is not None and r.retry_after_ms > 0 for r in results if not r.allowed
    )
    # The counter holds exactly what was admitted: no room left, and none lost.
    assert not (await quota.charge(key, tier, 10)).allowed


async def test_two_gateways_racing_share_one_count(store: Store, redis_url: str) -> None:
    pol = free_tier(rate_limits=["20/minute"])
    key = key_of(pol, "fre")
    tier = pol.tiers["free"]
    other_store = Store.connect(redis_url, "t", name="test-2")
    try:
        one, two = quota_on(store), quota_on(other_store)
        results: list[QuotaResult] = await asyncio.gather(
            *(q.charge(key, tier, 10) for _ in range(25) for q in (one, two))
        )
        assert sum(r.allowed for r in results) == 20
        assert not (await one.charge(key, tier, 10)).allowed
        assert not (await two.charge(key, tier, 10)).allowed
    finally:
        await other_store.close()


def test_reset_header_format() -> None:
    result = QuotaResult(True, limit=5, remaining=3, reset_s=math.pi)
    assert result.headers() == {
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "3.142s",
    }
    assert QuotaResult(True).headers() == {}


@pytest.mark.parametrize(
    ("rates", "counts", "ttls_ms", "expected"),
    [
        # one request limit and a cost limit: the request limit's numbers
        (["10/second"], [3, 5000], [500, 40_000], QuotaResult(True, 10, 7, 0.5)),
        # a window not open yet: all of it is left
        (["10/second"], [1, 12], [-1, -1], QuotaResult(True, 10, 9, 1.0)),
        # two request limits: the one closest to running out
        (
            ["10/second", "100/minute"],
            [3, 98, 12],
            [500, 9_000, 9_000],
            QuotaResult(True, 100, 2, 9.0),
        ),
    ],
)
def test_the_headers_name_the_request_limit_closest_to_running_out(
    rates: list[str], counts: list[int], ttls_ms: list[int], expected: QuotaResult
) -> None:
    key = KeyEntry(id="k", tier="paid", sha256="0" * 64, rate_limits=rates)
    pol = parse_policy(as_yaml(policy()), "p.yaml")
    tier = pol.tiers["paid"]
    tier_with_cost = msgspec.structs.replace(tier, cost_limit="1000000/minute")
    quota = Quota(cast(GatewayQueue, _Names()))
    charges = quota.charges(key, tier_with_cost, 12)
    assert _result(charges, Admitted(True, 1, counts, ttls_ms)) == expected


class _Names:
    """What ``Quota`` asks of its queue to name counters (no Redis involved)."""

    def counter_key(self, name: str) -> str:
        return "rl:" + name
