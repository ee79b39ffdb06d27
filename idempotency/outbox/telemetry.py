"""OpenTelemetry for the outbox: a ``create`` span per enqueue, a ``send`` span per delivery, metrics.

Follows the OpenTelemetry messaging semantic conventions: the ``create`` span (kind PRODUCER) is
started where the message is written; its W3C context (``traceparent``/``tracestate``) is stored on
the row, and the relay's ``send`` span (kind PRODUCER: the relay sends the message on to its
handler) *links* to it, so a trace shows which request's transaction a delivery came from even when
the relay runs hours later in another process. Attributes: ``messaging.system`` (``sagaguard``),
``messaging.operation.name``/``.type``, ``messaging.destination.name`` (the message type),
``messaging.message.id``, ``messaging.message.conversation_id`` (the aggregate id), on ``send``
``sagaguard.outbox.attempt``, and on a ``create`` that found its message already enqueued under its
dedup key ``sagaguard.outbox.deduplicated`` (its message id is then that message's: nothing new
was written). A failed span carries ``error.type`` (the exception's fully-qualified type name). With
the business key opted in (:func:`sagaguard.idempotency.telemetry.expose_identifiers`), a ``create`` span
started inside :func:`sagaguard.idempotency.telemetry.business_key` carries ``sagaguard.business_key``.
Payloads, headers, provider keys and dedup keys never go on spans.

Metrics: ``sagaguard.outbox.delivered``, ``.failed`` (an attempt failed and will be retried) and
``.dead`` counters; ``sagaguard.outbox.depth`` and ``sagaguard.outbox.oldest_age`` gauges, fed by
the status each running relay reads now and then (the last reading per table). Metrics carry the
table name as ``sagaguard.outbox.table``.

Depends on ``opentelemetry-api`` only: without an SDK every call here is a cheap no-op.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Link, SpanContext, TraceFlags, TraceState

from sagaguard.idempotency.telemetry import error_type, identifier_attributes

__all__ = [
    "SYSTEM",
    "CreateSpan",
    "dead_counter",
    "delivered_counter",
    "failed_counter",
    "linked_context",
    "record_status",
    "send_span",
    "tracer",
    "tracing_enabled",
]

SYSTEM = "sagaguard"
"""``messaging.system`` of outbox spans."""

tracer = trace.get_tracer("sagaguard.outbox")
_meter = metrics.get_meter("sagaguard.outbox")

delivered_counter = _meter.create_counter(
    "sagaguard.outbox.delivered", unit="{message}", description="Outbox messages delivered"
)
failed_counter = _meter.create_counter(
    "sagaguard.outbox.failed", unit="{message}", description="Failed delivery attempts (retried later)"
)
dead_counter = _meter.create_counter(
    "sagaguard.outbox.dead", unit="{message}", description="Outbox messages dead-lettered"
)

_readings: dict[str, tuple[int, float]] = {}  # table -> (depth, oldest age)
_readings_lock = threading.Lock()


def record_status(table: str, depth: int, oldest_age: float | None) -> None:
    """Keep the latest status reading of ``table`` for the gauges."""
    with _readings_lock:
        _readings[table] = (depth, oldest_age or 0.0)


def _observe(index: int) -> Any:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        with _readings_lock:
            items = list(_readings.items())
        return [Observation(reading[index], {"sagaguard.outbox.table": t}) for t, reading in items]

    return callback


_meter.create_observable_gauge(
    "sagaguard.outbox.depth",
    callbacks=[_observe(0)],
    unit="{message}",
    description="Outbox messages pending or in flight",
)
_meter.create_observable_gauge(
    "sagaguard.outbox.oldest_age",
    callbacks=[_observe(1)],
    unit="s",
    description="Age of the oldest pending or in-flight outbox message",
)


def _attributes(operation: str, destination: str, message_id: str, aggregate_id: str) -> dict[str, str]:
    return {
        "messaging.system": SYSTEM,
        "messaging.operation.name": operation,
        "messaging.operation.type": operation,
        "messaging.destination.name": destination,
        "messaging.message.id": message_id,
        "messaging.message.conversation_id": aggregate_id,
    }


def tracing_enabled() -> bool:
    """Whether an SDK tracer provider is installed. Without one every span is a no-op, and the
    outbox skips building them (a measurable part of a relay's per-message cost)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


class CreateSpan:
    """The ``create`` span of an enqueue, open while the row is written (a context manager).

    :attr:`traceparent` and :attr:`tracestate` are its W3C context, to store on the row (both None
    when nothing is recording). The span is a child of the current span (the business
    transaction's); :meth:`found` marks an enqueue that found its message already there.
    """

    __slots__ = ("_span", "traceparent", "tracestate")

    def __init__(self, destination: str, message_id: str, aggregate_id: str) -> None:
        self._span: trace.Span | None = None
        self.traceparent: str | None = None
        self.tracestate: str | None = None
        if not tracing_enabled():
            return
        attributes = _attributes("create", destination, message_id, aggregate_id)
        attributes.update(identifier_attributes())
        span = tracer.start_span(f"create {destination}", kind=trace.SpanKind.PRODUCER, attributes=attributes)
        self._span = span
        context = span.get_span_context()
        if context.is_valid:
            flags = int(context.trace_flags) & 0xFF
            self.traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"
            self.tracestate = (context.trace_state.to_header() if context.trace_state else None) or None

    def found(self, message_id: str) -> None:
        """The enqueue wrote nothing: the message ``message_id`` was already there under its key."""
        if self._span is not None:
            self._span.set_attribute("messaging.message.id", message_id)
            self._span.set_attribute("sagaguard.outbox.deduplicated", True)

    def __enter__(self) -> CreateSpan:
        return self

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self._span is not None:
            if exc is not None:
                self._span.set_attribute("error.type", error_type(exc))
                self._span.set_status(trace.StatusCode.ERROR)
            self._span.end()


def linked_context(traceparent: str | None, tracestate: str | None) -> SpanContext | None:
    """The span context stored on a row, or None when there is none or it does not parse."""
    if not traceparent:
        return None
    parts = traceparent.strip().split("-")
    if len(parts) != 4 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    state = TraceState.from_header([tracestate]) if tracestate else None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags), trace_state=state)


