"""OpenTelemetry for guarded effects: one ``execute_tool {name}`` span per call, and a counter.

Depends on ``opentelemetry-api`` only: without an SDK configured every call here is a no-op. Raw keys,
arguments and results never go on spans (a replay is reported as ``replayed``, never as a new effect).
"""

from __future__ import annotations

import enum
import os
from contextvars import ContextVar
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.environment_variables import OTEL_PYTHON_TRACER_PROVIDER

__all__ = [
    "TOOL_CALL_ID",
    "EffectSpan",
    "Outcome",
    "counter_attributes",
    "effect_counter",
    "span_attributes",
    "tracer",
    "tracing",
]

tracer = trace.get_tracer("sagaguard.idempotency")
_meter = metrics.get_meter("sagaguard.idempotency")
effect_counter = _meter.create_counter(
    "sagaguard.effects",
    unit="{effect}",
    description="Guarded effect calls by outcome (executed, replayed, reconciled, conflict, in_doubt)",
)

TOOL_CALL_ID: ContextVar[str | None] = ContextVar("sagaguard_tool_call_id", default=None)
"""Set by framework adapters to the model's tool call id; reported as ``gen_ai.tool.call.id``."""


class Outcome(enum.StrEnum):
    """``sagaguard.effect.outcome``: what a guarded call did."""

    EXECUTED = "executed"
    REPLAYED = "replayed"
    RECONCILED = "reconciled"
    CONFLICT = "conflict"
    IN_DOUBT = "in_doubt"
    FAILED = "failed"
    BUSY = "busy"


def span_attributes(name: str) -> dict[str, str]:
    """The GenAI ``execute_tool`` attributes known before the call."""
    attrs = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.type": "function",
    }
    call_id = TOOL_CALL_ID.get()
    if call_id is not None:
        attrs["gen_ai.tool.call.id"] = call_id
    return attrs


_UNSET = object()
_FROM_ENV = OTEL_PYTHON_TRACER_PROVIDER in os.environ
_traced: list[bool] = []
"""Holds True once a real tracer provider was seen (the global can be set only once)."""


def tracing() -> bool:
    """Whether spans may be recorded: a tracer provider other than the API's no-op one is set.

    Without one every span is a non-recording no-op, so the guard skips creating and attaching it.
    Cheap on the hot path: once a real provider is seen the answer is remembered (OpenTelemetry sets
    the global provider at most once); before that, the API's global is read directly when it has
    one (``get_tracer_provider()`` looks the environment up on every call), else asked properly.
    """
    if _traced:
        return True
    if not _FROM_ENV and getattr(trace, "_TRACER_PROVIDER", _UNSET) is None:
        return False  # nothing set, and nothing to load from the environment
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return False
    _traced.append(True)
    return True


def counter_attributes(name: str) -> dict[Outcome, dict[str, str]]:
    """The outcome counter's attributes for each outcome of the effect ``name``, built once per effect.

    The dicts are shared by every call of the effect: never mutate one.
    """
    return {o: {"sagaguard.effect.outcome": o.value, "gen_ai.tool.name": name} for o in Outcome}


class _Outcome(Protocol):
    @property
    def outcome(self) -> Outcome: ...


class EffectSpan:
    """The ``execute_tool {name}`` span and the outcome counter around one guarded call.

    Args:
        name: the effect's name.
        counted: :func:`counter_attributes` of that name.
        call: what reports the call's outcome once it is over (a :class:`~idempotency.flow.Flow`).
    """

    __slots__ = ("_call", "_counted", "_name", "_span", "_token")

    def __init__(self, name: str, counted: dict[Outcome, dict[str, str]], call: _Outcome) -> None:
        self._name = name
        self._counted = counted
        self._call = call

    def __enter__(self) -> None:
        # What ``tracer.start_as_current_span(..., record_exception=False,
        # set_status_on_exception=False)`` does, without its two nested generator context managers
        # (the proxy tracer's and the real one's), which cost more than the rest of the span on a
        # hot path: start the span, make it current; __exit__ detaches it, then ends it.
        name = self._name
        span = tracer.start_span(
            f"execute_tool {name}",
            kind=trace.SpanKind.INTERNAL,
            attributes=span_attributes(name),
            record_exception=False,
            set_status_on_exception=False,
        )
        self._token = otel_context.attach(trace.set_span_in_context(span))
        self._span = span

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        span = self._span
        try:
            outcome = self._call.outcome
            if span.is_recording():
                span.set_attribute("sagaguard.effect.outcome", outcome.value)
                if tp is not None:
                    # The type only: messages may carry arguments, which stay off spans.
                    span.set_attribute("error.type", tp.__qualname__)
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
            effect_counter.add(1, self._counted[outcome])
        finally:
            otel_context.detach(self._token)
            span.end()
