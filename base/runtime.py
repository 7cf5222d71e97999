"""Running one component as a process: signals, a bounded shutdown, exit codes,
and a heap that a full collection need not scan whole (``freeze_heap``).

The first SIGTERM, SIGINT or SIGHUP (a closed terminal) sets the
component's ``stop`` event so it can drain; a second SIGTERM or SIGINT ends
the process at once. A shutdown can never hang: if the component has not
returned ``shutdown_grace_s`` after the first signal, the stack of every
task still running is logged (``shutdown.stuck``, the await that did not
finish) and the process exits with ``EXIT_STUCK``.
"""

import asyncio
import gc
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop
from infergate.base import logs

# The signals that drain a process (SIGHUP: its terminal closed, as SIGTERM).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_signals() -> tuple[signal.Signals, ...]:
    """``STOP_SIGNALS``, less SIGHUP where the process was started ignoring
    it (``nohup``: it outlives its terminal, as it was asked to)."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return (signal.SIGTERM, signal.SIGINT)
    return STOP_SIGNALS


log = logs.get(__name__)

EXIT_STUCK = 4


def _where(task: asyncio.Task[Any]) -> list[str]:
    """The task's await chain, outermost first: the last line is the await that waits."""
    out = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            out.append(repr(coro)[:200])
            break
        out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out


def _exit_stuck(grace_s: float) -> None:
    tasks = {t.get_name(): _where(t) for t in asyncio.all_tasks() if not t.done()}
    log.error("shutdown.stuck", grace_s=grace_s, tasks=tasks)
    sys.stderr.flush()
    os._exit(EXIT_STUCK)


def freeze_heap() -> None:
    """Take what the process holds once started (its modules, its app, its
    policy) out of the cyclic collector's way: a full collection then scans
    only what was made since, and no longer holds the event loop long enough
    to starve the batch being formed (docs/performance.md)."""
    gc.collect()
    gc.freeze()


def run(
    main: Callable[[asyncio.Event], Coroutine[Any, Any, int]],
    shutdown_grace_s: float | Callable[[], float] = 10.0,
) -> int:
    """Run ``main(stop)`` on uvloop until it returns its exit code; past the
    grace after a signal (a number, or what it says then), the process exits."""

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if stop.is_set() and signum == signal.SIGHUP:
                return  # (a closed terminal may send it twice: the drain goes on)
            if stop.is_set():
                log.warning("shutdown.forced", signal=signum)
                sys.stderr.flush()
                os._exit(128 + signum)
            stop.set()
            grace_s = shutdown_grace_s() if callable(shutdown_grace_s) else shutdown_grace_s
            loop.call_later(grace_s, _exit_stuck, grace_s)

        for signum in stop_signals():
            loop.add_signal_handler(signum, on_signal, signum)
        freeze_heap()
        return await main(stop)

    return uvloop.run(runner())