class send_span:
    """The ``send {type}`` span around one delivery, linked to the message's ``create`` span.

    ``trace_context`` is anything with ``traceparent`` and ``tracestate`` attributes (a claimed row).
    Call :meth:`failed` with the exception when the handler failed (only its type goes on the span:
    messages may quote arguments), then :meth:`end`.
    """

    __slots__ = ("_span",)

    def __init__(
        self,
        destination: str,
        message_id: str,
        aggregate_id: str,
        attempt: int,
        trace_context: Any,
    ) -> None:
        context = linked_context(trace_context.traceparent, trace_context.tracestate)
        attributes: dict[str, Any] = _attributes("send", destination, message_id, aggregate_id)
        attributes["sagaguard.outbox.attempt"] = attempt
        self._span = tracer.start_span(
            f"send {destination}",
            kind=trace.SpanKind.PRODUCER,
            attributes=attributes,
            links=[Link(context)] if context is not None else None,
            record_exception=False,
            set_status_on_exception=False,
        )

    @property
    def span(self) -> trace.Span:
        """The span, to make current while the handler runs (``trace.use_span``)."""
        return self._span

    def failed(self, error: BaseException) -> None:
        """Mark the span as failed, with ``error.type`` the fully-qualified type name of ``error``."""
        if self._span.is_recording():
            self._span.set_attribute("error.type", error_type(error))
            self._span.set_status(trace.Status(trace.StatusCode.ERROR))

    def end(self) -> None:
        """End the span."""
        self._span.end()
