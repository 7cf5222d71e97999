"""The contract, run against a backend before it serves anyone
(``infergate backend check``): batches of 1 to the largest size, Unicode,
duplicates, long inputs and an empty string, each output counted and
typed; whether temperature 0 is deterministic; and the batch time at each
size. A breach is what would fail requests in service (a wrong count, a
non-string, an input the tiers allow that makes it fail); a warning is
what a team should know (outputs that differ at temperature 0, or an empty
string refused: infergate never sends one)."""

import time
from dataclasses import dataclass, field

from infergate.gpu.backend import MAX_BATCH, Backend, BackendError

UNICODE = [
    "héllo wörld",
    "日本語のテキスト",
    "emoji 🙂🚀 and a ZWJ 👩\u200d💻",
    "עברית מימין לשמאל",
    "tabs\tand\nnew lines\r\n",
    'quotes " \\ and {"json": [1]}',
    "\u0000 a NUL and \ufffd a replacement",
]


@dataclass
class Check:
    name: str
    outcome: str  # "ok", "warning" or "breach"
    detail: str = ""


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    # Each batch size measured, and its call's time (ms).
    batch_ms: dict[int, float] = field(default_factory=dict)

    @property
    def breaches(self) -> list[Check]:
        return [c for c in self.checks if c.outcome == "breach"]

    def best(self) -> tuple[int, float]:
        """The size with the most inputs a second, and its time."""
        return max(self.batch_ms.items(), key=lambda kv: kv[0] / max(kv[1], 1e-3))


def sizes_up_to(largest: int) -> list[int]:
    """1, 2, 4, ... and the largest itself."""
    out, n = [], 1
    while n < largest:
        out.append(n)
        n *= 2
    return [*out, largest]


def run(backend: Backend, largest: int = MAX_BATCH, long_chars: int = 4_096) -> Report:
    report = Report()
    largest = max(1, min(MAX_BATCH, largest))
    _call(backend, ["warm up"], report, "a first call (loads the model)")
    for size in sizes_up_to(largest):
        inputs = [f"input {i} of a batch of {size}" for i in range(size)]
        started = time.perf_counter()
        if _call(backend, inputs, report, f"a batch of {size}") is not None:
            report.batch_ms[size] = round((time.perf_counter() - started) * 1000, 3)
    _call(backend, UNICODE, report, "Unicode, control characters and JSON")
    _call(
        backend, ["x" * long_chars] * min(4, largest), report, f"inputs of {long_chars} characters"
    )
    twice = ["same input", "same input", "another input"][: max(1, min(3, largest))]
    first = _call(backend, twice, report, "the same input twice in a batch")
    again = _call(backend, twice, report, "the same batch again")
    if first is not None and again is not None:
        same = first == again and (len(first) < 2 or first[0] == first[1])
        report.checks.append(
            Check(
                "deterministic at temperature 0",
                "ok" if same else "warning",
                ""
                if same
                else "outputs differ between identical inputs or calls (a cache or "
                "collapsing would serve one of them to both)",
            )
        )
    _empty(backend, report)
    return report


def _call(backend: Backend, inputs: list[str], report: Report, name: str) -> list[str] | None:
    """One call, checked: one string per input."""
    try:
        outputs = backend.infer(list(inputs))
    except BackendError as exc:
        report.checks.append(Check(name, "breach", f"failed: {str(exc)[:200]}"))
        return None
    if not isinstance(outputs, list) or len(outputs) != len(inputs):
        got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        report.checks.append(Check(name, "breach", f"{got} outputs for {len(inputs)} inputs"))
        return None
    wrong = [i for i, o in enumerate(outputs) if not isinstance(o, str)]
    if wrong:
        report.checks.append(Check(name, "breach", f"output {wrong[0]} is not a string"))
        return None
    report.checks.append(Check(name, "ok"))
    return outputs


def _empty(backend: Backend, report: Report) -> None:
    try:
        outputs = backend.infer([""])
        ok = isinstance(outputs, list) and len(outputs) == 1 and isinstance(outputs[0], str)
    except BackendError:
        ok = False
    report.checks.append(
        Check(
            "an empty string",
            "ok" if ok else "warning",
            "" if ok else "refused (infergate never sends one: the gateway answers 400)",
        )
    )
