"""Fairness under overload: issue #26's measurements, each scenario on its own
local stack (``infergate up``, with a policy derived from loadtest/policy.yaml
written to a temporary folder), stopped with its Redis at the end.

  burst      2 workers: 400 distinct requests of all tiers at once, 3 times
  overload   1 worker, batches of 10: free 300 + enterprise 20 req/s (Poisson), 12 s
  neighbour  the same fleet, two paid keys: A 250 + B 25 req/s, then A 250 + B 90
  quota      one key at "10/second" offered 150 req/s: most 200s sent within 1 s

    python -m infergate.loadtest.fairness overload --json-out overload.json \
        [--stack-python /tmp/base/.venv/bin/python]   # another checkout's stack
"""

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import uvloop
import yaml
from infergate.base.ports import free_port
from infergate.loadtest.bench import _until, percentile
from infergate.loadtest.http_client import HttpPool, PostTemplate
from infergate.loadtest.sweep import children, wait_ready

HERE = Path(__file__).resolve().parent
KEYS: dict[str, str] = json.loads((HERE / "keys.json").read_text())
SCENARIOS = ("burst", "overload", "neighbour", "quota")
_decode = msgspec.json.Decoder(dict[str, Any]).decode


@dataclass
class Stream:
    group: str  # what the report groups by: a tier or a key's name
    secret: str
    rate: float = 0.0


@dataclass
class Sample:
    group: str
    status: int  # 0: no answer (connection error or client timeout)
    code: str
    sent_at: float  # perf_counter when written
    latency_ms: float  # from its scheduled send time
    correct: bool = True


def write_policy(
    path: Path, stack_python: str, max_batch: int, extra: dict[str, tuple[str, list[str]]]
) -> dict[str, str]:
    """loadtest/policy.yaml with batches of ``max_batch`` and the ``extra`` keys
    ({name: (tier, rate_limits)}) plus an admin key; returns {name: secret}.
    Fields the stack's code does not know are dropped (an older checkout)."""
    doc = yaml.safe_load((HERE / "policy.yaml").read_text())
    doc["batching"]["max_batch_size"] = max_batch
    doc.setdefault("limits", {})["key_connection_share"] = 1.0
    made = {name: f"fair-{name}-{secrets.token_urlsafe(16)}" for name in [*extra, "admin"]}
    extra = {**extra, "admin": ("enterprise", ["100000/second"])}
    for name, (tier, rates) in extra.items():
        digest = hashlib.sha256(made[name].encode()).hexdigest()
        entry = {"id": f"fair-{name}", "tier": tier, "sha256": digest, "rate_limits": list(rates)}
        doc["keys"].append({**entry, "admin": True} if name == "admin" else entry)
    cmd = [stack_python, "-m", "infergate", "policy", "check", str(path)]
    for _ in range(10):
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        check = subprocess.run(cmd, capture_output=True, text=True, env=stack_env())
        if check.returncode == 0:
            return made
        said = check.stdout + check.stderr
        found = re.search(r"(\w+)\.(\w+): Object contains unknown field", said)
        if not found or found.group(2) not in doc.get(found.group(1), {}):
            raise SystemExit(f"fairness: the policy is invalid for {stack_python}:\n{said}")
        print(f"(the stack does not know {found.group(1)}.{found.group(2)}: dropped)")
        del doc[found.group(1)][found.group(2)]
    raise SystemExit("fairness: policy still invalid")


def stack_env() -> dict[str, str]:
    """The stack starts its own Redis, and runs its interpreter's install."""
    return {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "PYTHONPATH")}


@contextmanager
def stack(args: argparse.Namespace, policy: Path, workers: int, log: Path) -> Iterator[str]:
    """A running stack's URL; on the way out (error and Ctrl-C included) it
    is stopped, and any child of it still alive after that is killed."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["up", "--port", str(port), "--workers", str(workers), "--policy", str(policy)]
    argv += ["--gateways", str(args.gateways), "--sim-latency-ms", str(args.sim_latency_ms)]
    with log.open("ab") as out:
        up = subprocess.Popen(
            [args.stack_python, "-m", "infergate", *argv],
            env=stack_env(),
            stdout=out,
            stderr=out,
            start_new_session=True,  # a Ctrl-C reaches this script alone; it stops the stack
        )
    kids: set[int] = set()
    try:
        wait_ready(url)
        kids.update(children(up.pid))
        time.sleep(2.0)  # every worker's first heartbeat is in the fleet view
        yield url
    finally:
        kids.update(children(up.pid))
        up.terminate()
        try:
            up.wait(45)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        for pid in kids:
            try:
                if re.search(rb"infergate|redis", Path(f"/proc/{pid}/cmdline").read_bytes()):
                    os.kill(pid, signal.SIGKILL)
                    print(f"fairness: killed {pid}, left running by the stack", file=sys.stderr)
            except OSError:
                pass


def poisson(streams: list[Stream], duration_s: float, seed: int) -> list[tuple[float, Stream]]:
    """Each stream's Poisson arrivals over ``duration_s``, merged in time order."""
    rng = random.Random(seed)
    out: list[tuple[float, Stream]] = []
    for s in streams:
        t = rng.expovariate(s.rate)
        while t < duration_s:
            out.append((t, s))
            t += rng.expovariate(s.rate)
    return sorted(out, key=lambda x: x[0])


