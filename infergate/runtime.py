"""Running one component as a process: logging, signals, exit codes."""

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop


def run(main: Callable[[asyncio.Event], Coroutine[Any, Any, int]]) -> int:
    """Run ``main(stop)`` on uvloop; SIGTERM or SIGINT sets ``stop`` so the
    component can drain; a second signal ends it at once."""

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if stop.is_set():
                raise SystemExit(128 + signum)
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        return await main(stop)

    return uvloop.run(runner())
