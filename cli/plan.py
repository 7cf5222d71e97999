"""``infergate plan``: the gateways, dispatchers, Redis shards and GPU
workers a target load needs, from the per-role costs ``make sweep`` measured
(``loadtest/costs.json``: base/capacity.py says how they are modelled).

The costs are the machine's they were measured on: a plan is in its cores.
"""

import argparse
import json
import math
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from infergate.base.capacity import Costs, Plan, Target, ceiling, plan


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="size a deployment for a target load from measured costs")
    p.add_argument("--rps", type=_rate, help="average requests per second (up to 1e8)")
    p.add_argument("--peak", type=_peak, default=1.0, help="peak over average (3: 3x; up to 100)")
    p.add_argument("--input-chars", type=_whole, default=2000, help="characters per input")
    p.add_argument(
        "--batch-ms", type=_batch_ms, default=100.0, help="the backend's batch time (1 ms to 1 h)"
    )
    p.add_argument("--max-batch", type=_batch, default=100, help="inputs per batch (1-100)")
    p.add_argument(
        "--utilization",
        type=_share,
        default=0.7,
        help="the most each role may be busy at peak (0.01-1; default 0.7)",
    )
    p.add_argument(
        "--backend-times",
        default=None,
        help="the batch times `infergate backend check --times-out` measured (instead of "
        "--batch-ms and --max-batch)",
    )
    p.add_argument("--costs", default=None, help="a costs file (default: the one shipped)")
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="instead: the rate the measured stack tops out at on the machine it was measured on",
    )


def run(args: argparse.Namespace) -> int:
    try:
        costs = _costs(args.costs)
    except (OSError, ValueError, RecursionError) as exc:
        print(f"infergate plan: {exc}", file=sys.stderr)
        return 2
    if args.ceiling:
        print(_render_ceiling(costs, args.input_chars))
        return 0
    if args.rps is None:
        print("infergate plan: --rps is required (or --ceiling)", file=sys.stderr)
        return 2
    batch_ms, max_batch = args.batch_ms, args.max_batch
    if args.backend_times:
        try:
            batch_ms, max_batch = _backend_times(args.backend_times)
        except (OSError, ValueError) as exc:
            print(f"infergate plan: --backend-times: {exc}", file=sys.stderr)
            return 2
    target = Target(args.rps, args.peak, args.input_chars, batch_ms, max_batch, args.utilization)
    print(_render(costs, target, plan(costs, target)))
    return 0


def _costs(path: str | None) -> Costs:
    if path is None:
        text = resources.files("infergate.loadtest").joinpath("costs.json").read_text("utf-8")
    else:
        with Path(path).open("rb") as f:
            raw = f.read(1 << 20)  # (a costs file is a few KB)
        text = raw.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the costs file is not JSON: {exc}") from None
    return Costs.from_json(data)


def _backend_times(path: str) -> tuple[float, int]:
    """The batch time and size a backend check found best (``--times-out``)."""
    with Path(path).open("rb") as f:
        raw = f.read(1 << 16)
    try:
        data = json.loads(raw)
        batch_ms, max_batch = float(data["full_batch_ms"]), int(data["max_batch"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
        raise ValueError("not the times of `infergate backend check --times-out`") from None
    if not (1 <= batch_ms <= 3_600_000 and 1 <= max_batch <= 100):
        raise ValueError(f"a batch of {max_batch} in {batch_ms:g} ms is out of range")
    return batch_ms, max_batch


def _render(costs: Costs, t: Target, p: Plan) -> str:
    sizes = [str(m.input_chars) for m in costs.measured]
    lengths = sizes[0] if len(sizes) == 1 else ", ".join(sizes[:-1]) + " and " + sizes[-1]
    cores = p.cores_at_peak
    return "\n".join(
        [
            f"{t.rps:g} req/s, peaks x{t.peak:g} ({p.peak_rps:g} req/s), {t.input_chars}-character"
            f" inputs, batches of up to {t.max_batch} taking {t.batch_ms:g} ms,"
            f" every role at most {t.utilization:.0%} busy at peak",
            f"(each role's cost was measured on one machine ({costs.machine}) with inputs of"
            f" {lengths} characters: the cores below are that machine's)",
            "",
            f"  GPU workers      {p.workers:>6}   one GPU each; batches of {p.batch_at_peak:g}"
            f" at peak, {p.batch_at_average:g} at average",
            f"  gateway cores    {p.gateway_cores:>6}   one gateway process a core;"
            f" {cores['gateway']:g} busy at peak",
            f"  dispatchers      {p.dispatchers:>6}   {cores['dispatcher']:g} cores busy at peak,"
            " each serving every shard (run one more: one can die)",
            f"  Redis shards     {p.shards:>6}   one primary each (its scripts run on one"
            f" thread); {cores['redis']:g} cores busy at peak",
            *(
                [
                    "                   (REDIS_URL names them all, separated by spaces: each"
                    " key lives on one; every worker and dispatcher serves them all)"
                ]
                if p.shards > 1
                else []
            ),
            f"  worker host CPU  {math.ceil(p.worker_host_cores):>6}   cores beside the GPUs;"
            f" {cores['worker']:g} busy at peak",
        ]
    )


def _render_ceiling(costs: Costs, input_chars: int) -> str:
    m = min(costs.measured, key=lambda x: abs(x.input_chars - input_chars))
    top = ceiling(costs, input_chars)
    return (
        f"{top:.0f} req/s: where the stack measured ({m.gateways} gateways, {m.workers} workers"
        f" of {m.batch_ms:g} ms batches, the load generator beside them) uses every core"
        f" of the machine it was measured on ({costs.machine}), at {input_chars}-character inputs"
    )


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _within(text: str, low: float, high: float, low_open: bool = False) -> float:
    value = _number(text)
    if not (low < value if low_open else low <= value) or value > high:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be {'above' if low_open else 'from'} {low:g} {'and at most' if low_open else 'to'} {high:g}"
        )
    return value


def _rate(text: str) -> float:
    return _within(text, 0, 1e8, low_open=True)


def _peak(text: str) -> float:
    return _within(text, 1, 100)


def _batch_ms(text: str) -> float:
    return _within(text, 1, 3_600_000)


def _share(text: str) -> float:
    return _within(text, 0.01, 1)


def _whole(text: str) -> int:
    value = _number(text)
    if value != int(value) or value < 1 or value > 10_000_000:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number from 1 to 10000000")
    return int(value)


def _batch(text: str) -> int:
    value = _whole(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f"{text!r}: the backend takes at most 100 inputs a batch")
    return value
