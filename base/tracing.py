"""OpenTelemetry traces, off unless ``INFERGATE_TRACING`` is set:

- ``console``: every span as one JSON line on stderr, next to the logs;
- ``otlp``: to an OTLP/HTTP collector (``OTEL_EXPORTER_OTLP_ENDPOINT``);
  needs ``opentelemetry-exporter-otlp-proto-http`` installed.

A request's span (``gateway.inference``) carries its W3C ``traceparent`` in
the envelope; the dispatcher's ``dispatcher.batch`` span (or, for a lone
request its gateway handed straight to a worker, a ``handed_straight``
event on the request's span) and the worker's ``worker.batch`` span link to
the span of every request in the batch, so a trace viewer shows which batch
served a request and with whom. Off, spans are the API's no-ops and
nothing is propagated.
"""

import os
import sys
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
enabled = False


def setup(role: str, process_id: str) -> None:
    global enabled
    mode = os.environ.get("INFERGATE_TRACING", "").strip().lower()
    if not mode or mode == "off":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    exporter: SpanExporter
    if mode == "console":
        exporter = ConsoleSpanExporter(
            out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + "\n"
        )
    elif mode == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    else:
        raise SystemExit(f"INFERGATE_TRACING={mode!r}: use console, otlp or off")
    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": "infergate-" + role, "service.instance.id": process_id}
        )
    )
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    enabled = True


def event(name: str) -> None:
    """An event on the current span (nothing when off)."""
    if enabled:
        trace.get_current_span().add_event(name)


def tracer(name: str) -> Tracer:
    return trace.get_tracer(name)


def current_traceparent() -> str | None:
    """The current span's W3C traceparent, to carry in an envelope (None when off)."""
    if not enabled:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent")


def links(traceparents: Sequence[str | None]) -> list[Link]:
    out = []
    for tp in traceparents:
        if not tp:
            continue
        ctx = trace.get_current_span(_propagator.extract({"traceparent": tp})).get_span_context()
        if ctx.is_valid:
            out.append(Link(ctx))
    return out


def context_from(traceparent: str | None, tracestate: str | None) -> Context | None:
    """The caller's trace context, from its W3C headers: the trace id, the
    parent span id, the sampled flag and tracestate, nothing else (baggage
    is not read). A malformed traceparent is ignored: a new trace starts."""
    if not traceparent or len(traceparent) > 256 or (tracestate and len(tracestate) > 512):
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    ctx = _propagator.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def trace_id(span: Span) -> str | None:
    """A span's trace id as 32 hex digits (None if it has none)."""
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None
