"""Autoscaling step benchmark: open-loop load in phases, and a timeline of
what the fleet did, second by second.

Run it against ``infergate up --workers MIN:MAX`` (or any deployment whose
workers follow the signal); it reads the signal the dispatchers keep in
Redis, and counts the workers alive from their heartbeats.

    python -m infergate.loadtest.autoscale --keys loadtest/keys.json \
        --redis-url redis://127.0.0.1:6379/0 --phases 50:10,1500:30,0:60

Each request's latency is measured from its scheduled send time (no
coordinated omission); every 200 must carry its own input's output.
"""

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import aiohttp
import uvloop
from infergate.base.queue.scale_signal import SignalReader
from infergate.loadtest.bench import Sample, one, percentile


def parse_phases(text: str) -> list[tuple[float, float]]:
    """``RATE:SECONDS,...`` -> [(rate, seconds), ...]."""
    out = []
    for part in text.split(","):
        rate, _, seconds = part.partition(":")
        out.append((float(rate), float(seconds)))
    return out


class Timeline:
    """Per-second rows: requests sent that second and how they ended, and
    the fleet as the signal in Redis says it was."""

    def __init__(self) -> None:
        self.samples: dict[int, list[Sample]] = defaultdict(list)
        self.fleet: dict[int, dict[str, Any]] = {}

    def recorder(self, second: int) -> Callable[["asyncio.Task[Sample]"], None]:
        def record(task: "asyncio.Task[Sample]") -> None:
            self.samples[second].append(task.result())

        return record

    def rows(self, budget_ms: float) -> list[dict[str, Any]]:
        rows = []
        for second in sorted(set(self.samples) | set(self.fleet)):
            group = self.samples.get(second, [])
            ok = sorted(s.latency_ms for s in group if s.status == 200)
            rows.append(
                {
                    "t_s": second,
                    "sent": len(group),
                    "ok": len(ok),
                    "refused_503": sum(1 for s in group if s.status == 503),
                    "other_errors": sum(1 for s in group if s.status not in (200, 503)),
                    # (each of them: its status, 0 for none, and its code)
                    "other_codes": sorted(
                        f"{s.status} {s.code}" for s in group if s.status not in (200, 503)
                    ),
                    "wrong_outputs": sum(1 for s in group if s.status == 200 and not s.correct),
                    "p95_ms": round(percentile(ok, 95), 1) if ok else None,
                    "p95_within_budget": bool(ok) and percentile(ok, 95) <= budget_ms,
                    **self.fleet.get(second, {}),
                }
            )
        return rows


async def watch_fleet(
    reader: SignalReader, timeline: Timeline, start: float, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        signal = await asyncio.to_thread(reader.read)
        second = int(time.perf_counter() - start)
        if signal is not None:
            timeline.fleet[second] = {
                "workers": signal.workers,
                "desired": signal.desired_workers,
                "demand_rps": signal.demand_rps,
            }
        await asyncio.sleep(1.0)


async def run(args: argparse.Namespace, keys: dict[str, str]) -> Timeline:
    timeline = Timeline()
    url = args.url.rstrip("/") + "/v1/inference"
    reader = SignalReader(args.redis_url, args.namespace)
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=args.connections)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        start = time.perf_counter()
        watcher = asyncio.create_task(watch_fleet(reader, timeline, start, stop))
        tasks = []
        phase_start, i = start, 0
        for rate, seconds in parse_phases(args.phases):
            n = int(rate * seconds)
            for k in range(n):
                due = phase_start + k / rate
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                text = f"step-{i}-" + "x" * 16
                i += 1
                task = asyncio.create_task(
                    one(session, url, keys[args.tier], args.tier, text, due, None)
                )
                task.add_done_callback(timeline.recorder(int(due - start)))
                tasks.append(task)
            phase_start += seconds
            await asyncio.sleep(max(0.0, phase_start - time.perf_counter()))
        await asyncio.gather(*tasks)
        stop.set()
        await watcher
    reader.close()
    return timeline


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'t_s':>4}{'sent':>6}{'ok':>6}{'503':>5}{'err':>5}{'p95_ms':>8}{'workers':>8}{'desired':>8}{'demand':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['t_s']:>4}{r['sent']:>6}{r['ok']:>6}{r['refused_503']:>5}{r['other_errors']:>5}"
            f"{r['p95_ms'] if r['p95_ms'] is not None else '-':>8}{r.get('workers', '-'):>8}"
            f"{r.get('desired', '-'):>8}{r.get('demand_rps', '-'):>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m infergate.loadtest.autoscale", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--keys", required=True, help="JSON {tier: key}")
    p.add_argument("--tier", default="paid")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--namespace", default="infergate")
    p.add_argument("--phases", default="50:10,1500:30,0:60", help="RATE:SECONDS,...")
    p.add_argument("--budget-ms", type=float, default=1000.0, help="the tier's latency budget")
    p.add_argument("--connections", type=int, default=2000)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    with open(args.keys) as f:
        keys = json.load(f)
    rows = uvloop.run(run(args, keys)).rows(args.budget_ms)
    print(render(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
