"""How ``sagaguard sagas`` shows sagas: the table, one saga with its steps and timeline, and JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import click

from sagaguard.idempotency.audit import AuditEntry
from sagaguard.idempotency.cliopts import rfc3339
from sagaguard.idempotency.cliutil import duration, pretty_json, table_lines
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.stores import open_store
from sagaguard.saga.agent.call import ToolCall
from sagaguard.saga.agent.definition import tool_outcomes
from sagaguard.saga.decisions import CallOutcome
from sagaguard.saga.records import (
    FOREVER,
    RESUMABLE_STATES,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    StepRecord,
    StepState,
)
from sagaguard.saga.timeline import timeline

__all__ = ["nested", "outcomes_of", "record_json", "show_snapshot", "step_json", "table"]


def _due(record: SagaRecord, now: float) -> str:
    """The lease left (running) or the wake-up (waiting)."""
    if record.state not in RESUMABLE_STATES:
        return "-"
    if record.lease_until >= FOREVER:
        return "never"
    if record.lease_until <= now:
        return "due now"
    return f"in {duration(record.lease_until - now)}"


def nested(text: str | None) -> Any:
    """JSON text the journal holds as a nested value (text that is not JSON stays text)."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _time(at: float) -> str | None:
    """A journal time as RFC 3339 text; None for none (0) or never (:data:`FOREVER`)."""
    return rfc3339(at) if 0 < at < FOREVER else None


def record_json(record: SagaRecord) -> dict[str, Any]:
    """A saga row as JSON types: times as RFC 3339 text (None for none or never), ``input``,
    ``output`` and ``error`` as nested values."""
    data = dataclasses.asdict(record)
    data["state"] = record.state.value
    for name, value in list(data.items()):
        if name.endswith(("_at", "_until")) or name == "deadline":
            data[name] = _time(value) if isinstance(value, int | float) else value
        elif name in ("input", "output", "result", "error") and (value is None or isinstance(value, str)):
            data[name] = nested(value)
    return data


def table(records: Sequence[SagaRecord], now: float) -> None:
    header = ("SAGA ID", "NAME", "VER", "STATE", "TOKEN", "RECOV", "WAITING FOR", "NEXT", "AGE")
    rows = [
        (
            r.saga_id if len(r.saga_id) <= 36 else r.saga_id[:33] + "...",
            r.name[:24],
            str(r.version),
            r.state.value + (" (cancel)" if r.cancel_requested and r.state in RESUMABLE_STATES else ""),
            str(r.token),
            str(r.recoveries),
            (r.waiting_for or "-") if r.state is SagaState.WAITING else "-",
            _due(r, now),
            duration(now - r.created_at),
        )
        for r in records
    ]
    for line in table_lines(header, rows):
        click.echo(line)


def outcomes_of(url: str, snapshot: SagaSnapshot) -> dict[int, CallOutcome]:
    """What an agent run's tool calls did, from the ledger on the same store URL; empty for a
    saga without tool calls, or when the ledger cannot be read (the rows then say what they know)."""
    if not any(ToolCall.of_row(row) is not None for row in snapshot.steps):
        return {}
    try:
        store = open_store(url)
    except Exception:  # the journal alone still shows the saga
        return {}
    try:
        return tool_outcomes(Guard(store), snapshot)
    except Exception:
        return {}
    finally:
        store.close()


def _step_state(row: StepRecord, outcome: CallOutcome | None) -> str:
    """A step's state as ``sagas show`` lists it: a tool call's real outcome where it is known."""
    if outcome is None or row.state is StepState.COMPENSATION_FAILED:
        return row.state.value
    if row.state is StepState.COMPENSATED:
        return CallOutcome.UNDONE.value
    return outcome.value


def show_snapshot(
    snapshot: SagaSnapshot,
    now: float,
    outcomes: Mapping[int, CallOutcome] | None = None,
    audit: Sequence[AuditEntry] = (),
) -> None:
    r = snapshot.saga
    fields = [
        ("saga id", r.saga_id),
        ("saga", f"{r.name} v{r.version}"),
        ("state", r.state.value),
        ("token", str(r.token)),
        ("recoveries", str(r.recoveries)),
        ("next", _due(r, now)),
        ("deadline", "-" if r.deadline <= 0 else duration(r.deadline - now) + " left"),
        ("waiting for", r.waiting_for if r.state is SagaState.WAITING and r.waiting_for else "-"),
        ("cancel", "requested" if r.cancel_requested else "-"),
        ("created", f"{duration(now - r.created_at)} ago"),
        ("updated", f"{duration(now - r.updated_at)} ago"),
    ]
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        click.echo(f"{name.ljust(width)}  {value}")
    click.echo("steps:")
    found = outcomes or {}
    for row in snapshot.steps:
        extra = " (not applied)" if row.not_applied else ""
        state = _step_state(row, found.get(row.index))
        click.echo(f"  {row.index}. {row.name} [{row.kind.value}] {state}{extra}")
    if snapshot.signals:
        click.echo(f"signals: {', '.join(sorted(snapshot.signals))}")
    click.echo("timeline:")
    for event in timeline(snapshot, found, audit):
        click.echo(f"  {event}")
    if r.error is not None:
        click.echo("error:")
        for line in pretty_json(r.error).splitlines():
            click.echo(f"  {line}")


def step_json(row: StepRecord, outcome: CallOutcome | None) -> dict[str, Any]:
    """A step row as JSON types (as :func:`record_json`), with a tool call's ``outcome`` or None."""
    data = dataclasses.asdict(row)
    data["kind"], data["state"] = row.kind.value, row.state.value
    for name in ("started_at", "updated_at"):
        data[name] = _time(data[name])
    for name in ("result", "error", "compensation_error"):
        data[name] = nested(data[name])
    data["outcome"] = None if outcome is None else _step_state(row, outcome)
    return data
