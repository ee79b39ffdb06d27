"""A saga instance as a readable timeline: what ran, what was undone, how often, why, and when.

::

    for event in timeline(journal.load("order-42")):
        print(event)
    print(render(journal.load("order-42")))     # what ``sagaguard sagas show`` prints

The journal keeps two times per step (its start, its latest write), so the timeline is built from
them: a step's outcome is reported at its latest write, or at its start once it was compensated
(the latest write is then the compensation's).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sagaguard.idempotency.audit.records import AuditEntry
from sagaguard.idempotency.codec import decode_error
from sagaguard.saga.agent.call import ToolCall
from sagaguard.saga.decisions import CallOutcome
from sagaguard.saga.records import SagaSnapshot, SagaState, StepRecord, StepState

__all__ = ["Event", "operator_event", "render", "timeline"]


@dataclass(frozen=True, slots=True)
class Event:
    """One line of a timeline.

    Attributes:
        at: journal time (seconds since the epoch).
        step: the step's name, or None for the saga itself.
        what: ``created``, ``started``, ``succeeded``, ``failed``, ``compensated``, ``resolved``,
            ``compensation failed``, ``compensation retrying`` (parked for a later attempt, with
            the last attempt's error), ``resolved by hand``, ``in progress``; for an agent's tool
            call, one of :class:`~sagaguard.saga.decisions.CallOutcome`'s values or ``no result
            recorded``; or the saga's current state (its last event, with the signals delivered
            so far).
        detail: attempts, the error's type and message, the operator's note, the trace id.
    """

    at: float
    step: str | None
    what: str
    detail: str = ""
    operator: str | None = None
    """For an operator's action from the audit trail: who, and from where (``ana (console)``)."""

    def __str__(self) -> str:
        when = dt.datetime.fromtimestamp(self.at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        if self.operator:
            who = f"operator {self.operator}"
        else:
            who = "saga" if self.step is None else f"step {self.step}"
        tail = f"  ({self.detail})" if self.detail else ""
        return f"{when}  {who}: {self.what}{tail}"


def _error(text: str | None) -> str:
    if text is None:
        return ""
    info = decode_error(text)
    return f"{info.type_name.rsplit('.', 1)[-1]}: {info.message}" if info.message else info.type_name


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _trace_id(row: StepRecord) -> str:
    parts = (row.trace or "").split("-")
    return f"trace {parts[1]}" if len(parts) == 4 else ""


def _forward(row: StepRecord, at: float, tries: str, outcome: CallOutcome | None) -> Event | None:
    """The event of what a step's action did, or None when it has not ended."""
    call = ToolCall.of_row(row)
    failed = row.error is not None and row.state is not StepState.STARTED
    if call is None:  # a declared step (or the run's own row): its row says it all
        if row.result is not None or row.state is StepState.SUCCEEDED:
            return Event(at, row.name, "succeeded", tries)
        if row.error is not None:
            applied = "not applied" if row.not_applied else "may have applied"
            return Event(at, row.name, "failed", _join(tries, applied, _error(row.error)))
        return None
    # A tool call's row holds the call from its start: only ``done`` says it returned, and only
    # the ledger knows the rest (failed, in doubt, in flight, never claimed).
    if call.done:
        return Event(at, row.name, "succeeded", tries)
    if outcome is None:
        if failed:
            applied = "not applied" if row.not_applied else "may have applied"
            return Event(at, row.name, "failed", _join(applied, _error(row.error)))
        return Event(at, row.name, "no result recorded", "its effect's record says what happened")
    detail = _join("not applied" if row.not_applied else "", _error(row.error) if failed else "")
    return Event(at, row.name, outcome.value, detail)


def _step_events(row: StepRecord, outcome: CallOutcome | None) -> list[Event]:
    events = [Event(row.started_at, row.name, "started", _join(row.kind.value, _trace_id(row)))]
    tries = f"{row.attempts} attempt{'s' * (row.attempts != 1)}" if row.attempts else ""
    # Once compensated, the row's latest write is the compensation's: the forward outcome happened
    # between the start and then, and is shown at the start.
    undone = row.state in (StepState.COMPENSATED, StepState.COMPENSATION_FAILED)
    at = row.started_at if undone else row.updated_at
    forward = _forward(row, at, tries, outcome)
    if forward is not None:
        events.append(forward)
    n = row.compensation_attempts
    undo_tries = f"{n} compensation attempt{'s' * (n != 1)}"
    if row.state is StepState.COMPENSATED and row.resolution is not None:
        earlier = _error(row.compensation_error)
        detail = _join(row.resolution, f"after {undo_tries}", f"last error {earlier}" if earlier else "")
        events.append(Event(row.updated_at, row.name, "resolved by hand", detail))
    elif row.state is StepState.COMPENSATED:
        earlier = _error(row.compensation_error)
        detail = _join(undo_tries, f"earlier error {earlier}" if earlier else "")
        events.append(Event(row.updated_at, row.name, "compensated", detail))
    elif row.state is StepState.COMPENSATION_FAILED:
        detail = _join(undo_tries, _error(row.compensation_error))
        events.append(Event(row.updated_at, row.name, "compensation failed", detail))
    elif row.compensation_error is not None:
        # Parked for a later retry (still compensating): the cause is on the row, not the saga.
        detail = _join(undo_tries, _error(row.compensation_error))
        events.append(Event(row.updated_at, row.name, "compensation retrying", detail))
    elif row.state is StepState.STARTED and forward is None:
        events.append(Event(row.updated_at, row.name, "in progress", tries))
    return events


def operator_event(entry: AuditEntry) -> Event:
    """An operator's action on the saga, from the audit trail, as a timeline event."""
    args = ", ".join(f"{k}={v!r}" for k, v in entry.args.items())
    done = entry.outcome.value + (f": {entry.error}" if entry.error else "")
    return Event(entry.at, None, f"{entry.action} {done}", args, operator=f"{entry.actor} ({entry.source})")


def timeline(
    snapshot: SagaSnapshot,
    outcomes: Mapping[int, CallOutcome] | None = None,
    audit: Sequence[AuditEntry] = (),
) -> list[Event]:
    """The saga's events in time order (ties keep step order: a step's start before its outcome),
    with the operators' actions on it from the audit trail (``audit``) among them.

    Args:
        snapshot: the saga as its journal holds it.
        outcomes: for an agent run, what each tool call's effect did, by step index, as its ledger
            record says (:func:`sagaguard.saga.agent.tool_outcomes`): a tool row holds the call from
            its start, so without them a call that did not return is reported as ``no result
            recorded``.
        audit: the audit trail's entries on this saga (any order).
    """
    saga = snapshot.saga
    events = [Event(saga.created_at, None, "created", f"{saga.name} v{saga.version}")]
    found = outcomes or {}
    for row in snapshot.steps:
        events.extend(_step_events(row, found.get(row.index)))
    detail = _join(
        f"{saga.recoveries} recover{'ies' if saga.recoveries != 1 else 'y'}" if saga.recoveries else "",
        f"waiting for {saga.waiting_for!r}" if saga.state is SagaState.WAITING else "",
        "cancel requested" if saga.cancel_requested else "",
        f"signals {', '.join(sorted(snapshot.signals))}" if snapshot.signals else "",
        _error(saga.error) if saga.state is not SagaState.COMPLETED else "",
    )
    events.append(Event(saga.updated_at, None, saga.state.value, detail))
    # An action at the same instant as the saga's write it caused comes first: it caused it.
    events[-1:-1] = [operator_event(entry) for entry in sorted(audit, key=lambda e: e.at)]
    order = {id(e): i for i, e in enumerate(events)}
    return sorted(events, key=lambda e: (e.at, order[id(e)]))


def render(snapshot: SagaSnapshot, outcomes: Mapping[int, CallOutcome] | None = None) -> str:
    """The timeline as text, one event a line (``outcomes``: see :func:`timeline`)."""
    return "\n".join(str(event) for event in timeline(snapshot, outcomes))
