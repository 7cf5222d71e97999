"""The capacity model checked against this machine: fit the costs (a sweep
at rates well below the ceiling), predict where the same stack fills every
core (``infergate plan --ceiling``), then run it at and around that rate at
once, in the same sitting, and say where its p99 crosses the design's
500 ms.

    python -m infergate.loadtest.plan_check --input-chars 2000
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from infergate.base.capacity import Costs, ceiling
from infergate.loadtest import sweep

P99_BOUND_MS = 500.0
AROUND = (0.85, 1.0, 1.08, 1.15, 1.3)  # the rates run, as shares of the prediction


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infergate.loadtest.plan_check")
    p.add_argument("--input-chars", type=int, default=2000)
    p.add_argument(
        "--fit-rates", default=sweep.RATES, help="the sweep the costs come from (make sweep's)"
    )
    p.add_argument("--duration", type=float, default=15.0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="infergate-plan-check-") as tmp:
        costs_path, runs_path = Path(tmp) / "costs.json", Path(tmp) / "runs.json"
        common = ["--duration", str(args.duration), "--input-chars", str(args.input_chars)]
        sweep.main(["--rates", args.fit_rates, "--costs-out", str(costs_path), *common])
        predicted = ceiling(Costs.from_json(json.loads(costs_path.read_text())), args.input_chars)
        print(f"predicted ceiling: {predicted:.0f} req/s", flush=True)
        rates = ",".join(str(round(predicted * share)) for share in AROUND)
        sweep.main(["--rates", rates, "--json-out", str(runs_path), *common])
        runs = json.loads(runs_path.read_text())
    print(verdict(predicted, runs))
    return 0


def verdict(predicted: float, runs: list[dict[str, Any]]) -> str:
    """Where the measured p99 crossed the bound for good (this machine is
    noisy: a rate below that may cross it once, and is named), and how far
    the prediction is from the far end of that span."""
    rates = sorted(float(r["rate"]) for r in runs)
    held = {float(r["rate"]) for r in runs if _kept_up(r)}
    if not held:
        return "the p99 was over the bound at every rate: run lower rates"
    if rates[-1] in held:
        return "the p99 was under the bound at the highest rate: run higher rates"
    low = max(held)
    high = min(r for r in rates if r > low)
    odd = [f"{r:.0f}" for r in rates if r < low and r not in held]
    off = max(abs(predicted - low) / low, abs(predicted - high) / high)
    return (
        f"measured ceiling between {low:.0f} and {high:.0f} req/s (p99 under"
        f" {P99_BOUND_MS:.0f} ms, every request answered)"
        + (f"; crossed once below it, at {', '.join(odd)} req/s" if odd else "")
        + f"; the prediction is within {off:.1%}"
    )


def _kept_up(run: dict[str, Any]) -> bool:
    all_tiers = run["tiers"]["all"]
    return bool(all_tiers["p99_ms"] <= P99_BOUND_MS and all_tiers["success_rate"] >= 0.999)


if __name__ == "__main__":
    sys.exit(main())
