"""Open-loop benchmark: a constant arrival rate, whatever the server does.

Request i is due at ``start + i / rate`` and is sent then, however many
earlier requests are still open; its latency is measured from that scheduled
time, so a slow server (or a slow client) cannot hide its queueing
(no coordinated omission). Tiers are drawn with a fixed seed from the mix.

    python -m loadtest.bench --url http://127.0.0.1:8000 --keys keys.json \
        --rate 1000 --duration 20 --json-out bench.json
"""

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp
import msgspec
import uvloop
from infergate.loadtest.http_client import HttpPool, PostTemplate

DEFAULT_MIX = "free=0.70,paid=0.25,enterprise=0.05"
DEFAULT_INPUT_CHARS = 32
TIER_ORDER = ("enterprise", "paid", "free")


_decode = msgspec.json.Decoder(dict[str, Any]).decode


@dataclass
class Sample:
    tier: str
    status: int  # 0: connection error
    latency_ms: float
    batch_size: int = 0
    code: str = ""
    correct: bool = True


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        tier, _, weight = part.partition("=")
        mix[tier.strip()] = float(weight)
    total = sum(mix.values())
    return {t: w / total for t, w in mix.items()}


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(p / 100.0 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


async def one(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    tier: str,
    text: str,
    due: float,
    timeout_ms: int | None,
) -> Sample:
    body: dict[str, Any] = {"input": text}
    if timeout_ms:
        body["timeout_ms"] = timeout_ms
    try:
        async with session.post(url, json=body, headers={"Authorization": "Bearer " + key}) as resp:
            data = await resp.json(content_type=None)
            latency = (time.perf_counter() - due) * 1000.0
            if resp.status == 200:
                return Sample(
                    tier,
                    200,
                    latency,
                    int(data.get("batch_size", 0)),
                    correct=text in data.get("output", ""),
                )
            return Sample(
                tier, resp.status, latency, code=str(data.get("error", {}).get("code", ""))
            )
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        return Sample(tier, 0, (time.perf_counter() - due) * 1000.0, code=type(exc).__name__)


# Each route's path, and its body around a request's text.
ROUTES = {
    "inference": ("/v1/inference", b'{"input":"', b'"}'),
    "completions": ("/v1/completions", b'{"model":"default","prompt":"', b'"}'),
    "chat": (
        "/v1/chat/completions",
        b'{"model":"default","messages":[{"role":"user","content":"',
        b'"}]}',
    ),
}


def _openai_output(data: dict[str, Any]) -> str:
    choice = (data.get("choices") or [{}])[0]
    return str(choice.get("text") or choice.get("message", {}).get("content", ""))


def _listed(keys: str | list[str]) -> list[str]:
    return [keys] if isinstance(keys, str) else keys


async def run(args: argparse.Namespace, keys: dict[str, str | list[str]]) -> dict[str, Any]:
    """Send on schedule through the lean client (``http_client``): each tick
    sends every request already due, so the sender costs one wake-up per
    tick, not one timer per request; latency still counts from each
    request's own due time."""
    mix = parse_mix(args.mix)
    missing = [t for t in mix if t not in keys]
    if missing:
        raise SystemExit(f"bench: no key for tier(s) {missing} in {args.keys}")
    rng = random.Random(args.seed)
    tiers, weights = list(mix), list(mix.values())
    total = int(args.rate * args.duration)
    pool = HttpPool(args.url, args.connections)
    host = f"{pool.host}:{pool.port}"
    path, head, body_end = ROUTES[args.route]
    # A tier's key, or its keys in turn (spread over a deployment's shards).
    posts = {
        t: [
            PostTemplate(
                host, path, {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
            )
            for key in _listed(keys[t])
        ]
        for t in mix
    }
    # The body as bytes around each request's text (plain ASCII: no JSON escaping).
    pad = "x" * max(0, args.input_chars - 20)
    if args.timeout_ms and args.route == "inference":
        body_end = b'","timeout_ms":%d}' % args.timeout_ms
    pending: list[asyncio.Future[tuple[int, bytes]]] = []
    samples: list[Sample] = []
    lags_ms: list[float] = []  # how late each request went out, by the sender's own doing
    start = time.perf_counter() + 0.05
    i = 0
    while i < total:
        now = time.perf_counter()
        while i < total and start + i / args.rate <= now:
            due = start + i / args.rate
            lags_ms.append((now - due) * 1000.0)
            tier = rng.choices(tiers, weights)[0]
            text = f"bench-{i}-{tier}-{pad}"
            post = posts[tier][i % len(posts[tier])]
            reply = pool.request(post.with_body(head + text.encode() + body_end))
            reply.add_done_callback(partial(_record, samples, tier, text, due))
            pending.append(reply)
            i += 1
        if i < total:
            await _until(start + i / args.rate, 1.0 / args.rate)
    sending_s = time.perf_counter() - start
    if pending:
        await asyncio.wait(pending, timeout=args.client_timeout_s)
    for reply in pending:
        reply.cancel()  # still open at the client timeout: recorded as such
    elapsed_s = time.perf_counter() - start
    pool.close()
    return summarize(samples, args, sending_s, elapsed_s, lags_ms)


# The event loop's timers are a millisecond coarse (its wait is rounded up
# to one): a request due mid-tick went out 0.5 to 1 ms late, and that
# lateness was in every latency measured. Where requests are at least this
# far apart, the last stretch is slept in a thread instead (to about 0.1
# ms), while the loop goes on reading replies.
PRECISE_GAP_S = 0.005


async def _until(due: float, gap_s: float) -> None:
    """Wait for ``due`` (perf_counter s); at low rates, to well under a millisecond."""
    left = due - time.perf_counter()
    if gap_s < PRECISE_GAP_S:
        # At least a millisecond: a shorter sleep would spin.
        await asyncio.sleep(max(0.001, left))
        return
    if left > 0.0015:
        await asyncio.sleep(left - 0.0015)  # wakes up to a millisecond later than asked
    left = due - time.perf_counter()
    if left > 0:
        await asyncio.get_running_loop().run_in_executor(None, time.sleep, left)


def _record(
    samples: list[Sample],
    tier: str,
    text: str,
    due: float,
    reply: "asyncio.Future[tuple[int, bytes]]",
) -> None:
    """One request's sample, as its reply arrives (a callback: no task per request)."""
    latency = (time.perf_counter() - due) * 1000.0
    if reply.cancelled():
        samples.append(Sample(tier, 0, latency, code="TimeoutError"))
        return
    exc = reply.exception()
    if exc is not None:
        samples.append(Sample(tier, 0, latency, code=str(exc)))
        return
    status, raw = reply.result()
    try:
        data = _decode(raw)
    except msgspec.DecodeError:
        samples.append(Sample(tier, status, latency, code="unreadable"))
        return
    if status == 200:
        output = data.get("output") or _openai_output(data)
        batch = int(data.get("batch_size", 0))
        samples.append(Sample(tier, 200, latency, batch, correct=text in output))
    else:
        samples.append(
            Sample(tier, status, latency, code=str(data.get("error", {}).get("code", "")))
        )


def summarize(
    samples: list[Sample],
    args: argparse.Namespace,
    sending_s: float,
    elapsed_s: float,
    lags_ms: list[float],
) -> dict[str, Any]:
    by_tier: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_tier[s.tier].append(s)
    by_tier["all"] = list(samples)
    report: dict[str, Any] = {
        "rate": args.rate,
        "duration_s": args.duration,
        "sent": len(samples),
        "sending_s": round(sending_s, 2),
        "elapsed_s": round(elapsed_s, 2),
        "client_lag_mean_ms": round(sum(lags_ms) / len(lags_ms), 2) if lags_ms else 0.0,
        "client_lag_max_ms": round(max(lags_ms, default=0.0), 1),
        "tiers": {},
    }
    for tier in [*TIER_ORDER, "all"]:
        group = by_tier.get(tier)
        if not group:
            continue
        ok = sorted(s.latency_ms for s in group if s.status == 200)
        statuses = Counter(str(s.status) for s in group)
        batch_sizes = [s.batch_size for s in group if s.status == 200]
        report["tiers"][tier] = {
            "sent": len(group),
            "ok": len(ok),
            "success_rate": round(len(ok) / len(group), 4),
            "ok_per_s": round(len(ok) / args.duration, 1),
            "p50_ms": round(percentile(ok, 50), 1),
            "p95_ms": round(percentile(ok, 95), 1),
            "p99_ms": round(percentile(ok, 99), 1),
            "max_ms": round(ok[-1], 1) if ok else None,
            "mean_batch": round(sum(batch_sizes) / len(batch_sizes), 1) if batch_sizes else 0.0,
            # The batches they came in (a batch of n is 1/n of each of its n
            # answers): requests over this is the mean per batch, not per request.
            "batches": round(sum(1 / max(b, 1) for b in batch_sizes), 1),
            "statuses": dict(sorted(statuses.items())),
            "wrong_outputs": sum(1 for s in group if s.status == 200 and not s.correct),
        }
    return report


def render(report: dict[str, Any]) -> str:
    lines = [
        f"open-loop: {report['rate']} req/s for {report['duration_s']} s, {report['sent']} sent "
        f"(sending took {report['sending_s']} s, client lag mean {report['client_lag_mean_ms']} ms, "
        f"max {report['client_lag_max_ms']} ms)",
        f"{'tier':<11}{'sent':>7}{'ok':>7}{'ok/s':>8}{'success':>9}{'p50':>8}{'p95':>8}{'p99':>8}{'max':>8}{'batch':>7}  statuses",
    ]
    for tier, r in report["tiers"].items():
        lines.append(
            f"{tier:<11}{r['sent']:>7}{r['ok']:>7}{r['ok_per_s']:>8}{r['success_rate'] * 100:>8.2f}%"
            f"{r['p50_ms']:>8}{r['p95_ms']:>8}{r['p99_ms']:>8}{r['max_ms'] or '-':>8}{r['mean_batch']:>7}  "
            + " ".join(f"{k}:{v}" for k, v in r["statuses"].items())
        )
    lines.append(
        "latencies in ms from each request's scheduled send time, over successful requests"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--keys",
        required=True,
        help="JSON {tier: key} (as `infergate up --keys-out` writes) or {tier: [key, ...]}",
    )
    p.add_argument("--rate", type=float, default=100.0, help="requests per second")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of sending")
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"tier weights (default {DEFAULT_MIX})")
    p.add_argument("--input-chars", type=int, default=DEFAULT_INPUT_CHARS)
    p.add_argument("--route", choices=sorted(ROUTES), default="inference")
    p.add_argument("--timeout-ms", type=int, default=None, help="timeout_ms sent with each request")
    p.add_argument("--connections", type=int, default=1000, help="client connection pool size")
    p.add_argument("--client-timeout-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    with open(args.keys) as f:
        keys = json.load(f)
    report = uvloop.run(run(args, keys))
    print(render(report))
    print(json.dumps(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
