"""structlog set-up shared by every process.

JSON, one event per line, when stderr is not a terminal; readable key=value
lines on a terminal. Log calls pass fields, never f-strings, and never an API
key or an input text (lengths and hashes only); fields are text, numbers,
and lists and dicts of them (bytes would be written as base64).
"""

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import MutableMapping
from typing import Any, BinaryIO, TextIO, cast

import msgspec
import structlog


def configure(role: str, process_id: str, level: str | None = None) -> None:
    """Configure structlog for one process; every line carries role and id."""
    level_name = (level or os.environ.get("INFERGATE_LOG_LEVEL", "info")).upper()
    level_no = logging.getLevelNamesMapping().get(level_name, logging.INFO)
    json_lines = os.environ.get("INFERGATE_LOG_FORMAT", "") == "json" or not sys.stderr.isatty()
    # A JSON line goes out in one write (print writes the newline apart
    # where stderr is unbuffered, as PYTHONUNBUFFERED makes it).
    renderer: Any = _json_line if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    factory: Any = (
        # (structlog's loggers call a file's write and flush, and no more)
        structlog.BytesLoggerFactory(file=cast(BinaryIO, WhileThere(sys.stderr.buffer)))
        if json_lines
        else structlog.PrintLoggerFactory(file=cast(TextIO, WhileThere(sys.stderr)))
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(role=role, pid=os.getpid(), process_id=process_id)
    # Libraries that use stdlib logging (uvicorn) go to stderr at warning and above.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")


class WhileThere:
    """stderr, written to while it is there: once it is gone (its terminal
    closed, its reader left) a line is lost, not the process (a drain after
    SIGHUP logs as it goes)."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def write(self, data: Any) -> int:
        try:
            return int(self._file.write(data))
        except OSError:
            return 0

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._file.flush()


_encoder = msgspec.json.Encoder(enc_hook=repr)


def _json_line(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> bytes:
    """One event as a JSON line's bytes; what msgspec cannot write (a lone
    surrogate) as the standard library writes it."""
    try:
        return _encoder.encode(event)
    except (TypeError, ValueError, OverflowError):  # (UnicodeEncodeError is a ValueError)
        return json.dumps(event, default=repr, separators=(",", ":")).encode()


def get(name: str) -> Any:
    return structlog.get_logger(name)


class _Limiter:
    """At most ``per_s`` lines a second for each event name; the next line
    that gets through says how many were suppressed in between."""

    def __init__(self, per_s: int = 5) -> None:
        self.per_s = per_s
        self.window: dict[str, tuple[int, int, int]] = {}  # event -> (second, lines, suppressed)

    def admit(self, event: str) -> tuple[bool, int]:
        now = int(time.monotonic())
        second, lines, suppressed = self.window.get(event, (now, 0, 0))
        if second != now:
            second, lines = now, 0
        if lines >= self.per_s:
            self.window[event] = (second, lines, suppressed + 1)
            return False, 0
        self.window[event] = (second, lines + 1, 0)
        return True, suppressed


_limiter = _Limiter()


def limited(logger: Any, event: str, level: str = "info", **fields: Any) -> None:
    """Log an event that an attacker can repeat at will (a refused request,
    a bad header): a few lines a second at most, never a traceback."""
    admitted, suppressed = _limiter.admit(event)
    if admitted:
        if suppressed:
            fields["suppressed"] = suppressed
        getattr(logger, level)(event, **fields)