async def send(url: str, label: str, schedule: list[tuple[float, Stream]]) -> list[Sample]:
    """Open loop: each request goes out at its time (offset from now), on a
    connection of its own while the others are busy; every input is distinct."""
    pool = HttpPool(url, max(1000, len(schedule)))
    host = f"{pool.host}:{pool.port}"
    heads = {s.secret: PostTemplate(host, "/v1/inference", _headers(s.secret)) for _, s in schedule}
    token = secrets.token_hex(4)
    samples: list[Sample] = []
    pending = []
    start = time.perf_counter() + 0.05
    for i, (offset, s) in enumerate(schedule):
        due = start + offset
        if due > time.perf_counter():
            await _until(due, offset - schedule[i - 1][0] if i else 1.0)
        text = f"{label}-{s.group}-{i}-{token}"
        body = msgspec.json.encode({"input": text})
        reply = pool.request(heads[s.secret].with_body(body))
        reply.add_done_callback(partial(_record, samples, s.group, text, due, time.perf_counter()))
        pending.append(reply)
    await asyncio.wait(pending, timeout=30.0)
    for reply in pending:
        reply.cancel()  # unanswered at the client timeout: recorded as status 0
    pool.close()
    return samples


def _headers(secret: str) -> dict[str, str]:
    return {"Authorization": "Bearer " + secret, "Content-Type": "application/json"}


def _record(
    samples: list[Sample], group: str, text: str, due: float, sent_at: float, reply: Any
) -> None:
    latency_ms = (time.perf_counter() - due) * 1000.0
    if reply.cancelled() or reply.exception() is not None:
        code = "client-timeout" if reply.cancelled() else str(reply.exception())
        samples.append(Sample(group, 0, code, sent_at, latency_ms))
        return
    status, raw = reply.result()
    try:
        data = _decode(raw)
    except msgspec.DecodeError:
        samples.append(Sample(group, status, "unreadable", sent_at, latency_ms))
        return
    if status == 200:  # the simulated backend's output for exactly this input
        # (the simulated backend answers "sim[<crc32>]: <input>": the input is its own)
        ok = str(data.get("output", "")).endswith("]: " + text)
        samples.append(Sample(group, 200, "", sent_at, latency_ms, ok))
    else:
        code = str((data.get("error") or {}).get("code", ""))
        samples.append(Sample(group, status, code, sent_at, latency_ms))


def summarize(samples: list[Sample], duration_s: float | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for group in dict.fromkeys(s.group for s in samples):
        mine = [s for s in samples if s.group == group]
        ok = sorted(s.latency_ms for s in mine if s.status == 200)
        out[group] = {
            "sent": len(mine),
            "ok": len(ok),
            "ok_pct": round(100.0 * len(ok) / len(mine), 1),
            "refused": sum(1 for s in mine if s.status in (429, 503)),
            "statuses": dict(Counter(f"{s.status} {s.code}".strip() for s in mine).most_common()),
            "p50_ms": round(percentile(ok, 50), 1),
            "p95_ms": round(percentile(ok, 95), 1),
            "p99_ms": round(percentile(ok, 99), 1),
            "max_ms": round(ok[-1], 1) if ok else None,
            "wrong_outputs": sum(1 for s in mine if s.status == 200 and not s.correct),
        }
        if duration_s:
            out[group]["goodput_rps"] = round(len(ok) / duration_s, 1)
    return out


def render(title: str, groups: dict[str, dict[str, Any]]) -> str:
    lines = [f"{title}", f"  {'group':<11}{'sent':>6}{'200':>6}{'ok%':>7}{'refused':>8}"]
    lines[1] += f"{'p50':>8}{'p95':>8}{'p99':>8}{'max':>8}{'good/s':>8}{'wrong':>6}  statuses"
    for g, r in groups.items():
        lines.append(
            f"  {g:<11}{r['sent']:>6}{r['ok']:>6}{r['ok_pct']:>7}{r['refused']:>8}"
            f"{r['p50_ms']:>8}{r['p95_ms']:>8}{r['p99_ms']:>8}{r['max_ms'] or '-':>8}"
            f"{r.get('goodput_rps', '-'):>8}{r['wrong_outputs']:>6}  "
            + ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
        )
    return "\n".join(lines)


def max_in_one_second(samples: list[Sample]) -> int:
    """The most answered (200) requests whose send times fall within any 1 s span."""
    times = sorted(s.sent_at for s in samples if s.status == 200)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= 1.0:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def fleet_capacity(url: str, admin: str) -> dict[str, Any]:
    """The workers' measured capacity and admission's planned one (/v1/status)."""
    req = urllib.request.Request(url + "/v1/status", headers=_headers(admin))
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            status = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}
    workers = status.get("workers", [])
    return {
        "measured_rps": round(sum(w.get("capacity_rps", 0.0) for w in workers), 1),
        "batch_ms": [w.get("batch_ms") for w in workers],
        "planned_rps": status.get("capacity_rps"),
    }


