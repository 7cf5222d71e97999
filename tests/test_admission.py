"""Unit tests of capacity admission (``gateway/admission.py``): arithmetic on
a fleet view set by hand, no Redis. A tier's requests are served at the rate
the tiers above leave it (capacity less their arrival rate), after what is
queued above, or at least at the rate of its reserved slots; its allowance is
how many of its requests can wait within its budget less one batch time."""

import asyncio
from collections.abc import Iterable
from types import SimpleNamespace
from typing import cast

import pytest
from infergate.base.fleet import ArrivalRates, FleetView
from infergate.base.queue.gateway import GatewayQueue
from infergate.base.queue.store import FleetSnapshot, Store
from infergate.base.wire import Heartbeat
from infergate.gateway.admission import Admission, Decision
from infergate.gateway.api import Parameters
from infergate.gateway.checks import fit_fleet
from infergate.gateway.errors import ApiError
from infergate.gateway.models import ModelLane
from infergate.gateway.replies import ReplyRouter
from infergate.policies import Policy, parse_policy
from infergate.redis_server import RedisServer
from msgspec.structs import replace

from tests.helpers import as_yaml, policy, until

INF = float("inf")


def worker(n: int, batch_ms: float, draining: bool = False) -> Heartbeat:
    return Heartbeat(
        role="worker", id=f"w{n}", started_ms=0, beat_ms=0, batch_ms=batch_ms, draining=draining
    )


def gateway(n: int, beat_ms: int, enterprise: int = 0, paid: int = 0, free: int = 0) -> Heartbeat:
    """A gateway's heartbeat: what it admitted per tier since it started."""
    return Heartbeat(
        role="gateway",
        id=f"g{n}",
        started_ms=0,
        beat_ms=beat_ms,
        admitted_by_tier=[enterprise, paid, free],
    )


