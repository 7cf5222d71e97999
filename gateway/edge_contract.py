"""What the HTTP edge relies on in uvicorn beyond its public API, checked
when a gateway starts: a uvicorn that renamed one of these refuses to start,
naming it, instead of answering 400 to every request (pyproject.toml bounds
uvicorn to the versions tested; tests/test_internals.py drives the edge over
a fake transport). And uvicorn's own warning for a request its parser
rejects, which the edge answers and logs itself (rate-limited)."""

import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# What the edge uses of uvicorn's httptools protocol beyond its public
# constructor: checked when a gateway starts (``missing_internals``), so a
# uvicorn that renamed one refuses to start instead of answering 400 to all.
PROTOCOL_METHODS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "on_message_begin",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "send_400_response",
    "_start_asgi_task",
)
# Set on each connection by uvicorn once it has read a request.
PROTOCOL_ATTRIBUTES = (
    "cycle",
    "flow",
    "pipeline",
    "parser",
    "server_state",
    "connections",
    "loop",
    "transport",
    "headers",
    "url",
    "scope",
    "expect_100_continue",
)


def missing_internals(protocol: object | None = None) -> list[str]:
    """The uvicorn internals the edge uses that are not there: its methods on
    the class and, given a protocol that has read a request, the attributes
    on it."""
    missing = [
        f"HttpToolsProtocol.{name}"
        for name in PROTOCOL_METHODS
        if not callable(getattr(HttpToolsProtocol, name, None))
    ]
    if protocol is not None:
        missing += [
            f"HttpToolsProtocol().{name}"
            for name in PROTOCOL_ATTRIBUTES
            if not hasattr(protocol, name)
        ]
    return missing


class _WithoutParserWarnings(logging.Filter):
    """uvicorn logs a warning for every request its parser rejects, before
    the edge answers it; the edge's own line (``edge.refused``) is
    rate-limited, so uvicorn's is dropped: a hostile client cannot flood the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Invalid HTTP request received."


def quiet_parser_warnings() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _WithoutParserWarnings) for f in logger.filters):
        logger.addFilter(_WithoutParserWarnings())
