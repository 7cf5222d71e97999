"""``infergate up --workers MIN:MAX``: follow the autoscaling signal.

The dispatchers compute how many workers the fleet needs (base/autoscale.py,
already held at its peak over the policy's quiet period) and keep it in
Redis; once a second ``up`` reads it, clamps it to MIN..MAX, starts the
workers missing at once and retires the extra ones with the highest slot
numbers (the newest) by SIGTERM, the drain that finishes a worker's batch
and loses nothing.
"""

import argparse
import time
from collections.abc import Callable

from infergate.base import logs
from infergate.base.queue.scale_signal import SignalReader

log = logs.get(__name__)

INTERVAL_S = 1.0


def worker_range(text: str) -> tuple[int, int]:
    """``N`` (a fixed count) or ``MIN:MAX`` (autoscaled), for ``--workers``."""
    low, sep, high = str(text).partition(":")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a count (4) or a range MIN:MAX (1:8)"
        ) from None
    if bounds == (0, 0):
        return bounds  # (none here: workers on other hosts join the stack)
    if not 1 <= bounds[0] <= bounds[1] <= 256:
        raise argparse.ArgumentTypeError(
            f"{text!r}: need 1 <= MIN <= MAX <= 256 (e.g. 1:8), or 0 (workers run elsewhere)"
        )
    return bounds


def model_counts(text: str) -> list[tuple[str, int]]:
    """``NAME=COUNT,...`` for ``up --models``: each model and its workers."""
    from infergate.base.keys import check_model_name

    out: list[tuple[str, int]] = []
    for part in str(text).split(","):
        name, sep, count = part.strip().partition("=")
        try:
            check_model_name(name)
            workers = int(count) if sep else 1
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{text[:200]!r}: {exc}; e.g. small=2,large=1"
            ) from None
        if not 1 <= workers <= 64 or name in dict(out):
            raise argparse.ArgumentTypeError(
                f"{text[:200]!r}: each model once, with 1-64 workers; e.g. small=2,large=1"
            )
        out.append((name, workers))
    return out


class WorkerScaler:
    """Keeps the number of workers at the signal, within ``low``..``high``.

    ``count`` says how many workers run and are not retiring; ``add`` starts
    one (once a slot is free); ``retire`` stops the highest-numbered by SIGTERM.
    """

    def __init__(
        self,
        reader: SignalReader,
        low: int,
        high: int,
        count: Callable[[], int],
        add: Callable[[], None],
        retire: Callable[[], None],
    ) -> None:
        self.reader = reader
        self.low, self.high = low, high
        self.count, self.add, self.retire = count, add, retire
        self._next_s = 0.0

    def target(self) -> int | None:
        """The signal clamped to the range; None while there is no signal."""
        signal = self.reader.read()
        if signal is None:
            return None
        return max(self.low, min(self.high, signal.desired_workers))

    def step(self) -> None:
        now = time.monotonic()
        if now < self._next_s:
            return
        self._next_s = now + INTERVAL_S
        target, running = self.target(), self.count()
        if target is None or target == running:
            return
        log.info("up.scaling", workers=running, target=target)
        for _ in range(target - running):
            self.add()
        for _ in range(running - target):
            self.retire()

    def close(self) -> None:
        self.reader.close()
