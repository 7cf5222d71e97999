"""Work done once: identical requests share one answer.

Three places, from the cheapest:

- **In a batch** (the worker): identical inputs of one batch are one input
  of the backend call, answered to every request that sent it. Every copy
  is reported ``served_by: model``, so it tells no key anything about
  another's input; it is always on.
- **In flight at this gateway** (collapsing): a request whose input (in the
  policy's ``sharing.scope``) is already queued or running from this gateway
  waits for that request's result instead of taking a slot. It lives in this
  gateway's memory beside its leader, which is in Redis; if the leader fails
  (its client left, its deadline passed), the follower queues on its own.
- **Recently answered** (the cache, ``sharing.cache_ttl_s``): the worker
  keeps each answer under the input's digest and its model's fingerprint;
  the gateway answers a hit without queueing. A Redis failure bypasses it.

Quotas are charged the same for every request, however it is served.
"""

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from infergate.base import logs, wire
from infergate.base.errors import STORE_ERRORS
from infergate.base.queue.gateway import GatewayQueue
from infergate.gateway.api import Parameters
from infergate.policies import KeyEntry, Policy

log = logs.get(__name__)


def scope_owner(scope: str, key: KeyEntry) -> str:
    """Who may share an answer with this key, in the policy's scope."""
    if scope == "key":
        return "key:" + key.id
    return "tier:" + key.tier if scope == "tier" else "shared"


def input_digest(owner: str, text: str) -> str:
    """The input's identity within its scope, for the cache's key."""
    return hashlib.sha256(f"{owner}\0{text}".encode()).hexdigest()


Identity = tuple[str, str]  # (scope owner, input text)


class Collapsing:
    """This gateway's requests in flight, by identity: the first is the
    leader; identical ones that arrive while it waits follow it."""

    def __init__(self) -> None:
        self._leaders: dict[Identity, asyncio.Future[wire.Result]] = {}

    def leading(self, identity: Identity) -> bool:
        return identity in self._leaders

    async def follow(self, identity: Identity, timeout_s: float) -> wire.Result | None:
        """The leader's result (an answer, or a failure of the input itself)
        if one is in flight and ends in time; None otherwise: no leader, or
        it ended without a result (its client left, its deadline passed)."""
        leader = self._leaders.get(identity)
        if leader is None:
            return None
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                return await asyncio.shield(leader)
        except (TimeoutError, LeaderGone):
            return None

    def lead(self, identity: Identity) -> "asyncio.Future[wire.Result]":
        """Become the leader for ``identity`` (if another became it first,
        this one runs on its own, unfollowed); ``end`` must follow."""
        leader: asyncio.Future[wire.Result] = asyncio.get_running_loop().create_future()
        self._leaders.setdefault(identity, leader)
        return leader

    def end(
        self, identity: Identity, leader: "asyncio.Future[wire.Result]", result: wire.Result | None
    ) -> None:
        """Release the followers: with the leader's result (an answer, or a
        failure of the input: INFERENCE_FAILED), or with nothing."""
        if self._leaders.get(identity) is leader:
            del self._leaders[identity]
        if result is not None:
            leader.set_result(result)
        else:
            leader.set_exception(LeaderGone())
            leader.exception()  # retrieved: followers fall back, nobody else cares


class LeaderGone(Exception):
    """The leader ended without a result: its followers queue on their own."""


class Cache:
    """Answers kept in Redis by the workers, read here."""

    def __init__(self, queue: GatewayQueue, on_error: Callable[[], None]) -> None:
        self.queue = queue
        self.on_error = on_error

    async def get(self, key: str, fingerprint: str) -> str | None:
        """The kept answer, or None (a miss, or Redis failing: never an error)."""
        try:
            return await self.queue.cached_answer(key, fingerprint)
        except STORE_ERRORS as exc:
            self.on_error()
            logs.limited(log, "cache.bypassed", error=type(exc).__name__)
            return None


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
    def of(
        cls,
        policy: Policy,
        key: KeyEntry,
        text: str,
        params: Parameters | None,
        conversation: str | None = None,
        cut_to: int = 0,
    ) -> "Share | None":
        """``cut_to``: the output tokens the worker cuts this request's answer
        to, where it reserves them (token limits, budgets): it shares only an
        answer cut the same, never a longer one it did not reserve."""
        sharing = policy.document.sharing
        cache_ttl_ms = round(sharing.cache_ttl_s * 1000)
        if not sharing.collapse and cache_ttl_ms <= 0:
            return None
        owner = scope_owner(sharing.scope, key)
        if params is not None and params.temperature:  # a sample is a draw of its own
            return None
        max_tokens = cut_to or (params.max_tokens if params is not None else None)
        if max_tokens is not None:  # the same answer, cut the same
            owner += f"\nmax_tokens={max_tokens}"
        if conversation is not None:  # (a chat: the same answer for the same messages)
            owner, text = owner + "\nchat", conversation
        digest = input_digest(owner, text) if cache_ttl_ms > 0 else None
        return cls((owner, text), sharing.collapse, cache_ttl_ms, digest)
