"""OpenTelemetry for sagas: spans for a run, its steps and compensations; counters.

Depends on ``opentelemetry-api`` only: without an SDK configured every call here is a no-op.

- ``saga {name}``: one span per :meth:`~sagaguard.saga.runner.SagaRunner.run` (or recovery ``resume``), with
  the saga's name, version and the state it ended in (``sagaguard.saga.state``).
- ``saga.step {step}``: a child of the run's span, from the commit that starts the step (the atomic
  phase) to the commit that records its result or failure. Its W3C ``traceparent`` is written into
  the step's journal row with that very commit (:attr:`~sagaguard.saga.records.StepRecord.trace`).
- ``saga.compensate {step}``: one per compensation attempt, a child of the span of the run that
  compensates, with a *link* to the step span it undoes, read from the journal, so the link holds
  when the compensation runs in another process after a crash.

No inputs, results or error messages go on spans: names, kinds, attempts, states and error *types*
(``error.type``, fully qualified, on every ERROR span) only. Saga ids and a business key go on them
only when opted in (:func:`sagaguard.idempotency.telemetry.expose_identifiers`): ``sagaguard.saga.id``,
``sagaguard.business_key``. Metrics: ``sagaguard.sagas`` (saga runs by outcome state) and
``sagaguard.compensations`` (compensation attempts by result: ``succeeded``, ``failed``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics, trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sagaguard.idempotency.codec import decode_error
from sagaguard.idempotency.errors import CodecError
from sagaguard.idempotency.telemetry import error_type, error_type_name, identifier_attributes, tracing
from sagaguard.saga.records import SagaOutcome, StepRecord, StepState

if TYPE_CHECKING:
    from sagaguard.saga.coordinator import SagaFlow
    from sagaguard.saga.ops import Act, Undo

__all__ = ["RunTrace", "compensation_counter", "link", "saga_counter", "traceparent", "tracer"]

tracer = trace.get_tracer("sagaguard.saga")
_meter = metrics.get_meter("sagaguard.saga")
saga_counter = _meter.create_counter(
    "sagaguard.sagas",
    unit="{saga}",
    description="Saga runs by the state they left the saga in (completed, compensated, failed, ...)",
)
compensation_counter = _meter.create_counter(
    "sagaguard.compensations",
    unit="{compensation}",
    description="Compensation attempts by result (succeeded, failed)",
)
_PROPAGATOR = TraceContextTextMapPropagator()
_QUIET: dict[str, Any] = {"record_exception": False, "set_status_on_exception": False}
"""Errors are recorded as types by hand: an exception's message may carry raw data."""


