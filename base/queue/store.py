"""The Redis side of the queue layer: one client per process, and what every
role shares (heartbeats, members and the fleet's state).

A request lives in exactly one place at a time: ``queue:{tier}`` ->
``inflight:{dispatcher}`` -> ``batches`` -> ``processing:{worker}`` ->
answered. Each move is one atomic Redis operation (a Lua script or BLMOVE);
nothing newer than Redis 6.2 is used. Every Redis command of infergate is in
this package: each role reaches Redis through its own face
(``GatewayQueue``, ``DispatcherQueue``, ``WorkerQueue``, ``RecoveryQueue``),
each built on one ``Store``.
"""

from collections.abc import Iterable
from typing import Any

import msgspec
from infergate.base import logs, wire
from infergate.base.errors import out_of_memory
from infergate.base.keys import Keys
from infergate.base.queue import redis_url
from infergate.base.queue.admits import Admits
from infergate.base.queue.blocking import Blocking
from infergate.base.queue.pipelined import Pipelined
from infergate.base.queue.scripts import Scripts
from infergate.base.queue.settlements import Settlements
from infergate.base.tiers import ROLES, TIERS
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

log = logs.get(__name__)


def connect(
    url: str, *, block_s: float = 0.0, name: str | None = None, max_connections: int = 32
) -> Redis:
    """A client for one process. ``block_s`` is the longest blocking pop it
    will issue; the socket timeout leaves room for it, so a dead Redis is
    noticed instead of hanging. Under a burst, commands wait (up to 2 s) for
    one of ``max_connections`` connections instead of failing."""
    return redis_url.async_client(
        url,
        max_connections=max_connections,
        timeout=2.0,
        socket_connect_timeout=1.0,
        socket_timeout=block_s + 2.0,
        client_name=name,
        # No automatic re-send: a script whose reply was lost may have run, and
        # running take, enqueue or a quota charge twice is not harmless. Callers
        # answer 503, or recover what they may hold and back off themselves.
        retry=Retry(NoBackoff(), retries=0),
    )


class FleetSnapshot(msgspec.Struct, frozen=True):
    """The workers alive and the queue depth of each tier, at ``taken_ms``."""

    workers: list[wire.Heartbeat]
    queue_depth: dict[str, int]
    taken_ms: int
    # The live gateways' heartbeats: what each admitted, per tier (arrival rates).
    gateways: list[wire.Heartbeat] = []


class FleetStatus(msgspec.Struct, frozen=True):
    """Everything an operator's status page shows, read in two round trips."""

    alive: dict[str, list[wire.Heartbeat]]
    queue_depth: dict[str, int]
    counters: dict[str, int]


