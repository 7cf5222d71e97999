"""``infergate plan``: the cost model's fit, the sizing arithmetic, and the
command as a user runs it (the shipped costs, and inputs it must refuse)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from infergate.base.capacity import ROLES, Costs, Measured, RoleCost, Target, ceiling, fit, plan
from infergate.loadtest.plan_check import verdict

ROOT = Path(__file__).resolve().parent.parent


def measured(input_chars: int, per_request_us: float, per_batch_us: float = 500.0) -> Measured:
    role = RoleCost(0.02, per_request_us, per_batch_us)
    return Measured(
        input_chars=input_chars,
        roles=dict.fromkeys(ROLES, role),
        loadgen_us=100.0,
        workers=8,
        gateways=2,
        batch_ms=100.0,
        max_batch=100,
        cores=2,
    )


def test_the_fit_recovers_a_roles_idle_per_request_and_per_batch_costs() -> None:
    truth = RoleCost(0.05, 300.0, 1000.0)
    points = [
        (r, b, truth.idle_cores + truth.cores(r, b))
        for r, b in ((10.0, 1.0), (1000.0, 13.0), (2000.0, 26.0), (3000.0, 38.0))
    ]
    got = fit(points)
    assert got.idle_cores == pytest.approx(0.05, abs=1e-9)
    assert got.per_request_us == pytest.approx(300.0)
    assert got.per_batch_us == pytest.approx(1000.0)


def test_the_fit_never_gives_a_negative_cost() -> None:
    # Dearer per request in bigger batches (noise): no negative per-batch cost.
    points = [(1000.0, 10.0, 0.20), (2000.0, 20.0, 0.42), (3000.0, 30.0, 0.66)]
    got = fit(points)
    assert min(got.idle_cores, got.per_request_us, got.per_batch_us) >= 0
    assert got.idle_cores + got.cores(3000, 30) == pytest.approx(0.66, rel=0.1)


def test_a_plan_sizes_each_role_for_the_peak_at_the_utilization() -> None:
    costs = Costs("test machine", [measured(2000, 250.0)])
    target = Target(10_000, 3, 2000, 100, 64, 0.7)
    p = plan(costs, target)
    assert p.peak_rps == 30_000
    # 30,000 req/s over workers of 640 req/s each (64 every 100 ms), 70 % full.
    assert p.workers == math.ceil(30_000 / (640 * 0.7))
    assert p.batch_at_peak <= 64 * 0.7 + 0.1
    assert p.batch_at_average == pytest.approx(p.batch_at_peak / 3, abs=0.1)
    busy = (250.0 * 30_000 + 500.0 * 30_000 / p.batch_at_peak) / 1e6
    assert p.cores_at_peak["redis"] == pytest.approx(busy, rel=0.01)
    assert p.shards == math.ceil(busy / 0.7)
    assert p.gateway_cores == math.ceil(busy / 0.7)


def test_costs_between_two_input_lengths_are_interpolated() -> None:
    costs = Costs("m", [measured(32, 100.0), measured(2032, 300.0)])
    assert costs.at(1032)["redis"].per_request_us == pytest.approx(200.0)
    assert costs.at(4032)["redis"].per_request_us == pytest.approx(500.0)  # beyond: the line
    assert Costs("m", [measured(32, 100.0)]).at(5000)["redis"].per_request_us == 100.0


def test_the_ceiling_is_where_the_measured_stack_uses_every_core() -> None:
    costs = Costs("m", [measured(2000, 200.0, 0.0)])
    top = ceiling(costs, 2000)
    # 4 roles at 200 µs and the load generator at 100 µs a request, on 2
    # cores less the roles' idle 0.08.
    assert top == pytest.approx((2 - 4 * 0.02) / (900e-6), rel=1e-3)


def test_costs_files_are_read_back_and_hostile_ones_refused() -> None:
    good = Costs("m", [measured(2000, 200.0)])
    assert Costs.from_json(json.loads(json.dumps(good.to_json()))) == good
    roles = measured(2000, 200.0).roles
    text_cost = {r: {**vars(roles[r]), "per_request_us": "9"} for r in ROLES}
    hostile: list[object] = [
        None,
        [],
        {"machine": "m"},
        {"machine": "m", "measured": []},
        {"machine": "m", "measured": "x"},
        _with("workers", 0),
        _with("batch_ms", float("nan")),
        _with("cores", True),
        _with("loadgen_us", -1),
        _with("roles", {}),
        _with("roles", {r: {"idle_cores": 1} for r in ROLES}),
        _with("roles", text_cost),
    ]
    for bad in hostile:
        with pytest.raises(ValueError, match="costs file"):
            Costs.from_json(bad)


def _with(field: str, value: object) -> dict[str, object]:
    """A costs file with one field of its measurement replaced."""
    m = Costs("m", [measured(2000, 200.0)]).to_json()["measured"]
    assert isinstance(m, list)
    return {"machine": "m", "measured": [{**m[0], field: value}]}


def run_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infergate", "plan", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_command_plans_the_design_documents_peak_from_the_shipped_costs() -> None:
    out = run_plan(
        "--rps",
        "10000",
        "--peak",
        "3",
        "--input-chars",
        "2000",
        "--batch-ms",
        "100",
        "--max-batch",
        "64",
    )
    assert out.returncode == 0, out.stderr
    assert "30000 req/s" in out.stdout
    lines = {
        line.split()[0]: line
        for line in out.stdout.splitlines()
        if line.startswith("  ") and not line.strip().startswith("(")
    }
    assert set(lines) == {"GPU", "gateway", "dispatchers", "Redis", "worker"}
    assert f"{math.ceil(30_000 / (640 * 0.7))}" in lines["GPU"]
    ceiling_out = run_plan("--ceiling", "--input-chars", "2000")
    assert ceiling_out.returncode == 0, ceiling_out.stderr
    assert float(ceiling_out.stdout.split()[0]) > 0


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--rps", "-1"],
        ["--rps", "nan"],
        ["--rps", "1e400"],
        ["--rps", "1e308", "--peak", "2"],
        ["--rps", "1", "--batch-ms", "1e300", "--max-batch", "1", "--utilization", "1e-300"],
        ["--rps", "100", "--peak", "0.5"],
        ["--rps", "100", "--max-batch", "101"],
        ["--rps", "100", "--max-batch", "2.5"],
        ["--rps", "100", "--utilization", "0"],
        ["--rps", "100", "--utilization", "1.5"],
        ["--rps", "100", "--costs", "/nonexistent/costs.json"],
        ["--rps", "100", "--costs", "COSTS_GARBAGE"],
        ["--rps", "100", "--costs", "COSTS_HOSTILE"],
        ["--rps", "100", "--costs", "COSTS_HUGE"],
        ["--rps", "100", "--costs", "COSTS_DEEP"],
    ],
)
def test_the_command_refuses_bad_input_with_a_message(args: list[str], tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\xff\x00not json")
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps({"machine": "m", "measured": [{"workers": "9"}]}))
    huge = tmp_path / "huge.json"
    measurement = Costs("m", [measured(2000, 200.0)]).to_json()["measured"]
    assert isinstance(measurement, list)
    huge.write_text(
        json.dumps({"machine": "m", "measured": [{**measurement[0], "workers": 10**400}]})
    )
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000)
    files = {
        "COSTS_GARBAGE": garbage,
        "COSTS_HOSTILE": hostile,
        "COSTS_HUGE": huge,
        "COSTS_DEEP": deep,
    }
    args = [str(files[a]) if a in files else a for a in args]
    out = run_plan(*args)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    assert out.stderr.strip()


def test_the_check_names_where_the_p99_crossed_the_bound_for_good() -> None:
    def run(rate: float, p99_ms: float) -> dict[str, object]:
        return {"rate": rate, "tiers": {"all": {"p99_ms": p99_ms, "success_rate": 1.0}}}

    noisy = [run(1403, 305), run(1650, 703), run(1782, 494), run(1898, 534), run(2145, 2275)]
    said = verdict(1650, noisy)
    assert "between 1782 and 1898" in said
    assert "crossed once below it, at 1650" in said
    assert "within 13.1%" in said
    assert "every rate" in verdict(1000, [run(900, 600), run(1000, 700)])
    assert "highest rate" in verdict(1000, [run(900, 100), run(1000, 200)])
