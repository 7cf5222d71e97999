"""What a gateway may do in Redis: charge a request's quota and queue it (in
one step), cancel one, keep and find jobs, and listen for its own replies."""

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, NamedTuple

from infergate.base import clock, periods, wire
from infergate.base.errors import STORE_ERRORS, wrong_type
from infergate.base.queue import dead_letters, inputs
from infergate.base.queue.forming import new_batch_id
from infergate.base.queue.inputs import Beside
from infergate.base.queue.resp import RawConnection
from infergate.base.queue.store import Store
from infergate.base.tiers import TIERS
from redis.asyncio.client import Pipeline, PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError


class Counter(NamedTuple):
    """One limit's counter, and what a request costs it (``admit.lua``)."""

    key: str  # under the namespace's rate-limit prefix
    cost: int
    amount: int
    window_s: int
    # A hard bound (tokens): no window-long span is charged more than
    # ``amount``; otherwise a tenth more may fall in one (window.lua).
    hard: bool = False
    # A budget's calendar period ("day", "week", "month": base/periods.py)
    # instead of a sliding window (budget.lua); always a hard bound.
    period: str = ""
    # For an estimate (a GPU budget's reservation), the least its cost may
    # be cut to, where that is all that is left of the budget: the period's
    # last request takes the rest (``Admitted.cut``). 0: never cut.
    least: int = 0

    @property
    def most(self) -> int:
        """The most its window's eleven buckets may hold."""
        return self.amount if self.hard else self.amount + self.amount // 10


class Place(NamedTuple):
    """A request's place in its tier's fair queue (``admit.lua``): its key,
    its cost, its key's weight, how many of the tier's requests may wait
    (the key may hold its weight's share of them; 0: no such check), and
    the weights of the keys seen lately, waiting or not (they share too)."""

    key_id: str = ""
    cost: int = 0
    weight: float = 1.0
    allowance: float = 0.0
    recent_weight: float = 0.0


ANYWHERE = Place()  # no key's place: no share check (tests, and what a tool queues)


class Admitted(NamedTuple):
    """What ``admit`` did: charged (and queued) or not, and each window after it."""

    admitted: bool
    queued: bool  # onto its tier's fair queue (not when refused, or handed straight)
    counts: list[int]  # each window's sum (after the charge, if admitted)
    # ms until each window has room again (refused), or until it is as it
    # was before any charge (its current bucket leaves its last ten);
    # negative: nothing charged in it
    ttls_ms: list[int]
    handed: bool = False  # handed straight to an idle worker, not queued
    over_share: bool = False  # refused: its key already holds its share of the tier
    refused_by: int = -1  # the first counter without room (its index), if any
    now_ms: int = 0  # Redis's clock as it charged (the buckets charged: ``settle``)
    cut: int = 0  # what its estimates were charged less than their cost (what was left)


# How long past its deadline a withdrawn request's reservation waits for a
# take to drop the request (after that, it is kept: never over).
RESERVED_KEPT_MS = 300_000


def _bucket(counter: Counter, charged_ms: int) -> int:
    """The bucket (a window's tenth, a budget's period) a charge at
    ``charged_ms`` (Redis's clock) went into."""
    if counter.period:
        return periods.index_at(charged_ms, counter.period)
    return charged_ms * 10 // (counter.window_s * 1000)


# admit_request.lua's verdicts: the first field of its reply.
REFUSED, ADMITTED, OVER_SHARE, HELD_BACK = 0, 1, 2, 3


def admitted_from(reply: list[Any]) -> tuple[int, Admitted]:
    """``admit_request.lua``'s reply, read by name in this one place: its
    verdict, whether it was queued or handed straight, each limit's count
    and ms, the first limit without room (1-based; 0: none), Redis's clock,
    and what its estimates were charged less than their cost."""
    verdict, queued, handed, *limits, refused_by, now_ms, cut = reply
    admitted = Admitted(
        admitted=verdict == ADMITTED,
        queued=bool(queued),
        counts=limits[0::2],
        ttls_ms=limits[1::2],
        handed=bool(handed),
        over_share=verdict == OVER_SHARE,
        refused_by=int(refused_by) - 1,
        now_ms=int(now_ms),
        cut=int(cut),
    )
    return int(verdict), admitted


