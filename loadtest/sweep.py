"""The throughput table: one stack, open-loop load at several rates, and the
CPU each kind of process spent per request.

Starts ``infergate up`` (which starts its own Redis), then for each rate runs
``loadtest.bench`` (a separate process) and reads, from /proc, the CPU time
of the gateways, the dispatchers, the workers, Redis and the load generator
over that run. CPU per request is CPU seconds over requests sent.

    python -m infergate.loadtest.sweep --rates 1000,2000,3000,4000 \
        --workers 8 --gateways 2 --duration 20 --json-out sweep.json

Linux only (/proc). Everything runs on this machine, as the README's table says.
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import redis
from infergate.base.capacity import ROLES, Costs, Measured, fit
from infergate.base.ports import free_port
from infergate.loadtest.bench import DEFAULT_INPUT_CHARS, DEFAULT_MIX
from infergate.policies import load_policy

KINDS = ("gateway", "dispatcher", "worker", "redis", "loadgen")
RATES = "10,1000,2000,3000,4000"  # (req/s: what `make sweep` runs, and fits the costs over)
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def kind_of(pid: int) -> str | None:
    """gateway, dispatcher or worker for a child of ``infergate up``."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if len(argv) > 3 and argv[1:3] == [b"-m", b"infergate"]:
        role = argv[3].decode(errors="replace")
        return role if role in KINDS else None
    return None


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid:
            out.append(int(entry.name))
    return out


def cpu_by_kind(up_pid: int, redis_pid: int) -> dict[str, float]:
    totals = dict.fromkeys(KINDS, 0.0)
    for pid in children(up_pid):
        kind = kind_of(pid)
        if kind is not None:
            totals[kind] += cpu_s(pid)
    totals["redis"] = cpu_s(redis_pid)
    return totals


def redis_calls(port: int) -> int:
    """Commands Redis has run (those inside Lua scripts included), from INFO commandstats."""
    with redis.Redis(port=port) as client:
        stats: dict[str, dict[str, int]] = client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


def redis_of(up_pid: int) -> tuple[int, int]:
    """The pid and port of the redis-server ``up`` started."""
    for pid in children(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # Redis sets its process title: "redis-server 127.0.0.1:PORT".
        found = re.search(rb"redis-server\S*\s+\S*:(\d+)", b" ".join(argv))
        if found:
            return pid, int(found.group(1))
    raise SystemExit("sweep: no redis-server under infergate up (is REDIS_URL set?)")


def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"sweep: the stack at {url} was not ready within {timeout_s:.0f} s")


def run_rate(
    args: argparse.Namespace, url: str, keys_path: str, rate: float, up_pid: int, redis_pid: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="infergate-sweep-") as tmp:
        return _run_rate(args, url, keys_path, rate, up_pid, redis_pid, str(Path(tmp) / "out.json"))


def _run_rate(
    args: argparse.Namespace,
    url: str,
    keys_path: str,
    rate: float,
    up_pid: int,
    redis_pid: int,
    out: str,
) -> dict[str, Any]:
    before = cpu_by_kind(up_pid, redis_pid)
    calls_before = redis_calls(args.redis_port)
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infergate.loadtest.bench",
            "--url",
            url,
            "--keys",
            keys_path,
            "--rate",
            str(rate),
            "--duration",
            str(args.duration),
            "--json-out",
            out,
            "--mix",
            args.mix,
            "--input-chars",
            str(args.input_chars),
            "--route",
            args.route,
        ],
        stdout=subprocess.DEVNULL,
    )
    # The load generator's CPU: read while it runs, its last reading before it exits.
    loadgen = 0.0
    while bench.poll() is None:
        loadgen = max(loadgen, cpu_s(bench.pid))
        time.sleep(0.2)
    after = cpu_by_kind(up_pid, redis_pid)
    calls = redis_calls(args.redis_port) - calls_before
    report: dict[str, Any] = json.loads(Path(out).read_text())
    sent = report["sent"]
    cpu = {k: after[k] - before[k] for k in KINDS if k != "loadgen"}
    cpu["loadgen"] = loadgen
    report["cpu_us_per_request"] = {k: round(v / sent * 1e6, 1) for k, v in cpu.items()}
    report["cpu_cores"] = {k: round(v / report["elapsed_s"], 2) for k, v in cpu.items()}
    report["redis_commands_per_request"] = round(calls / sent, 1)
    return report


