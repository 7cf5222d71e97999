"""structlog set-up shared by every process.

JSON, one event per line, when stderr is not a terminal; readable key=value
lines on a terminal. Log calls pass fields, never f-strings, and never an API
key or an input text (lengths and hashes only).
"""

import logging
import os
import sys
from typing import Any

import structlog


def configure(role: str, process_id: str, level: str | None = None) -> None:
    """Configure structlog for one process; every line carries role and id."""
    level_name = (level or os.environ.get("INFERGATE_LOG_LEVEL", "info")).upper()
    level_no = logging.getLevelNamesMapping().get(level_name, logging.INFO)
    json_lines = os.environ.get("INFERGATE_LOG_FORMAT", "") == "json" or not sys.stderr.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=False)
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(role=role, pid=os.getpid(), process_id=process_id)
    # Libraries that use stdlib logging (uvicorn) go to stderr at warning and above.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")


def get(name: str) -> Any:
    return structlog.get_logger(name)
