"""Where Redis's time goes per request: one stack (``infergate up``, its own
Redis), open-loop load of distinct inputs, then

- Redis's CPU per request (from /proc) and ``INFO commandstats``;
- a second run with SLOWLOG at 0 µs, which times every command, each
  script as a whole (by its SHA-1: admit, take, ...) and the commands inside
  it, so each script's share can be read (the slowlog costs some CPU itself);
- ``redis-benchmark`` INCR (20 clients, no pipelining) on the same Redis:
  Redis's CPU per INCR, the unit that cancels this machine's speed (the
  median of three runs).

``--own-core`` gives Redis a CPU of its own (the last one; the stack, the
load and redis-benchmark share the others), as a deployment runs it: on a
machine of two cores, Redis woken between Python processes on the same core
finds its caches cold, and spends more a request than it would on its own
core (the INCR unit, measured on an idle machine, does not rise with it).

    python -m infergate.loadtest.redis_cost --rate 1000 --input-chars 2000 --workers 4 [--own-core]
"""

import argparse
import collections
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis
from infergate.base.queue.scripts import source
from infergate.loadtest.sweep import Stack, children, cpu_s, local_stack

SCRIPTS = (
    "admit", "fleet", "heartbeats", "take_dispatch", "take_worker", "take_join", "take_withdrawn",
    "offer_credit", "ack_batch", "ensure_credit", "requeue", "retry", "reap", "release_lock", "enqueue_job", "finish_jobs", "charge_usage", "cancel_job", "hand_back",
    "pull_waiting",
)  # fmt: skip
HERE = Path(__file__).resolve().parent
# The unit's runs: one run's figure moved by a third between runs a minute
# apart (how many commands each wake of Redis finds), as much as the stack's.
INCR_RUNS = 3


def bench(args: argparse.Namespace, url: str, duration_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="infergate-redis-cost-") as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run(
            [
                sys.executable, "-m", "infergate.loadtest.bench", "--url", url,
                "--keys", args.keys, "--rate", str(args.rate), "--duration", str(duration_s),
                "--input-chars", str(args.input_chars), "--json-out", str(out),
            ],
            stdout=subprocess.DEVNULL,
            check=True,
        )  # fmt: skip
        report: dict[str, Any] = json.loads(out.read_text())
        return report


def by_command(
    entries: list[dict[str, Any]],
) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """µs and calls per command name, a script by its name."""
    names = {hashlib.sha1(source(n).encode()).hexdigest(): n for n in SCRIPTS}
    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for entry in entries:
        command = entry["command"]
        parts = (
            command.decode(errors="replace") if isinstance(command, bytes) else command
        ).split()
        head = parts[0].upper() if parts else "?"
        if head in ("EVALSHA", "EVAL") and len(parts) > 1:
            head = "script " + names.get(parts[1], parts[1][:8])
        spent[head] += int(entry["duration"])
        calls[head] += 1
    return spent, calls


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (a process or thread that is
    gone is skipped)."""
    with contextlib.suppress(OSError):
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        for task in tasks:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cpus)


def give_redis_a_core(stack: Stack) -> None:
    """Redis alone on the last CPU; this process (and so the load and
    redis-benchmark it starts) and the rest of the stack on the others."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--own-core needs two CPUs at least")
    rest = set(cpus[:-1])
    os.sched_setaffinity(0, rest)
    stack_pids = [stack.up_pid, *children(stack.up_pid)]
    stack_pids += [grandchild for pid in stack_pids[1:] for grandchild in children(pid)]
    for pid in stack_pids:
        if pid != stack.redis_pid:
            pin(pid, rest)
    pin(stack.redis_pid, {cpus[-1]})


def measure(args: argparse.Namespace, url: str, redis_pid: int, client: redis.Redis) -> None:
    bench(args, url, 3.0)  # (warm-up)
    client.config_resetstat()
    before = cpu_s(redis_pid)
    report = bench(args, url, args.duration)
    per_request_us = (cpu_s(redis_pid) - before) / report["sent"] * 1e6
    stats: dict[str, dict[str, float]] = client.info("commandstats")
    sent, every = report["sent"], report["tiers"]["all"]
    print(
        f"{sent} requests at {args.rate:g}/s, {args.input_chars} characters: success "
        f"{every['success_rate']}, p50 {every['p50_ms']} ms, p99 {every['p99_ms']} ms, "
        f"mean batch {every['mean_batch']}"
        + (", Redis on a core of its own" if args.own_core else "")
    )
    calls = sum(v["calls"] for v in stats.values())
    print(f"Redis CPU {per_request_us:.1f} µs a request; {calls / sent:.1f} commands a request")
    for name, v in sorted(stats.items(), key=lambda kv: -kv[1]["usec"])[:12]:
        print(
            f"  {name.removeprefix('cmdstat_'):20s} {v['calls'] / sent:6.2f} a request"
            f" {v['usec'] / sent:7.1f} µs a request {v['usec_per_call']:8.1f} µs a call"
        )
    client.slowlog_reset()
    client.config_set("slowlog-max-len", 400_000)
    client.config_set("slowlog-log-slower-than", 0)
    traced = bench(args, url, min(5.0, args.duration))
    client.config_set("slowlog-log-slower-than", 10_000)
    spent, counted = by_command(client.slowlog_get(400_000))
    client.slowlog_reset()
    print("SLOWLOG (a script's time includes the commands inside it, listed too):")
    for head, us in spent.most_common(12):
        print(
            f"  {head:20s} {counted[head] / traced['sent']:6.2f} a request"
            f" {us / traced['sent']:7.1f} µs a request {us / counted[head]:8.1f} µs a call"
        )
    port = client.connection_pool.connection_kwargs["port"]
    runs = sorted(incr_cost_us(port, redis_pid) for _ in range(INCR_RUNS))
    incr_us = runs[len(runs) // 2]
    shown = ", ".join(f"{us:.2f}" for us in runs)
    print(f"INCR (redis-benchmark, 20 clients): {shown} µs of Redis CPU; the median {incr_us:.2f}")
    print(f"=> {per_request_us / incr_us:.1f} INCR-equivalents a request")


def incr_cost_us(port: int, redis_pid: int) -> float:
    """Redis's CPU per INCR, from 200,000 of them by 20 clients."""
    before = cpu_s(redis_pid)
    subprocess.run(
        ["redis-benchmark", "-p", str(port), "-c", "20", "-n", "200000", "-t", "incr", "-q"],
        stdout=subprocess.DEVNULL,
        check=True,
    )
    return (cpu_s(redis_pid) - before) / 200_000 * 1e6


def stack_arguments(p: argparse.ArgumentParser) -> None:
    """The stack and the load measured (this tool's and admit_replay's)."""
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--input-chars", type=int, default=2000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--policy", default=str(HERE / "policy.yaml"))
    p.add_argument("--keys", default=str(HERE / "keys.json"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infergate.loadtest.redis_cost")
    stack_arguments(p)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--own-core", action="store_true", help="Redis alone on a CPU of its own")
    args = p.parse_args(argv)
    with (
        local_stack(sys.executable, args.workers, args.gateways, 100, args.policy) as stack,
        redis.Redis(port=stack.redis_port) as client,
    ):
        if args.own_core:
            give_redis_a_core(stack)
        measure(args, stack.url, stack.redis_pid, client)
    return 0


if __name__ == "__main__":
    sys.exit(main())
