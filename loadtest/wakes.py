"""Where a stack's CPU goes by process, and how often each wakes: at rest,
or a request at a time (a fast model's batches of one).

A lone request or an idle second costs what its wakes cost (some hundreds
of µs of CPU each on a small machine, whatever the process then does), so
this reads each kind of process's CPU time and voluntary context switches
from /proc, and Redis's commands from ``INFO commandstats``:

    python -m infergate.loadtest.wakes                       # at rest, 20 s
    python -m infergate.loadtest.wakes --rate 200 --sim-latency-ms 1

Linux only (/proc). ``--stack-python`` runs another checkout's stack, for a
before and after in one sitting.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from infergate.loadtest.bench import DEFAULT_INPUT_CHARS, DEFAULT_MIX
from infergate.loadtest.sweep import children, cpu_s, kind_of, local_stack

# Per kind of process: [voluntary context switches, CPU seconds].
Reading = dict[str, list[float]]


def wakes_of(pid: int) -> int:
    """A process's voluntary context switches so far (0 if it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("voluntary_ctxt_switches"):
            return int(line.split()[1])
    return 0


def read(up_pid: int, redis_pid: int) -> Reading:
    totals: Reading = {}
    for pid in children(up_pid):
        kind = "redis" if pid == redis_pid else kind_of(pid)
        if kind is not None:
            held = totals.setdefault(kind, [0.0, 0.0])
            held[0] += wakes_of(pid)
            held[1] += cpu_s(pid)
    return totals


def load(url: str, keys: str, rate: float, duration_s: float) -> int:
    """Requests sent by ``loadtest.bench`` at ``rate`` for ``duration_s``."""
    with tempfile.TemporaryDirectory(prefix="infergate-wakes-") as tmp:
        out = Path(tmp) / "out.json"
        command = [
            sys.executable, "-m", "infergate.loadtest.bench", "--url", url, "--keys", keys,
            "--rate", str(rate), "--duration", str(duration_s), "--json-out", str(out),
            "--mix", DEFAULT_MIX, "--input-chars", str(DEFAULT_INPUT_CHARS),
        ]  # fmt: skip
        subprocess.run(command, stdout=subprocess.DEVNULL, check=True)
        report = json.loads(out.read_text())
    t = report["tiers"]["all"]
    print(f"sent {report['sent']}  p50 {t['p50_ms']} ms  p95 {t['p95_ms']} ms")
    return int(report["sent"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m infergate.loadtest.wakes", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rate", type=float, default=0.0, help="req/s (0: at rest)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds measured")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--sim-latency-ms", type=int, default=1)
    here = Path(__file__).resolve().parent
    p.add_argument("--policy", default=str(here / "policy.yaml"))
    p.add_argument("--keys", default=str(here / "keys.json"))
    p.add_argument("--stack-python", default=sys.executable)
    p.add_argument("--commands", type=int, default=12, help="Redis commands listed")
    args = p.parse_args(argv)
    with local_stack(
        args.stack_python, args.workers, args.gateways, args.sim_latency_ms, args.policy
    ) as stack:
        client = redis.Redis(port=stack.redis_port)
        client.config_resetstat()
        before = read(stack.up_pid, stack.redis_pid)
        if args.rate > 0:
            per, unit = load(stack.url, args.keys, args.rate, args.duration), "a request"
        else:
            time.sleep(args.duration)
            per, unit = int(args.duration), "a second"
        after = read(stack.up_pid, stack.redis_pid)
        stats: dict[str, dict[str, float]] = client.info("commandstats")
    cpu_us = {k: (after[k][1] - before[k][1]) * 1e6 / per for k in after}
    print(f"CPU µs {unit}: {sum(cpu_us.values()):.0f} in all")
    for kind in sorted(after):
        wakes = (after[kind][0] - before[kind][0]) / per
        print(f"  {kind:10s} wakes {wakes:7.2f}  CPU µs {cpu_us[kind]:8.0f}")
    print(f"Redis's commands {unit} (µs of its CPU in them):")
    rows = sorted(stats.items(), key=lambda kv: -float(kv[1]["calls"]))
    for name, v in rows[: args.commands]:
        print(f"  {name.removeprefix('cmdstat_'):24s} {float(v['calls']) / per:7.2f}"
              f"  ({float(v['usec']) / per:6.1f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
