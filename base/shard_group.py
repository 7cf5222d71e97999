"""A dispatcher or worker process on a deployment of several Redis shards
runs one of itself per shard, side by side on one event loop: each shard
has its own heartbeats, batches, reaper and recovery, so a shard that is
down stops only its own part. This is what the process shows as one:
its metrics (each member's, labelled with its shard), its probes (alive
while every member is; ready while one is) and its exit code (the worst).
"""

import asyncio
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, Protocol

from infergate.base.probes import Probes
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class Member(Protocol):
    registry: CollectorRegistry

    def probes(self) -> Probes: ...

    def serve(self, stop: asyncio.Event) -> Coroutine[Any, Any, int]: ...


class _Labelled(Collector):
    """The members' metrics in one exposition, each sample with its shard."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for shard, registry in enumerate(self.registries):
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for s in family.samples:
                    labels = {**s.labels, "shard": str(shard)}
                    merged.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        return list(families.values())


class ShardGroup:
    def __init__(self, members: Sequence[Member]) -> None:
        self.members = members
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Labelled([m.registry for m in members]))

    def probes(self) -> Probes:
        probes = [m.probes() for m in self.members]
        return Probes(
            alive=lambda: all(p.alive() for p in probes),
            ready=lambda: any(p.ready() for p in probes),
        )

    async def serve(self, stop: asyncio.Event) -> int:
        codes = await asyncio.gather(*(m.serve(stop) for m in self.members))
        return max(codes)


def one_or_group(members: Sequence[Member]) -> Member:
    """The member itself on a deployment of one shard (nothing changes)."""
    return members[0] if len(members) == 1 else ShardGroup(members)