def run_scenario(args: argparse.Namespace, name: str, tmp: Path) -> dict[str, Any]:
    one_worker = name in ("overload", "neighbour")
    high = ["100000/second"]
    extra = {
        "neighbour": {"A": ("paid", high), "B": ("paid", high)},
        "quota": {"Q": ("paid", ["10/second"])},
    }
    policy = tmp / f"{name}-policy.yaml"
    made = write_policy(policy, args.stack_python, 10 if one_worker else 100, extra.get(name, {}))
    keys = {**KEYS, **made}
    log = Path(args.log) if args.log else tmp / f"{name}-stack.log"
    log_from = log.stat().st_size if log.exists() else 0
    result: dict[str, Any] = {"scenario": name, "stack_python": args.stack_python, "runs": []}

    def phase(url: str, label: str, rates: dict[str, float], duration_s: float) -> list[Sample]:
        schedule = poisson([Stream(g, keys[g], r) for g, r in rates.items()], duration_s, args.seed)
        samples = uvloop.run(send(url, label, schedule))
        groups = summarize(samples, duration_s)
        result["runs"].append({"phase": label, "offered_rps": rates, "groups": groups})
        offered = ", ".join(f"{g} {r:g}/s" for g, r in rates.items())
        print(render(f"{label}: {offered}, Poisson, {duration_s:g} s", groups), flush=True)
        return samples

    with stack(args, policy, 1 if one_worker else 2, log) as url:
        if name == "burst":
            tiers = ("enterprise", "paid", "free")
            for rep in range(1, 4):
                schedule = [(0.0, Stream(tiers[i % 3], KEYS[tiers[i % 3]])) for i in range(400)]
                groups = summarize(uvloop.run(send(url, f"burst{rep}", schedule)), None)
                result["runs"].append({"phase": f"burst{rep}", "groups": groups})
                print(render(f"burst {rep}: 400 at once, a third of each tier", groups), flush=True)
                if rep < 3:
                    time.sleep(2.0)
        elif name == "overload":
            phase(url, "overload", {"enterprise": 20.0, "free": 300.0}, args.duration)
            fleet = result["capacity"] = fleet_capacity(url, made["admin"])
            good = sum(g["goodput_rps"] for g in result["runs"][0]["groups"].values())
            measured, batch_ms = fleet.get("measured_rps"), fleet.get("batch_ms")
            print(f"  goodput {good:.1f} req/s; measured capacity {measured} req/s", end="")
            print(f" (batch {batch_ms} ms), admission plans for {fleet.get('planned_rps')}")
        elif name == "neighbour":
            phase(url, "neighbour", {"A": 250.0, "B": 25.0}, args.duration)
            time.sleep(2.0)
            phase(url, "neighbour2", {"A": 250.0, "B": 90.0}, args.duration)
        else:
            samples = phase(url, "quota", {"Q": 150.0}, 5.0)
            result["max_200_in_1s"] = max_in_one_second(samples)
            print(f"  most 200s sent within any 1 s: {result['max_200_in_1s']} (key: 10/second)")
    result["stack_log"] = log_summary(log, log_from)
    print(f"  stack log: {result['stack_log'] or 'no warnings or errors'}", flush=True)
    return result


def log_summary(log: Path, start: int) -> dict[str, int]:
    """Warning and error events in the stack's log (from byte ``start``) by
    name, and lines that are not JSON (a traceback). Lines that processes
    wrote at once may share a line: each event in it is counted."""
    found: Counter[str] = Counter()
    with log.open("rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    for line in lines:
        if not line.strip() or line.startswith("infergate up: ready"):
            continue
        if not line.startswith("{"):
            found["(not JSON) " + line[:100]] += 1
        for event in re.findall(r"\{[^{}]*\}", line):
            level = re.search(r'"level":\s*"(warning|error|critical)"', event)
            name = re.search(r'"event":\s*"([^"]*)"', event)
            if level:
                found[f"{level.group(1)} {name.group(1) if name else '?'}"] += 1
    return dict(found.most_common())


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM ends this script as Ctrl-C does: through the finally that stops the stack."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m infergate.loadtest.fairness", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("scenario", nargs="+", choices=[*SCENARIOS, "all"])
    p.add_argument("--stack-python", default=sys.executable, help="the stack's Python")
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--sim-latency-ms", type=int, default=100)
    p.add_argument("--duration", type=float, default=12.0, help="s of overload and neighbour")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log", default=None, help="append the stack's log here (default: temp)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    names = SCENARIOS if "all" in args.scenario else tuple(dict.fromkeys(args.scenario))
    results = []
    with tempfile.TemporaryDirectory(prefix="infergate-fairness-") as tmp:
        for name in names:
            results.append(run_scenario(args, name, Path(tmp)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