class ReplySubscription:
    """This gateway's reply channel and the jobs-done channel, subscribed:
    messages read straight from the subscribed connection (``resp``)."""

    def __init__(self, pubsub: PubSub, jobs_done: bytes, job_prefix: str) -> None:
        if pubsub.connection is None:
            raise RedisConnectionError("the subscription has no connection")
        self._raw: RawConnection = RawConnection(pubsub.connection)
        self._jobs_done: bytes = jobs_done
        self._job_prefix: str = job_prefix

    async def next_message(self, timeout_s: float) -> tuple[bytes | None, list[str]]:
        """The next reply's raw bytes, or the ids of jobs just finished (one
        of the two), or (None, []) if nothing came within ``timeout_s``."""
        message = await self._raw.next_push(timeout_s)
        if isinstance(message, Exception):
            raise message
        # [b"message", channel, data]; a subscribe confirmation is skipped
        if not isinstance(message, list) or len(message) != 3 or message[0] != b"message":
            return None, []
        _, channel, data = message
        if channel == self._jobs_done:
            keys = data.decode(errors="replace").split()
            return None, [k.removeprefix(self._job_prefix) for k in keys]
        return data, []


class GatewayQueue:
    def __init__(
        self, store: Store, gateway_id: str, on_handed: Callable[[], None] = lambda: None
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.gateway_id = gateway_id
        self._on_handed = on_handed  # a request handed straight to a worker (``admit``)
        # admit.lua names the keys that handing a request straight to a worker
        # reads and writes from the model's prefix and these (not sent per request).
        self._tier_names = " ".join(TIERS)

    def counter_key(self, name: str) -> str:
        """A limit's sliding window, named as the ``limits`` library names its
        counter (under ``quota``: the fixed windows of earlier versions were
        under ``ratelimit``)."""
        return f"{self.keys.quota_prefix}:{name}"

    async def admit(
        self,
        counters: Sequence[Counter],
        tier: str | None = None,
        envelope: bytes = b"",
        straight: bool = False,
        beside: Beside | None = None,
        place: Place = ANYWHERE,
        hold_input: bool = False,
    ) -> Admitted:
        """Charge ``counters`` and, if every one has room, queue ``envelope`` on
        ``tier`` and wake a dispatcher: one round trip (``admit.lua``). Without a
        tier, charge only; without counters, queue only. ``straight``: while
        nothing is queued and a worker is idle, hand it to that worker as a
        batch of its own instead, as a dispatcher would (``Admitted.handed``).
        ``beside``: the envelope's long input, stored under its own key in the
        same round trip, and deleted if the request is refused (``inputs.py``).
        ``place``: where it queues in its tier's fair order, and whether its
        key may queue one more. ``hold_input``: a refusal is expected (its
        key was refused lately), so ``beside`` is not written unless the
        admit finds room after all, and then it is sent again with it (a
        refused request's input then costs Redis nothing)."""
        keys = self.keys
        names = [c.key for c in counters]
        args: list[str | int | float | bytes] = [len(counters), envelope]
        for c in counters:
            args += (c.cost, c.amount, c.most, c.period or c.window_s, c.least)
        stored_first = None
        if tier is not None:
            names += (keys.fair_queue(tier), keys.doorbell, keys.fair_state(tier))
            if beside is not None:
                # Written just before the call, by a command of its own: no
                # script makes it a string (the script deletes it if refused).
                if not hold_input:
                    stored_first = ("SET", beside.key, beside.input, "PX", beside.ttl_ms)
                names.append(beside.key)
            args.append(0 if beside is None else 2 if hold_input else 1)
            args += (
                place.key_id,
                place.cost,
                round(place.weight * 1000),
                place.allowance,
                round(place.recent_weight * 1000),
            )
            if straight:
                args += (
                    new_batch_id(),
                    self.gateway_id,
                    clock.now_ms(),
                    keys.prefix,
                    self._tier_names,
                )
        verdict, admitted = admitted_from(await self.store.admits.admit(names, args, stored_first))
        if verdict == HELD_BACK:  # (room after all, for an input held back)
            return await self.admit(counters, tier, envelope, straight, beside, place)
        if admitted.handed:
            self._on_handed()
        return admitted

    async def settle(self, unused: Sequence[tuple[Counter, int, int]]) -> None:
        """Give back what reservations of hard bounds did not use: each
        (counter, its cost what was reserved; Redis's clock as it was
        charged; what is unused) to the bucket it was charged in
        (``settle.lua``, gathered: settlements.py)."""
        names: list[str] = []
        args: list[int] = []
        for counter, charged_ms, back in unused:
            names.append(counter.key)
            args += (_bucket(counter, charged_ms), back, counter.cost)
        await self.store.settlements.give_back(names, args)

    async def spent(self, budgets: Sequence[Counter], now_ms: int) -> list[int]:
        """What each budget counts in the period ``now_ms`` falls in
        (``budget.lua``: a count of an earlier period, or none, is 0)."""
        pipe = self.store.redis.pipeline(transaction=False)
        for counter in budgets:
            pipe.hmget(counter.key, "l", "s")
        out = []
        for counter, (last, total) in zip(budgets, await pipe.execute(), strict=True):
            current = str(periods.index_at(now_ms, counter.period)).encode()
            out.append(int(total) if last == current and total and total.isdigit() else 0)
        return out

    def stored(self, envelope: wire.Envelope) -> tuple[bytes, Beside | None]:
        """The envelope as it is queued, and its input if it is kept beside it."""
        return inputs.stored(self.keys, envelope)

    async def enqueue(
        self, tier: str, envelope: bytes, beside: Beside | None = None, place: Place = ANYWHERE
    ) -> bool:
        """Queue an envelope (and store its long input beside it) and wake a
        dispatcher; returns whether it was queued (or handed to an idle worker)."""
        return (await self.admit((), tier, envelope, beside=beside, place=place)).queued

    async def enqueue_job(
        self,
        envelope: wire.Envelope,
        max_queued: int,
        result_ttl_ms: int,
        place: Place = ANYWHERE,
        reserved: Sequence[tuple[Counter, int, str]] = (),
        input_bound: int = 0,
        model: str = "",
    ) -> bool:
        """Accept a job: its record and its envelope, in one step, in its
        key's fair order of its tier's jobs (``place``: its cost and its
        key's weight). False (and nothing changed) if its key already has
        ``max_queued`` jobs queued. What it ``reserved`` (each counter,
        Redis's clock as charged, its unit: "t" tokens, "g" GPU µs) and its
        input's bound in tokens stay on its record, for the script that
        finishes, cancels or drops it to settle (``give_back.lua``), with
        its ``model``."""
        keys = self.keys
        depth = await self.store.scripts.enqueue_job(
            keys=[
                keys.job_fair_queue(envelope.tier),
                keys.doorbell,
                keys.job(envelope.id),
                keys.jobs_queued,
                keys.job_fair_state(envelope.tier),
            ],
            args=[
                wire.encode_queued(envelope),
                envelope.key_id,
                max_queued,
                envelope.tier,
                envelope.enqueued_ms,
                envelope.deadline_ms,
                result_ttl_ms,
                max(place.cost, 1),
                round(place.weight * 1000),
                " ".join(f"{c.key} {_bucket(c, ms)} {c.cost} {unit}" for c, ms, unit in reserved),
                input_bound,
                model,
            ],
        )
        return int(depth) >= 0

    async def job(self, job_id: str) -> dict[str, str]:
        """A job's record (empty if there is none, or no more, or a key of
        another type is planted under its name); bytes that are not UTF-8
        (planted: the gateway and workers write JSON and ASCII) are
        replaced, not raised."""
        try:
            raw: dict[bytes, bytes] = await self.store.redis.hgetall(self.keys.job(job_id))  # type: ignore[assignment]
        except ResponseError as exc:
            if not wrong_type(exc):
                raise
            return {}
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}

    async def cancel_job(self, job_id: str, key_id: str) -> str | None:
        """Cancel a queued job of ``key_id``: its status afterwards, or None if
        it has no such job."""
        status = await self.store.scripts.cancel_job(
            keys=[self.keys.job(job_id), self.keys.cancelled, self.keys.jobs_queued],
            args=[key_id, job_id, clock.now_ms()],
        )
        return (
            None
            if status is None
            else (status.decode(errors="replace") if isinstance(status, bytes) else str(status))
        )

    async def cached_answer(self, digest: str, fingerprint: str) -> str | None:
        """The answer a worker kept for this input digest and model, if any."""
        raw: bytes | None = await self.store.redis.get(self.keys.cache(digest, fingerprint))  # type: ignore[assignment]
        return None if raw is None else raw.decode("utf-8", errors="replace")

    async def epoch(self) -> bytes:
        """This Redis's token, set by the first to ask (``Keys.epoch``)."""
        pipe = self.store.redis.pipeline(transaction=True)
        pipe.set(self.keys.epoch, os.urandom(8).hex(), nx=True)
        pipe.get(self.keys.epoch)
        _, token = await pipe.execute()
        return bytes(token or b"")

    async def cancel(
        self, request_id: str, until_ms: int, reserved: Sequence[tuple[Counter, int, int]] = ()
    ) -> None:
        """Mark a queued request as abandoned; ``take`` drops it (and its
        long input, if it has one), and gives back what it ``reserved``
        (``leave_reserved``), if it has not run."""
        pipe = self.store.redis.pipeline(transaction=bool(reserved))
        if reserved:
            self._leave_reserved(pipe, request_id, until_ms, reserved)
        self._mark_cancelled(pipe, {request_id: until_ms})
        await pipe.execute()

    async def leave_reserved(
        self, request_id: str, until_ms: int, reserved: Sequence[tuple[Counter, int, int]]
    ) -> None:
        """A request given up on (past its deadline, withdrawn): what it
        reserved (each counter, Redis's clock as charged, the amount) is left
        beside it, for the ``take`` that drops it unrun to give back
        (``give_back.lua``); one that ran keeps it all (never over)."""
        pipe = self.store.redis.pipeline(transaction=False)
        self._leave_reserved(pipe, request_id, until_ms, reserved)
        await pipe.execute()

    def _leave_reserved(
        self,
        pipe: Pipeline,
        request_id: str,
        until_ms: int,
        reserved: Sequence[tuple[Counter, int, int]],
    ) -> None:
        text = " ".join(f"{c.key} {_bucket(c, charged_ms)} {n}" for c, charged_ms, n in reserved)
        keep_ms = max(until_ms - clock.now_ms(), 0) + RESERVED_KEPT_MS
        pipe.set(self.keys.give_back(self.gateway_id, request_id), text, px=keep_ms)

    async def cancel_all(self, request_ids: Sequence[str], until_ms: int) -> None:
        """``cancel`` for several requests, in one round trip."""
        pipe = self.store.redis.pipeline(transaction=False)
        self._mark_cancelled(pipe, dict.fromkeys(request_ids, until_ms))
        await pipe.execute()

    def _mark_cancelled(self, pipe: Pipeline, until_ms: Mapping[str, int]) -> None:
        # the marks past their deadline go as new ones come: a take that finds
        # nothing queued reads nothing (take_form.lua), so the set stays
        # bounded by the cancellations within a deadline, whatever takes find
        pipe.zremrangebyscore(self.keys.cancelled, "-inf", clock.now_ms())
        pipe.zadd(self.keys.cancelled, dict(until_ms))

    async def dead_letters(self, limit: int) -> tuple[int, list[dead_letters.DeadLetter]]:
        """For operators: the dead-letter list's size and its newest ``limit`` batches."""
        return await dead_letters.read(self.store, limit)

    async def purge_dead_letters(self) -> int:
        return await dead_letters.purge(self.store)

    @contextlib.asynccontextmanager
    async def replies(self) -> AsyncIterator[ReplySubscription]:
        """Subscribe to this gateway's reply channel for the life of the block."""
        pubsub = self.store.redis.pubsub()
        try:
            await pubsub.subscribe(self.keys.reply_channel(self.gateway_id), self.keys.jobs_done)
            yield ReplySubscription(pubsub, self.keys.jobs_done.encode(), self.keys.job_prefix)
        finally:
            with contextlib.suppress(*STORE_ERRORS):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