def traceparent(span: Span) -> str | None:
    """The W3C ``traceparent`` of ``span``, or None when it is not recorded (no SDK, not sampled...)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def link(text: str | None) -> list[Link]:
    """A link to the span whose ``traceparent`` is ``text``; none when it is missing or malformed."""
    if not text:
        return []
    context = trace.get_current_span(_PROPAGATOR.extract({"traceparent": text})).get_span_context()
    return [Link(context)] if context.is_valid else []


def _recorded_type(text: str | None) -> str:
    """``error.type`` of a failure recorded in the journal (its type name, never its message)."""
    if text is None:
        return "_OTHER"  # the conventions' value when the type is not known
    try:
        return error_type_name(decode_error(text).type_name)
    except CodecError:
        return "_OTHER"


class RunTrace:
    """The spans of one saga run, kept by the runner while it drives a :class:`SagaFlow`.

    Args:
        flow: the flow being driven; its step rows get their ``trace`` from :meth:`start_step`.
    """

    def __init__(self, flow: SagaFlow) -> None:
        self.flow = flow
        self._steps: dict[int, Span] = {}
        # No SDK installed: every span would be a no-op, yet building one per step (attributes,
        # contexts, a traceparent) costs a noticeable share of a no-op step. Skip them all.
        # tracing(): whether a provider other than the API's own (proxy, no-op) is set, without the
        # environment lookup get_tracer_provider() makes on every call while none is.
        self.quiet = not tracing()
        if self.quiet:
            self.span: Span = trace.INVALID_SPAN
            return
        self.span = tracer.start_span(
            f"saga {flow.saga.name}",
            kind=SpanKind.INTERNAL,
            attributes={
                "sagaguard.saga.name": flow.saga.name,
                "sagaguard.saga.version": flow.saga.version,
                **identifier_attributes(flow.saga_id),
            },
        )
        flow.trace_step = self.start_step
        flow.untrace_step = self.discard_step

    def _attrs(self, index: int) -> dict[str, Any]:
        step = self.flow.saga.steps[index]
        return {
            "sagaguard.saga.name": self.flow.saga.name,
            "sagaguard.step.name": step.name,
            "sagaguard.step.index": index,
            "sagaguard.step.kind": step.kind.value,
            **identifier_attributes(self.flow.saga_id),
        }

    def start_step(self, index: int) -> str | None:
        """Start the span of step ``index`` (about to be written STARTED); its ``traceparent``."""
        span = self._steps.pop(index, None)
        if span is not None:
            span.end()
        name = self.flow.saga.steps[index].name
        span = tracer.start_span(
            f"saga.step {name}", context=trace.set_span_in_context(self.span), attributes=self._attrs(index)
        )
        self._steps[index] = span
        return traceparent(span)

    def discard_step(self, index: int) -> None:
        """Forget the span :meth:`start_step` started for step ``index`` without ending it: a span
        that never ends is never exported (its row was not written, so it stands for nothing)."""
        self._steps.pop(index, None)

    @contextmanager
    def step(self, op: Act) -> Iterator[None]:
        """Make the step's span current while its action runs (a step resumed after a crash gets
        a new span here: its row keeps the first one's ``traceparent``)."""
        if self.quiet:
            yield
            return
        index = op.context.index
        span = self._steps.get(index)
        if span is None:
            span = tracer.start_span(
                f"saga.step {op.context.step}",
                context=trace.set_span_in_context(self.span),
                attributes={**self._attrs(index), "sagaguard.step.resumed": True},
            )
            self._steps[index] = span
        span.set_attribute("sagaguard.step.attempt", op.context.attempt)
        with trace.use_span(span, end_on_exit=False, **_QUIET):
            yield

    def written(self, rows: tuple[StepRecord, ...]) -> None:
        """After a commit: end the spans of the steps it recorded a result or failure for."""
        if not self._steps:
            return
        for row in rows:
            if row.state is StepState.STARTED:
                continue
            span = self._steps.pop(row.index, None)
            if span is None:
                continue
            span.set_attribute("sagaguard.step.state", row.state.value)
            span.set_attribute("sagaguard.step.attempts", row.attempts)
            if row.state is StepState.FAILED:
                span.set_attribute("sagaguard.step.not_applied", row.not_applied)
                span.set_attribute("error.type", _recorded_type(row.error))
                span.set_status(Status(StatusCode.ERROR))
            span.end()

    @contextmanager
    def compensation(self, op: Undo) -> Iterator[Span]:
        """A ``saga.compensate`` span, current while the compensation runs, linked to its step's."""
        if self.quiet:
            yield self.span
            return
        index = op.context.index
        attrs = {**self._attrs(index), "sagaguard.compensation.attempt": op.context.attempt}
        span = tracer.start_span(
            f"saga.compensate {op.context.step}",
            context=trace.set_span_in_context(self.span),
            links=link(op.link),
            attributes=attrs,
        )
        with trace.use_span(span, end_on_exit=True, **_QUIET):
            yield span

    def compensated(self, span: Span, error: BaseException | None) -> None:
        """Record a compensation attempt's result on its span and in the counter."""
        result = "succeeded" if error is None else "failed"
        span.set_attribute("sagaguard.compensation.result", result)
        if error is not None:
            span.set_attribute("error.type", error_type(error))
            span.set_status(Status(StatusCode.ERROR))
        compensation_counter.add(
            1, {"sagaguard.saga.name": self.flow.saga.name, "sagaguard.compensation.result": result}
        )

    @contextmanager
    def running(self) -> Iterator[None]:
        """Make the run's span current; end every span when the run returns or raises."""
        if self.quiet:
            yield
            return
        try:
            with trace.use_span(self.span, end_on_exit=False, **_QUIET):
                yield
        except BaseException as exc:
            self.span.set_attribute("error.type", error_type(exc))
            self.span.set_status(Status(StatusCode.ERROR))
            raise
        finally:
            for span in self._steps.values():
                span.end()
            self._steps.clear()
            self.flow.trace_step = None
            self.flow.untrace_step = None
            self.span.end()

    def finished(self, outcome: SagaOutcome) -> None:
        """Record where the run left the saga (call before :meth:`running` exits)."""
        if not self.quiet:  # else the span is the API's invalid one, which records nothing
            self.span.set_attribute("sagaguard.saga.state", outcome.state.value)
            self.span.set_attribute("sagaguard.saga.replayed", outcome.replayed)
        if not outcome.replayed:  # metrics may be exported without traces
            attrs = {"sagaguard.saga.name": self.flow.saga.name, "sagaguard.saga.outcome": outcome.state}
            saga_counter.add(1, attrs)
