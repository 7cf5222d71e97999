"""Unit tests of per-key quotas (sliding windows in ``admit.lua``, on a real
Redis, no infergate process). Capacity admission: test_admission.py."""

import asyncio
import math
import re
from collections.abc import AsyncIterator
from typing import Any, cast

import msgspec
import pytest
from infergate.base.queue.gateway import Admitted, GatewayQueue
from infergate.base.queue.store import Store
from infergate.gateway.quota import Quota, QuotaResult, _result
from infergate.policies import KeyEntry, Policy, parse_policy

from tests.helpers import as_yaml, key_entry, policy

INF = float("inf")

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
        # (a window of ten buckets: a limit under 10 frees its room once the
        # bucket it was spent in is out of the eleven counted, 66 s at most)
        assert 0 < r.reset_s <= (60 if r.allowed else 66)
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
    assert 0 < refused.retry_after_ms <= 66_000
    second = quota_policy(tiers={"paid": {"rate_limits": ["1/second"]}})
    refused = (await charge_n(quota, second, "pai", 2))[-1]
    assert not refused.allowed
    assert refused.retry_after_ms is not None
    assert 0 < refused.retry_after_ms <= 1_100
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
    assert 0 < refused.retry_after_ms <= 66_000
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
    assert _result(charges, Admitted(True, True, counts, ttls_ms)) == expected


class _Names:
    """What ``Quota`` asks of its queue to name counters (no Redis involved)."""

    def counter_key(self, name: str) -> str:
        return "rl:" + name


async def test_a_window_refused_by_its_oldest_bucket_names_its_limit(store: Store) -> None:
    """The last ten buckets have room, the eleven overlapping the window do
    not (the limit and a tenth): 429 naming that limit, with the time until
    the oldest bucket leaves, never an error."""
    pol = free_tier(rate_limits=["10/minute"])
    quota = quota_on(store)
    key = key_of(pol, "fre")
    (charge,) = quota.charges(key, pol.tiers["free"], 10)
    for _ in range(3):  # (again if a 6 s bucket ended between the two steps)
        now_s = (await store.redis.time())[0]
        current = now_s * 10 // 60
        await store.redis.delete(charge.counter.key)
        await store.redis.hset(
            charge.counter.key, mapping={current - 10: 6, current: 5, "l": current, "s": 11}
        )
        result = await quota.charge(key, pol.tiers["free"], 10)
        if (await store.redis.time())[0] * 10 // 60 == current:
            break
    assert not result.allowed
    assert result.refused_by == "10 per 1 minute (requests)"
    assert result.remaining == 5  # the last ten buckets' room
    assert result.retry_after_ms is not None
    assert 0 < result.retry_after_ms <= 6_000  # the oldest bucket leaves within one


async def test_a_limit_lowered_live_counts_what_its_window_holds(store: Store) -> None:
    """A window is named by its period, not its amount: lowered from 5 to 3
    a minute (an operator's edit), the 4 already counted refuse the next;
    raised to 6, they leave room for 2; rewritten as 6 a 60 seconds, none.
    (Named by its amount, or its period as written, each edit started the
    count over.) Written twice, a period is one window, at the smaller
    amount."""
    quota = quota_on(store)
    results = await charge_n(quota, free_tier(rate_limits=["5/minute"]), "fre", 4)
    assert all(r.allowed for r in results)
    (lowered,) = await charge_n(quota, free_tier(rate_limits=["3/minute"]), "fre", 1)
    assert not lowered.allowed
    raised = await charge_n(quota, free_tier(rate_limits=["6/minute"]), "fre", 3)
    assert [r.allowed for r in raised] == [True, True, False]
    twice = free_tier(rate_limits=["9/minute", "7/60 seconds", "100/minute"])
    (charge,) = quota.charges(key_of(twice, "fre"), twice.tiers["free"], 1)
    assert charge.counter.amount == 7
    # Written another way, the same period is the same window.
    (respelled,) = await charge_n(quota, free_tier(rate_limits=["6/60 seconds"]), "fre", 1)
    assert not respelled.allowed
