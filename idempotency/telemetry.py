"""OpenTelemetry for guarded effects: one ``execute_tool {name}`` span per call, and a counter.

Depends on ``opentelemetry-api`` only: without an SDK configured every call here is a no-op. Raw keys,
arguments and results never go on spans (a replay is reported as ``replayed``, never as a new effect).
"""

from __future__ import annotations

import enum
from contextvars import ContextVar

from opentelemetry import metrics, trace

__all__ = ["Outcome", "TOOL_CALL_ID", "effect_counter", "tracer"]

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
