"""What a request costs a gateway over gRPC, against HTTP, side by side.

One stack (``infergate up`` with ``--grpc-port``), then runs at one rate
taking turns: HTTP through ``bench``, gRPC through an open-loop sender of
the same shape (request i due at ``start + i / rate``, latency from then,
the same tier mix and keys, distinct inputs). Each run's gateway CPU a
request is read from /proc.

    python -m infergate.loadtest.grpc_cost --rate 1000 --duration 15 --runs 2
"""

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import uvloop
from infergate.base.grpc_api import inference_pb2, inference_pb2_grpc
from infergate.base.ports import free_port
from infergate.loadtest.bench import DEFAULT_INPUT_CHARS, DEFAULT_MIX, parse_mix, percentile
from infergate.loadtest.sweep import cpu_by_kind, local_stack, run_rate

HERE = Path(__file__).resolve().parent


async def send_grpc(
    port: int, keys: dict[str, str], rate: float, duration_s: float, input_chars: int, mix: str
) -> dict[str, Any]:
    """Open loop over a few channels: each request sent when due, however
    many are open. Returns how many were sent, answered, and the latencies."""
    weights = parse_mix(mix)
    rng = random.Random(1)
    # (a connection each: channels to one address otherwise share one)
    own = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=own) for _ in range(4)]
    stubs = [inference_pb2_grpc.InferenceStub(c) for c in channels]  # type: ignore[no-untyped-call]
    metadata = {t: (("authorization", "Bearer " + keys[t]),) for t in weights}
    pad = "x" * max(0, input_chars - 20)
    latencies: list[float] = []
    codes: dict[str, int] = {}
    details: dict[str, str] = {}  # (each code's first message)

    async def one(i: int, tier: str, due: float) -> None:
        text = f"grpc-{i}-{tier}-{pad}"
        try:
            answer = await stubs[i % len(stubs)].Infer(
                inference_pb2.InferRequest(input=text), metadata=metadata[tier], timeout=10
            )
            ok = answer.output.endswith(text)
            codes["OK" if ok else "WRONG"] = codes.get("OK" if ok else "WRONG", 0) + 1
            latencies.append((time.perf_counter() - due) * 1000.0)
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
            details.setdefault(exc.code().name, (exc.details() or "")[:120])

    total = int(rate * duration_s)
    tasks = []
    start = time.perf_counter() + 0.05
    for i in range(total):
        due = start + i / rate
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tier = rng.choices(list(weights), list(weights.values()))[0]
        tasks.append(asyncio.ensure_future(one(i, tier, due)))
    await asyncio.gather(*tasks)
    for c in channels:
        await c.close()
    latencies.sort()
    return {
        "sent": total,
        "codes": codes,
        "details": details,
        "p50_ms": round(percentile(latencies, 50), 1),
        "p95_ms": round(percentile(latencies, 95), 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infergate.loadtest.grpc_cost")
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--runs", type=int, default=2, help="turns of each, alternately")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sim-latency-ms", type=int, default=100)
    p.add_argument("--input-chars", type=int, default=DEFAULT_INPUT_CHARS)
    p.add_argument("--mix", default=DEFAULT_MIX)
    p.add_argument("--policy", default=str(HERE / "policy.yaml"))
    p.add_argument("--keys", default=str(HERE / "keys.json"))
    args = p.parse_args(argv)
    keys = json.loads(Path(args.keys).read_text())
    grpc_port = free_port()
    args.route, args.client_timeout_s = "inference", 30.0
    extra = ["--grpc-port", str(grpc_port)]
    with local_stack(
        sys.executable, args.workers, 1, args.sim_latency_ms, args.policy, extra=extra
    ) as stack:
        args.redis_port = stack.redis_port
        for turn in range(args.runs):
            http = run_rate(args, stack.url, args.keys, args.rate, stack.up_pid, stack.redis_pid)
            http_us = http["cpu_us_per_request"]["gateway"]
            print(
                f"turn {turn + 1} HTTP: gateway {http_us} us a request, "
                f"p50 {http['tiers']['all']['p50_ms']} p95 {http['tiers']['all']['p95_ms']} ms, "
                f"success {http['tiers']['all']['success_rate']}",
                flush=True,
            )
            before = cpu_by_kind(stack.up_pid, stack.redis_pid)["gateway"]
            sent = uvloop.run(
                send_grpc(grpc_port, keys, args.rate, args.duration, args.input_chars, args.mix)
            )
            used = cpu_by_kind(stack.up_pid, stack.redis_pid)["gateway"] - before
            print(
                f"turn {turn + 1} gRPC: gateway {used / sent['sent'] * 1e6:.1f} us a request, "
                f"p50 {sent['p50_ms']} p95 {sent['p95_ms']} ms, codes {sent['codes']} {sent['details']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