class Store:
    """One process's Redis client, key names and registered scripts."""

    def __init__(self, redis: Redis, keys: Keys, shared: "Store | None" = None) -> None:
        self.redis = redis
        self.keys = keys
        self.scripts: Scripts = Scripts(redis) if shared is None else shared.scripts
        # The hot path's script calls, sent together (see pipelined.py).
        self.pipelined: Pipelined = Pipelined(redis) if shared is None else shared.pipelined
        # Blocking pops, on a connection of their own (see blocking.py).
        self.blocking: Blocking = Blocking(redis) if shared is None else shared.blocking
        # A gateway's admits, gathered into calls (see admits.py).
        self.admits: Admits = (
            Admits(self.pipelined, self.scripts.admit) if shared is None else shared.admits
        )
        self.settlements: Settlements = (
            Settlements(self.scripts.settle) if shared is None else shared.settlements
        )
        self._unreadable_seen: set[str] = set()
        # Redis refuses writes for want of memory (``maxmemory``): set by
        # whatever saw it, cleared by the next heartbeat Redis takes whole;
        # one state for the stores of every model (one Redis).
        self._redis_state: list[bool] = [False] if shared is None else shared._redis_state

    @property
    def full(self) -> bool:
        return self._redis_state[0]

    @full.setter
    def full(self, value: bool) -> None:
        self._redis_state[0] = value

    def saw_full(self) -> None:
        if not self.full:
            log.error(
                "redis.out_of_memory",
                note="Redis refuses writes (maxmemory reached): new work is refused until it frees",
            )
        self.full = True

    @classmethod
    def connect(
        cls, url: str, namespace: str, *, block_s: float = 0.0, name: str, model: str = "default"
    ) -> "Store":
        return cls(connect(url, block_s=block_s, name=name), Keys(namespace, model))

    def of_model(self, model: str) -> "Store":
        """The same client, scripts and pipeline, under another model's keys
        (a gateway's store for each model it serves). Only the first store
        closes the client."""
        return (
            self if model == self.keys.model else Store(self.redis, self.keys.of_model(model), self)
        )

    async def close(self) -> None:
        await self.admits.close()
        await self.pipelined.close()
        await self.blocking.close()
        await self.redis.aclose()

    async def move_oldest(self, source: str, destination: str, timeout_s: float) -> bytes | None:
        """BLMOVE: block up to ``timeout_s`` for the oldest item of ``source``
        (lists are pushed on the left) and move it atomically to ``destination``."""
        item: bytes | None = await self.blocking.pop(
            ("BLMOVE", source, destination, "RIGHT", "LEFT", timeout_s), timeout_s
        )
        return item

    async def pop_first(self, key: str, timeout_s: float) -> bytes | None:
        """BLPOP on one list: its first item, or None after ``timeout_s``."""
        popped: list[bytes] | None = await self.blocking.pop(("BLPOP", key, timeout_s), timeout_s)
        return None if popped is None else popped[1]

    # -- heartbeats and members ---------------------------------------------

    async def beat(self, hb: wire.Heartbeat, ttl_ms: int) -> None:
        """Write the heartbeat. A Redis out of memory refuses it: the key's
        TTL is extended instead (PEXPIRE takes no memory), so the process
        stays alive in the fleet's view, with its last beat's contents."""
        key = self.keys.heartbeat(hb.role, hb.id)
        try:
            await self.commands(
                ("SET", key, wire.encode(hb), "PX", ttl_ms),
                ("SADD", self.keys.members(hb.role), hb.id),
            )
        except RedisError as exc:
            if not out_of_memory(exc):
                raise
            self.saw_full()
            if not await self.redis.pexpire(key, ttl_ms):
                raise  # (its key had expired already: the reaper's now)
            return
        if self.full:
            self.full = False
            log.info("redis.memory_recovered")

    async def memory_use(self) -> float | None:
        """Redis's used memory over its ``maxmemory``, from ``INFO memory``
        (None: it has no maxmemory, or evicts to stay under it)."""
        (info,) = await self.commands(("INFO", "memory"))
        return memory_use_of(info)

    async def commands(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Plain commands with the hot path's calls (``pipelined``): their
        replies, or the first error among them raised (the others ran).
        The loops that run at rest too use this, not redis-py, whose pool,
        lock and hooks cost a process more than Redis spends on the command."""
        replies = await self.pipelined.commands(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def set_expiring(self, key: str, value: bytes, ttl_ms: int) -> None:
        """SET with a TTL (a loop's write every second, at rest too)."""
        await self.commands(("SET", key, value, "PX", ttl_ms))

    async def retire(self, role: str, process_id: str, keep_membership: bool = False) -> None:
        """A clean exit: drop the heartbeat and the membership at once. With
        ``keep_membership``, only the heartbeat: the reaper then finds the
        process dead at its next sweep and recovers what it left. Sent on
        the beats' connection, after any beat already sent (a beat whose
        caller was stopped still goes): none is written after it."""
        commands: list[tuple[Any, ...]] = [("DEL", self.keys.heartbeat(role, process_id))]
        if not keep_membership:
            commands.append(("SREM", self.keys.members(role), process_id))
        await self.commands(*commands)

    async def heartbeats(
        self, roles: Iterable[str], *, with_depths: bool = False, with_counters: bool = False
    ) -> tuple[dict[str, dict[str, bytes | None]], list[Any]]:
        """Every registered process of ``roles`` and its heartbeat value (None
        once it expired), plus the queue depths and counters if asked: one
        round trip whatever the fleet size (``heartbeats.lua``; the depths
        and counters, an admin's status, another). Returns (beats, extras)."""
        roles = list(roles)
        extras = await self._extras(with_depths, with_counters)
        keys, args = self.beats_named(roles)
        reply = await self.pipelined.call(self.scripts.heartbeats, keys, args)
        return await self.beats_of(roles, reply), extras

    def beats_named(self, roles: list[str]) -> tuple[list[str], list[str]]:
        """The keys and arguments of a read of ``roles``' heartbeats
        (``beats.lua``): each role's members set, and its heartbeats' key prefix."""
        return [self.keys.members(r) for r in roles], [self.keys.heartbeat(r, "") for r in roles]

    async def beats_of(
        self, roles: list[str], reply: list[Any]
    ) -> dict[str, dict[str, bytes | None]]:
        """Each role's processes and their heartbeats from a ``beats.lua``
        reply ({ids, beats} a role). A member that is no process id (planted)
        goes, so no one reads it again."""
        beats = {}
        for role, members, values in zip(roles, reply[0::2], reply[1::2], strict=True):
            ids, planted = process_ids(members)
            by_member = dict(zip(members, values, strict=True))
            beats[role] = {i: by_member[i.encode()] for i in ids}
            if planted:
                await self.redis.srem(self.keys.members(role), *planted)
                log.warning("fleet.member_unreadable", role=role, count=len(planted))
        return beats

    async def _extras(self, with_depths: bool, with_counters: bool) -> list[Any]:
        """Each tier's queue and fair-queue depth, then the counters, as asked."""
        reads: list[tuple[Any, ...]] = []
        if with_depths:
            reads += [("LLEN", q) for q in self.keys.queues]
            reads += [("ZCARD", q) for q in self.keys.fair_queues]
        if with_counters:
            reads.append(("HGETALL", self.keys.stats))
        if not reads:
            return []
        results = await self.pipelined.commands(reads)
        ndepths = 2 * len(TIERS) if with_depths else 0
        for i, result in enumerate(results):
            if isinstance(result, Exception):
                if i >= ndepths or not isinstance(result, ResponseError):
                    raise result
                results[i] = 0  # (a queue of another type, planted: take_*.lua drops it)
        if with_counters:
            results[-1] = _hash(results[-1])
        return results

    def readable(self, role: str, beats: dict[str, bytes | None]) -> list[wire.Heartbeat]:
        """The live heartbeats that decode; an unreadable one is skipped (and
        logged once per process id): one bad key must not blind the fleet."""
        out = []
        for process_id, value in beats.items():
            if value is None:
                continue
            try:
                hb = wire.decode_heartbeat(value)
            except msgspec.DecodeError:
                if process_id not in self._unreadable_seen and len(self._unreadable_seen) < 1000:
                    self._unreadable_seen.add(process_id)
                    log.warning("fleet.heartbeat_unreadable", role=role, process_id=process_id[:64])
                continue
            out.append(hb)
        return out

    async def alive(self, role: str) -> list[wire.Heartbeat]:
        beats, _ = await self.heartbeats([role])
        return self.readable(role, beats[role])

    # -- the fleet's state -------------------------------------------------

    async def fleet_snapshot(self, now_ms: int) -> FleetSnapshot:
        """The workers and the queue depths, read in one step (``fleet.lua``),
        sent with the hot path's calls (``pipelined``): admission reads this
        every few tens of ms on every gateway."""
        keys = self.keys
        ids, values, depths, gateway_ids, gateway_values = await self.pipelined.call(
            self.scripts.fleet,
            [keys.members("worker"), keys.members("gateway"), *keys.queues, *keys.fair_queues],
            [keys.heartbeat("worker", ""), keys.heartbeat("gateway", "")],
        )
        beats = {i.decode(errors="replace"): v for i, v in zip(ids, values, strict=True)}
        gateways = {
            i.decode(errors="replace"): v for i, v in zip(gateway_ids, gateway_values, strict=True)
        }
        return FleetSnapshot(
            self.readable("worker", beats),
            _depths(depths),
            now_ms,
            self.readable("gateway", gateways),
        )

    async def fleet_status(self) -> FleetStatus:
        beats, extras = await self.heartbeats(ROLES, with_depths=True, with_counters=True)
        *lengths, raw_counters = extras
        ntiers = len(TIERS)
        depths = [a + b for a, b in zip(lengths[:ntiers], lengths[ntiers:], strict=True)]
        return FleetStatus(
            {role: self.readable(role, beats[role]) for role in ROLES},
            _depths(depths),
            _counters(raw_counters),
        )


def memory_use_of(info: bytes) -> float | None:
    """``used_memory`` over ``maxmemory`` in an ``INFO memory`` reply, where
    Redis refuses writes at maxmemory (``noeviction``); None where it has no
    maxmemory, evicts to stay under it (its use sits near 1 by design), or
    a field is missing or unreadable."""
    fields: dict[bytes, bytes] = {}
    for line in info.splitlines():
        name, _, value = line.partition(b":")
        if name in (b"used_memory", b"maxmemory", b"maxmemory_policy"):
            fields[name] = value.strip()
    if fields.get(b"maxmemory_policy") != b"noeviction":
        return None
    try:
        used, most = int(fields[b"used_memory"]), int(fields[b"maxmemory"])
    except (KeyError, ValueError):
        return None
    return used / most if most > 0 and used >= 0 else None


def _hash(reply: Any) -> Any:
    """HGETALL's reply as redis-py gives it (a dict), whichever protocol
    the connection speaks (RESP2 sends a flat list)."""
    if isinstance(reply, list):
        return dict(zip(reply[::2], reply[1::2], strict=True))
    return reply


def process_ids(members: Iterable[bytes]) -> tuple[list[str], list[bytes]]:
    """The process ids among a set's members (sorted), and the members that
    are not one: a process's id is ASCII, so one that is not UTF-8 was
    planted in Redis (and would raise wherever it was decoded)."""
    ids, planted = [], []
    for member in members:
        try:
            ids.append(member.decode())
        except UnicodeDecodeError:
            planted.append(member)
    return sorted(ids), planted


def _depths(values: list[Any]) -> dict[str, int]:
    return dict(zip(TIERS, map(int, values), strict=True))


def _counters(raw: dict[bytes, bytes]) -> dict[str, int]:
    out = {}
    for k, v in raw.items():
        try:
            out[k.decode()] = int(v)
        except ValueError:
            continue  # not one of ours: every counter is an integer
    return out