def echo_cpu_us(args: argparse.Namespace, rate: float) -> float:
    """A do-nothing echo server's CPU a request at ``rate`` (``echo_server``),
    on the same load generator, run just after the stack's."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "infergate.loadtest.echo_server", "--port", str(port)]
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("sweep: the echo server did not start") from None
                time.sleep(0.1)
        started = cpu_s(server.pid)
        load = ["--url", f"http://127.0.0.1:{port}", "--keys", args.keys, "--rate", str(rate)]
        load += ["--duration", str(args.duration), "--mix", args.mix]
        load += ["--input-chars", str(args.input_chars)]
        bench = [sys.executable, "-m", "infergate.loadtest.bench", *load]
        subprocess.run(bench, stdout=subprocess.DEVNULL, check=True)
        sent = rate * float(args.duration)
        return (cpu_s(server.pid) - started) / sent * 1e6
    finally:
        server.terminate()
        server.wait()


def machine_speed_s() -> float:
    """Seconds this machine takes for a fixed pure-Python loop (best of
    three): the same code's numbers move with it from one sitting to the
    next (a shared host's CPU is not always as fast), so a table says it."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        total = 0
        for i in range(5_000_000):
            total += i
        best = min(best, time.perf_counter() - started)
    return round(best, 3)


def render(report: dict[str, Any]) -> str:
    t = report["tiers"]["all"]
    cpu = report["cpu_us_per_request"]
    return (
        f"{report['rate']:>7.0f} req/s  p50 {t['p50_ms']:>7}  p95 {t['p95_ms']:>7}  "
        f"p99 {t['p99_ms']:>7}  ok {t['success_rate'] * 100:6.2f}%  batch {t['mean_batch']:>5}  "
        "µs/req "
        + " ".join(f"{k} {cpu[k]:.0f}" for k in KINDS)
        + f"  redis cmds/req {report['redis_commands_per_request']}"
        + f"  sender late {report['client_lag_mean_ms']} ms"
    )


class Stack(NamedTuple):
    url: str
    up_pid: int
    redis_pid: int
    redis_port: int


@contextlib.contextmanager
def local_stack(
    python: str,
    workers: int,
    gateways: int,
    latency_ms: int,
    policy: str,
    log_path: str | None = None,
    extra: list[str] | None = None,
) -> Iterator[Stack]:
    """``infergate up`` with its own Redis on a free port, ready (and every
    worker in the fleet view), stopped on the way out."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # up starts its own
    with contextlib.ExitStack() as closing:
        log = closing.enter_context(Path(log_path).open("ab")) if log_path else None
        up = subprocess.Popen(
            [
                python, "-m", "infergate", "up", "--port", str(port),
                "--workers", str(workers), "--gateways", str(gateways),
                "--sim-latency-ms", str(latency_ms), "--policy", policy, *(extra or []),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log or subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_ready(url)
            time.sleep(2.0)  # pacing: every worker's first heartbeat is in the fleet view
            yield Stack(url, up.pid, *redis_of(up.pid))
        finally:
            up.terminate()
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                up.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m infergate.loadtest.sweep", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rates", default=RATES, help="comma-separated req/s")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of sending per rate")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--sim-latency-ms", type=int, default=100)
    here = Path(__file__).resolve().parent  # the link tree points into the checkout
    p.add_argument("--policy", default=str(here / "policy.yaml"))
    p.add_argument("--keys", default=str(here / "keys.json"))
    p.add_argument(
        "--stack-python",
        default=sys.executable,
        help="the Python whose infergate runs the stack (another install, to compare)",
    )
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"tier weights (default {DEFAULT_MIX})")
    p.add_argument(
        "--input-chars",
        type=int,
        default=DEFAULT_INPUT_CHARS,
        help="characters per input (a tier refuses more than its max_input_chars)",
    )
    p.add_argument(
        "--route",
        choices=("inference", "completions", "chat"),
        default="inference",
        help="the route to load: POST /v1/inference or an OpenAI-compatible one",
    )
    p.add_argument(
        "--stack-args",
        default="",
        help="more flags for `infergate up`, e.g. '--backend http:http://127.0.0.1:9100/infer'",
    )
    p.add_argument("--log", default=None, help="append the stack's log lines to this file")
    p.add_argument(
        "--echo",
        action="store_true",
        help="after each rate, a do-nothing echo server's CPU a request at it (the yardstick)",
    )
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--costs-out",
        default=None,
        help="fit each role's costs (idle, per request, per batch) and keep them in this "
        "file, beside those of other input lengths (infergate plan reads it)",
    )
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    speed_s = machine_speed_s()
    print(f"machine: 5M pure-Python additions in {speed_s} s (best of 3)", flush=True)

    reports = []
    with local_stack(
        args.stack_python,
        args.workers,
        args.gateways,
        args.sim_latency_ms,
        args.policy,
        args.log,
        shlex.split(args.stack_args),
    ) as stack:
        url, up_pid, redis_pid, args.redis_port = stack
        for rate in rates:
            report = run_rate(args, url, args.keys, rate, up_pid, redis_pid)
            report["machine_speed_s"] = speed_s
            print(render(report), flush=True)
            if args.echo:
                echo_us = report["echo_cpu_us_per_request"] = round(echo_cpu_us(args, rate), 1)
                cpu = report["cpu_us_per_request"]
                stack_us = sum(cpu[k] for k in KINDS if k != "loadgen")
                print(
                    f"{'':>13}echo server {echo_us:.0f} µs/req: the stack "
                    f"{stack_us / echo_us:.2f}x, the gateways {cpu['gateway'] / echo_us:.2f}x",
                    flush=True,
                )
            reports.append(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(reports, indent=2))
    if args.costs_out:
        write_costs(Path(args.costs_out), measured(args, reports))
    return 0


def measured(args: argparse.Namespace, reports: list[dict[str, Any]]) -> Measured:
    """Each role's fitted costs, from the rates the stack kept up with."""
    if args.sim_latency_ms <= 0:
        raise SystemExit("sweep: --costs-out needs a batch time (--sim-latency-ms) above 0")
    kept = [r for r in reports if r["tiers"]["all"]["success_rate"] >= 0.99]
    if len(kept) < 2:
        raise SystemExit("sweep: --costs-out needs two rates or more that the stack kept up with")
    points = {role: [_point(r, role) for r in kept] for role in ROLES}
    busy = [r for r in kept if r["rate"] >= 100] or kept
    return Measured(
        input_chars=args.input_chars,
        roles={role: fit(points[role]) for role in ROLES},
        loadgen_us=round(sum(r["cpu_us_per_request"]["loadgen"] for r in busy) / len(busy), 1),
        workers=args.workers,
        gateways=args.gateways,
        batch_ms=args.sim_latency_ms,
        max_batch=load_policy(args.policy).document.batching.max_batch_size,
        cores=os.cpu_count() or 1,
    )


def _point(report: dict[str, Any], role: str) -> tuple[float, float, float]:
    """(requests/s, mean batch, cores) of one role in one run."""
    rate = report["sent"] / report["elapsed_s"]
    cores = report["cpu_us_per_request"][role] * rate / 1e6
    answered = report["tiers"]["all"]
    batch = answered["ok"] / answered["batches"] if answered.get("batches") else 1.0
    return rate, batch, cores


def write_costs(path: Path, new: Measured) -> None:
    """Keep ``new`` beside the other input lengths of the file, if they were
    measured on this machine; else the file starts over."""
    machine = this_machine()
    try:
        costs = Costs.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        costs = Costs(machine)
    except (OSError, ValueError, ArithmeticError, RecursionError) as exc:
        print(f"sweep: {path} is not a costs file ({exc}): it starts over", flush=True)
        costs = Costs(machine)
    if costs.machine != machine:
        print(f"sweep: {path} was measured on {costs.machine}: it starts over", flush=True)
        costs = Costs(machine)
    path.write_text(json.dumps(costs.with_measured(new).to_json(), indent=2) + "\n")
    print(f"costs at {new.input_chars} characters written to {path}", flush=True)


def this_machine() -> str:
    """The machine, as a costs file names it: its cores and CPU model."""
    model = os.uname().machine
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores, {model}"


if __name__ == "__main__":
    sys.exit(main())