def snapshot(
    workers: Iterable[Heartbeat],
    enterprise: int = 0,
    paid: int = 0,
    free: int = 0,
    gateways: Iterable[Heartbeat] = (),
) -> FleetSnapshot:
    return FleetSnapshot(
        workers=list(workers),
        queue_depth={"enterprise": enterprise, "paid": paid, "free": free},
        taken_ms=0,
        gateways=list(gateways),
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
    """4 x (100 / 0.25 s) = 1600 rps measured; at 0.5 utilization 800 rps planned."""
    return [worker(i, 250.0) for i in range(4)]


def wait_ms(ahead: float, rate: float, batch_ms: float = 250.0) -> float:
    """The model: the requests ahead and this one at ``rate``, then its own batch."""
    return (ahead + 1) / rate * 1000.0 + batch_ms


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
    half = admission_policy(max_batch=10, utilization=0.5)
    assert admission.capacity_rps(half) == pytest.approx(75.0)
    assert admission.capacity_rps(admission_policy(max_batch=10, utilization=1.0)) == (
        pytest.approx(150.0)
    )
    # 15 queued and this one at 75 rps, then its batch: 213.3 + 150 ms.
    assert admission.estimate_wait_ms(half, "enterprise") == pytest.approx(wait_ms(15, 75, 150))


def test_draining_or_dead_workers_lower_capacity_and_raise_the_wait() -> None:
    pol = admission_policy()
    view = fleet(snapshot(four_workers(), enterprise=60))
    admission = Admission(view)
    assert admission.capacity_rps(pol) == pytest.approx(800.0)
    assert admission.estimate_wait_ms(pol, "enterprise") == pytest.approx(wait_ms(60, 800))
    # One starts draining: 3 x 400 x 0.5 = 600 rps.
    drained = [*four_workers()[:3], worker(3, 250.0, draining=True)]
    view.snapshot = snapshot(drained, enterprise=60)
    assert admission.capacity_rps(pol) == pytest.approx(600.0)
    assert admission.estimate_wait_ms(pol, "enterprise") == pytest.approx(wait_ms(60, 600))
    # Two died (gone from the snapshot): 400 rps.
    view.snapshot = snapshot(four_workers()[:2], enterprise=60)
    assert admission.estimate_wait_ms(pol, "enterprise") == pytest.approx(wait_ms(60, 400))


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
def test_no_capacity_means_no_allowance_and_refusal_with_retry_after(
    snap: FleetSnapshot | None,
) -> None:
    pol = admission_policy(budgets={"enterprise": 10_000, "paid": 10_000, "free": 10_000})
    admission = Admission(fleet(snap))
    assert admission.capacity_rps(pol) == 0.0
    for tier in ("enterprise", "paid", "free"):
        assert admission.estimate_wait_ms(pol, tier) == INF
        assert admission.allowance(pol, tier) == 0.0
        # No batch time is measured by any serving worker: retry after 100 ms.
        assert admission.decide(pol, tier) == Decision(False, INF, 100, 0.0)


def test_the_wait_counts_own_and_higher_tiers_only() -> None:
    pol = admission_policy()
    view = fleet(snapshot(four_workers(), enterprise=50, paid=25, free=25))
    admission = Admission(view)
    assert waits(admission, pol) == pytest.approx(
        {"enterprise": wait_ms(50, 800), "paid": wait_ms(75, 800), "free": wait_ms(100, 800)}
    )
    # Lower tiers' queues do not delay a higher tier.
    view.snapshot = snapshot(four_workers(), enterprise=50, paid=25, free=150)
    assert waits(admission, pol) == pytest.approx(
        {"enterprise": wait_ms(50, 800), "paid": wait_ms(75, 800), "free": wait_ms(225, 800)}
    )


def test_the_allowance_is_what_waits_within_the_budget_after_what_is_queued_above() -> None:
    # Budgets 1,000 ms less a 250 ms batch: 0.75 s at 800 rps is 600 requests.
    pol = admission_policy(budgets={"enterprise": 1000, "paid": 1000, "free": 1000})
    view = fleet(snapshot(four_workers(), enterprise=100, paid=50, free=500))
    admission = Admission(view)
    assert admission.allowance(pol, "enterprise") == pytest.approx(600.0)
    assert admission.allowance(pol, "paid") == pytest.approx(500.0)
    # A tier's own queue is not in its allowance: its keys' shares are (admit.lua).
    assert admission.allowance(pol, "free") == pytest.approx(450.0)
    assert admission.decide(pol, "free") == Decision(True, 0.0, 0, pytest.approx(450.0))
    # 600 queued above: nothing left.
    view.snapshot = snapshot(four_workers(), enterprise=300, paid=300)
    assert admission.allowance(pol, "free") == 0.0
    refused = admission.decide(pol, "free")
    assert not refused.admitted
    assert refused.wait_ms == pytest.approx(wait_ms(600, 800))
    # Retry after the excess over the budget, here under one batch time: that.
    assert refused.retry_after_ms == 250
    # What this gateway admitted since the view counts as queued above.
    view.snapshot = snapshot(four_workers(), enterprise=300, paid=299)
    assert admission.decide(pol, "free").admitted
    admission.admitted("paid")
    assert not admission.decide(pol, "free").admitted
    admission.released("paid")
    assert admission.decide(pol, "free").admitted


def test_a_burst_the_fleet_clears_within_the_budget_is_admitted_whole() -> None:
    """The issue's burst: 2 workers of about 1,000 rps, idle, then 400 requests
    of all three tiers at once; free (500 ms, 5 % reserved) keeps room for
    all of its third behind the other two thirds."""
    pol = admission_policy(
        free_share=0.05, budgets={"enterprise": 300, "paid": 1000, "free": 500}, utilization=0.85
    )
    view = fleet(snapshot([worker(1, 100.0), worker(2, 100.0)]))
    admission = Admission(view)
    for tier in ("enterprise", "paid", "free"):
        for _ in range(133):
            assert admission.decide(pol, tier).admitted, tier
            admission.admitted(tier)
    # 1,700 rps planned: 266 above free drain in 156 ms; 0.4 s leaves room for 414.
    assert admission.allowance(pol, "free") == pytest.approx(0.4 * 1700 - 266)


def test_the_arrival_rate_of_the_tiers_above_is_capacity_they_take() -> None:
    """The issue's overload: 1 worker of batches of 10 (100 rps measured, 85
    planned), enterprise arriving at 20 rps: free is served at 65 rps."""
    pol = admission_policy(max_batch=10, utilization=0.85, budgets={"free": 500})
    beats = [gateway(1, 0), gateway(2, 0)]
    view = fleet(snapshot([worker(1, 100.0)], gateways=beats))
    # Two gateways admit 10 enterprise requests a second each, 5 free.
    for t in range(1, 11):
        beats = [gateway(1, t * 100, enterprise=t, free=t // 2), gateway(2, t * 100, enterprise=t)]
        view.snapshot = snapshot([worker(1, 100.0)], enterprise=2, free=3, gateways=beats)
    assert view.arrival_rps("enterprise") == pytest.approx(20.0)
    assert view.arrival_rps("free") == pytest.approx(50 / 9, rel=0.2)
    admission = Admission(view)
    # (500 - 100) ms at 65 rps, less the 2 queued above: 24 free requests.
    assert admission.allowance(pol, "free") == pytest.approx(0.4 * 65 - 2)
    assert admission.estimate_wait_ms(pol, "free") == pytest.approx(wait_ms(5, 65, 100))
    # Enterprise's own rate does not count against it.
    budget_ms = pol.tiers["enterprise"].latency_budget_ms
    assert admission.allowance(pol, "enterprise") == pytest.approx((budget_ms - 100) / 1000 * 85)


def test_arrival_rates_forget_gateways_gone_and_old_beats() -> None:
    rates = ArrivalRates(3)
    rates.update([gateway(1, 0, paid=0)])
    rates.update([gateway(1, 500, paid=50)])
    assert rates.rps == pytest.approx([0.0, 100.0, 0.0])
    # A beat seen again changes nothing; one of an earlier version is not counted.
    old = Heartbeat(role="gateway", id="g2", started_ms=0, beat_ms=500, admitted=10**6)
    rates.update([gateway(1, 500, paid=50), old])
    assert rates.rps == pytest.approx([0.0, 100.0, 0.0])
    # Beats older than the window drop out: from 2,500 ms on the rate is 100 -> 100.
    rates.update([gateway(1, 2_500, paid=250)])
    rates.update([gateway(1, 3_000, paid=250)])
    assert rates.rps == pytest.approx([0.0, 0.0, 0.0])
    # A gateway gone from the view is forgotten; a restart's lower count is not negative.
    rates.update([])
    rates.update([gateway(1, 4_000, paid=0)])
    rates.update([gateway(1, 4_500, paid=0)])
    assert rates.rps == pytest.approx([0.0, 0.0, 0.0])


@pytest.mark.parametrize(("share", "slots"), [(0.1, 10), (0.25, 25), (0.004, 1)])
def test_a_tier_with_reserved_slots_always_has_their_rate(share: float, slots: int) -> None:
    pol = admission_policy(free_share=share, budgets={"free": 1250})
    assert pol.reserved_slots("free") == slots
    # Far more queued above than the budget covers: free still gets its slots,
    # 800 x slots / 100 rps for 1 s (1,250 ms less the batch).
    view = fleet(snapshot(four_workers(), enterprise=6000, paid=4000, free=30))
    admission = Admission(view)
    assert admission.allowance(pol, "free") == pytest.approx(8.0 * slots)
    assert admission.estimate_wait_ms(pol, "free") == pytest.approx(wait_ms(30, 8.0 * slots))
    # Tiers without a share have none: paid waits behind enterprise's 6,000.
    assert admission.allowance(pol, "paid") == 0.0


def test_decide_counts_nothing() -> None:
    pol = admission_policy(budgets={"enterprise": 500})
    view = fleet(snapshot(four_workers(), enterprise=100))
    admission = Admission(view)
    before = admission.allowance(pol, "paid")
    for _ in range(10):
        admission.decide(pol, "enterprise")
    assert admission.allowance(pol, "paid") == before
    # The same view assigned again is not a new one: counts stay; a new one starts over.
    admission.admitted("enterprise")
    assert admission.allowance(pol, "paid") == before - 1
    view.snapshot = view.snapshot
    assert admission.allowance(pol, "paid") == before - 1
    view.snapshot = snapshot(four_workers(), enterprise=100)
    assert admission.allowance(pol, "paid") == before


def test_this_gateways_own_arrivals_count_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the gateways' heartbeats show the tiers above arriving (they
    are seconds behind), this gateway's own rate over the last half second,
    times the gateways alive, counts: overload is seen within a fleet view."""
    from infergate.base import clock

    now = [100.0]
    monkeypatch.setattr(clock, "monotonic_s", lambda: now[0])
    pol = admission_policy(max_batch=10, utilization=0.85, free_share=0.05, budgets={"free": 500})
    beats = [gateway(1, 0), gateway(2, 0)]
    view = fleet(snapshot([worker(1, 100.0)], gateways=beats))
    here = [0, 0, 0]  # (what the gateway admitted per tier: its heartbeat's counts)
    admission = Admission(view, lambda: here)
    reserved_only = 0.4 * 85 * 1 / 10
    assert admission.allowance(pol, "free") == pytest.approx(0.4 * 85)
    # 10 enterprise requests every 50 ms here (200 rps), 400 with two gateways.
    for _ in range(6):
        now[0] += 0.05
        here[0] += 10
        view.snapshot = snapshot([worker(1, 100.0)], gateways=beats)
    assert view.arrival_rps("enterprise") == 0.0  # (the heartbeats say nothing yet)
    assert admission.allowance(pol, "free") == pytest.approx(reserved_only)
    # Half a second later with nothing more, the rate is gone again.
    now[0] += 0.6
    view.snapshot = snapshot([worker(1, 100.0)], gateways=beats)
    view.snapshot = snapshot([worker(1, 100.0)], gateways=beats)
    admission.decide(pol, "free")
    assert admission.allowance(pol, "free") == pytest.approx(0.4 * 85)


async def test_a_view_at_rest_is_read_again_for_the_first_request_after_it(
    redis_url: str,
) -> None:
    """At rest the view is refreshed seldom (here every 60 s), but a request
    is never decided on one older than ``refresh_ms``: ``fresh`` reads it
    then, once for every request that waits on it."""
    store = Store.connect(redis_url, "at-rest", name="test")
    view = FleetView(store, refresh_ms=50, at_rest_ms=60_000)
    try:
        await view.start()  # (read once; the loop's next read, at rest, is a minute away)
        assert view.workers_alive == 0
        await store.beat(worker(1, 100.0), ttl_ms=10_000)
        # Pacing, not a condition: the view must be older than refresh_ms
        # (50 ms) for a request to read it again.
        await asyncio.sleep(0.1)
        reads = 0
        fleet_snapshot = store.fleet_snapshot

        async def counted(now_ms: int) -> FleetSnapshot:
            nonlocal reads
            reads += 1
            return await fleet_snapshot(now_ms)

        store.fleet_snapshot = counted  # type: ignore[method-assign]
        await asyncio.gather(*(view.fresh() for _ in range(5)))
        assert (view.workers_alive, reads) == (1, 1)
        await view.fresh()  # (fresh now: not read again)
        assert reads == 1
    finally:
        await view.stop()
        await store.close()


async def test_a_view_at_rest_waits_longer_once_a_worker_serves(redis_url: str) -> None:
    """At rest a view is read every ``at_rest_ms`` while its process has
    no worker (a gateway that starts before its workers is ready as soon
    as one is there), and every ``serving_at_rest_ms`` once it has (what
    reads it then is readiness and the gauges); a request brings it to
    ``refresh_ms``."""
    store = Store.connect(redis_url, "rest-serving", name="test")
    view = FleetView(store, refresh_ms=50, at_rest_ms=1_000, serving_at_rest_ms=4_000)
    try:
        await view.refresh()
        assert (view.workers_alive, view.loop.interval_s) == (0, 1.0)
        await store.beat(worker(1, 100.0), ttl_ms=10_000)
        await view.refresh()
        assert (view.workers_alive, view.loop.interval_s) == (1, 4.0)
        view._read_at = 0.0  # (old: a request reads it again)
        await view.fresh()
        assert view.loop.interval_s == 0.05
        # A gateway ready on its shard (a worker of another model serves):
        # a model's view with no worker of its own rests too.
        ready = [True]
        other = FleetView(store, 50, 1_000, 4_000, serving=lambda: ready[0])
        await other.refresh()  # (the namespace's one worker: it reads as if none)
        assert other.loop.interval_s == 4.0
        ready[0] = False
        await other.refresh()
        assert other.loop.interval_s == 1.0
    finally:
        await view.stop()
        await store.close()


async def test_a_resting_view_reads_as_none_at_once_when_its_redis_is_lost() -> None:
    """A view at rest (here read every minute) is not left with what it
    last read when its Redis goes: the reply listener's subscription
    breaks, the view reads as none at once (not ready; a request may then
    be served directly), and it is read again at the busy interval's tick,
    not the resting one's, once Redis is back."""
    server = RedisServer().start()
    store = Store.connect(server.url, "lost", name="test")
    view = FleetView(store, refresh_ms=50, at_rest_ms=60_000)
    lost: list[tuple[int, FleetSnapshot | None]] = []

    def on_lost(shard: int) -> None:
        view.mark_unreachable()
        lost.append((shard, view.snapshot))  # (none at once, not at a read after)

    router = ReplyRouter([GatewayQueue(store, "gw")], on_lost=on_lost)
    try:
        await store.beat(worker(1, 100.0), ttl_ms=60_000)
        await view.start()
        await router.start()
        assert (view.redis_ok, view.workers_alive, router.listening()) == (True, 1, True)
        server.kill()
        await until(lambda: view.snapshot is None, 5, "the view to read as none")
        assert (lost, view.redis_ok, view.workers_alive) == ([(0, None)], False, 0)
        server.start()
        await until(lambda: view.redis_ok, 10, "the view to be read again")
        assert view.workers_alive == 0  # (read again: the new Redis has no worker)
    finally:
        await router.stop()
        await view.stop()
        await store.close()
        server.close()


async def test_a_refusal_for_what_the_workers_lack_is_judged_on_a_fresh_view_or_the_last() -> None:
    """``fit_fleet``: a request that asks for a sample is judged on its
    view read fresh either way (a worker that samples has joined since:
    served; it has stopped sampling: refused), and on the view it had when
    Redis does not answer (400, not a 503 for a store its answer does not
    need). One that asks nothing of the workers passes, Redis or not."""
    server = RedisServer().start()
    store = Store.connect(server.url, "fit", name="test")
    view = FleetView(store, refresh_ms=50, at_rest_ms=60_000)
    lane = cast(ModelLane, SimpleNamespace(fleet=view, name="default"))
    model = parse_policy(as_yaml(policy())).models["default"]
    sample = Parameters(temperature=0.7)
    try:
        await store.beat(replace(worker(1, 100.0), lacks=["sampling"]), ttl_ms=60_000)
        await view.start()
        with pytest.raises(ApiError, match="does not sample"):
            await fit_fleet(sample, lane, model)
        await store.beat(worker(2, 100.0), ttl_ms=60_000)  # (it samples)
        view._read_at = 0.0  # (the view read long ago, at rest)
        await fit_fleet(sample, lane, model)  # (read again: served)
        await store.beat(replace(worker(2, 100.0), lacks=["sampling"]), ttl_ms=60_000)
        view._read_at = 0.0
        with pytest.raises(ApiError, match="does not sample"):  # (read again: refused)
            await fit_fleet(sample, lane, model)
        server.kill()
        view._read_at = 0.0
        with pytest.raises(ApiError, match="does not sample"):  # (the read fails)
            await fit_fleet(sample, lane, model)
        assert view.snapshot is None
        await fit_fleet(None, lane, model)
    finally:
        await view.stop()
        await store.close()
        server.close()
