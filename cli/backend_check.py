"""``infergate backend check SPEC``: the contract run against a team's
backend before it serves anyone (``gpu/backends/contract.py`` says what is
checked), with a table, a verdict and an exit code (0 ok, 1 a breach, 2 it
cannot be made or its server does not answer). ``--times-out FILE`` keeps
its batch times where ``infergate plan --backend-times`` reads them."""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infergate.policies.schema import Model
from infergate.serving import backend_for, backend_options

if TYPE_CHECKING:
    from infergate.gpu.backend import Upstream


def add_parser(sub: Any) -> None:
    backend = sub.add_parser("backend", help="backend tools")
    tools = backend.add_subparsers(dest="backend_command", required=True)
    check = tools.add_parser("check", help="run the contract against a backend before it serves")
    check.add_argument(
        "spec", help="python:pkg.module:attr, http:URL, kserve-v2:URL, openai:URL, ..."
    )
    check.add_argument(
        "--options", type=backend_options, default=None, help="its options, e.g. '{model: echo}'"
    )
    check.add_argument("--max-batch", type=int, default=100, help="the largest batch (1-100)")
    check.add_argument(
        "--long-chars", type=int, default=4_096, help="the longest input your tiers allow"
    )
    check.add_argument("--times-out", default=None, help="write the batch times here (JSON)")
    check.add_argument(
        "--wait-s", type=float, default=30.0, help="how long to wait for a server to answer"
    )


def _namespace(args: argparse.Namespace) -> argparse.Namespace:
    """What ``backend_for`` reads of a worker's flags, for this spec alone."""
    return argparse.Namespace(
        backend=args.spec,
        backend_options=args.options,
        model_name="default",
        sim_latency_ms=None,
        sim_ms_per_ktoken=0.0,
        sim_new_token_weight=1.0,
        sim_step_weight=0.0,
        sim_fail_marker="",
        sim_hang_marker="",
        max_new_tokens=None,
        model=None,
        gguf_file=None,
        device=None,
    )


def run(args: argparse.Namespace) -> int:
    from infergate.gpu.backend import Unusable
    from infergate.gpu.backends import contract

    if not 1 <= args.max_batch <= 100 or args.long_chars < 1:
        print(
            "infergate backend check: --max-batch is 1-100, --long-chars at least 1",
            file=sys.stderr,
        )
        return 2
    backend = backend_for(_namespace(args), Model(backend=args.spec), "infergate backend check")
    if backend is None:
        return 2
    upstream = backend.upstream
    try:
        if upstream is not None and not _answers_within(upstream, args.wait_s):
            print(
                f"infergate backend check: {args.spec} did not answer within {args.wait_s:g} s",
                file=sys.stderr,
            )
            return 2
        report = contract.run(backend, args.max_batch, args.long_chars)
    except Unusable as exc:
        print(f"infergate backend check: {exc}", file=sys.stderr)
        return 2
    finally:
        if upstream is not None:
            upstream.close()
    print(_render(args.spec, backend.lacks, report))
    if args.times_out and report.batch_ms:
        try:
            _write_times(Path(args.times_out), args.spec, report)
        except OSError as exc:
            print(f"infergate backend check: --times-out: {exc}", file=sys.stderr)
            return 2
    return 1 if report.breaches else 0


def _answers_within(upstream: "Upstream", wait_s: float) -> bool:
    """Whether the server answers, asked every second for ``wait_s`` (a
    server just started loads its model first)."""
    deadline = time.monotonic() + wait_s
    while not upstream.probe():
        if time.monotonic() >= deadline:
            return False
        time.sleep(1.0)
    return True


def _render(spec: str, lacks: frozenset[str], report: Any) -> str:
    lines = [f"infergate backend check {spec}"]
    for check in report.checks:
        mark = {"ok": "ok", "warning": "warning", "breach": "BREACH"}[check.outcome]
        lines.append(f"  {mark:<8} {check.name}" + (f": {check.detail}" if check.detail else ""))
    if report.batch_ms:
        lines.append("  batch time (ms) by size:")
        for size, ms in report.batch_ms.items():
            lines.append(
                f"    {size:>4}  {ms:>9.1f}   {size * 1000 / max(ms, 1e-3):>9.1f} inputs/s"
            )
    can = ", ".join(
        f"{what}: {'no' if what in lacks else 'yes'}" for what in ("sampling", "max_tokens")
    )
    lines.append(f"  what it does for a request: {can} (what it cannot do is a 400)")
    breaches = report.breaches
    if breaches:
        lines.append(f"verdict: {len(breaches)} breach{'es' * (len(breaches) > 1)} of the contract")
    else:
        warnings = sum(c.outcome == "warning" for c in report.checks)
        lines.append(
            "verdict: keeps the contract" + (f" ({warnings} warnings)" if warnings else "")
        )
    return "\n".join(lines)


def _write_times(path: Path, spec: str, report: Any) -> None:
    size, ms = report.best()
    times = {
        "backend": spec,
        "batch_ms": {str(n): t for n, t in report.batch_ms.items()},
        # The size that serves the most inputs a second, and its time: what
        # `infergate plan --backend-times` sizes the workers by.
        "max_batch": size,
        "full_batch_ms": ms,
    }
    path.write_text(json.dumps(times, indent=2) + "\n", "utf-8")
