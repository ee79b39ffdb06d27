"""What a saga journal holds: the saga row, its step rows and one atomic commit. Plain data, no I/O.

State machine of a saga (docs/sagas.md tells the story)::

    RUNNING --a step fails, something to undo--> COMPENSATING --all undone--> COMPENSATED
    RUNNING --a step fails, nothing to undo--> FAILED
    RUNNING --last step succeeds--> COMPLETED
    RUNNING --after the pivot: forward retries exhausted; pivot failed ambiguously--> NEEDS_ATTENTION
    RUNNING --cancelled or past its deadline, before the pivot started--> COMPENSATING
    RUNNING --a step waits for a signal--> WAITING --signal, deadline or cancel; taken over--> RUNNING
    RUNNING | COMPENSATING --taken over more than the recovery cap allows--> NEEDS_ATTENTION
    COMPENSATING --a compensation exhausts its retries--> NEEDS_ATTENTION
                 (with on_compensation_failure="continue": once the earlier compensations ran)

A saga is *taken over* (by :meth:`~sagaguard.saga.journal.SagaJournal.start` or
:meth:`~sagaguard.saga.journal.SagaJournal.claim`) when it is RUNNING, COMPENSATING or WAITING and its
``lease_until`` has passed: for a running saga that is its runner's lease, for a waiting one its
wake-up time (the wait's deadline, or at once when the signal or a cancellation arrives).

and of a step::

    (no row) --started (compensation registered)--> STARTED --> SUCCEEDED | FAILED
    SUCCEEDED | STARTED | FAILED(applied) --compensation--> COMPENSATED | COMPENSATION_FAILED
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from sagaguard.idempotency.codec import ErrorInfo
from sagaguard.saga.errors import ResultUnavailable

if TYPE_CHECKING:
    from sagaguard.saga.definition import Step

R = TypeVar("R")

__all__ = [
    "FINAL_STATES",
    "FOREVER",
    "LIVE_STATES",
    "RESUMABLE_STATES",
    "CancelOutcome",
    "CompensationPolicy",
    "Phase",
    "SagaOutcome",
    "SagaRecord",
    "SagaSnapshot",
    "SagaState",
    "SignalOutcome",
    "StartOutcome",
    "StartResult",
    "StepKind",
    "StepRecord",
    "StepState",
]


class SagaState(enum.StrEnum):
    """Where a saga instance stands."""

    RUNNING = "running"
    """Going forward, one step after the other."""
    COMPENSATING = "compensating"
    """A step failed: registered compensations run in reverse order."""
    COMPLETED = "completed"
    """Every step succeeded."""
    COMPENSATED = "compensated"
    """A step failed and every compensation that had to run succeeded."""
    FAILED = "failed"
    """A step failed before anything needed undoing (no compensation had to run)."""
    NEEDS_ATTENTION = "needs_attention"
    """Parked for an operator: a compensation could not succeed, forward recovery after the pivot
    ran out of retries, the pivot failed in a way that may have applied it, recovery was attempted
    too often, or the journal no longer matches the definition. ``error`` says why."""
    WAITING = "waiting"
    """A step waits for a named signal (``waiting_for``); no process holds the saga. It is taken over
    again when the signal arrives, at the wait's deadline, or when it is cancelled."""


LIVE_STATES = frozenset({SagaState.RUNNING, SagaState.COMPENSATING})
"""States a runner drives: only these accept fenced commits."""
RESUMABLE_STATES = frozenset({SagaState.RUNNING, SagaState.COMPENSATING, SagaState.WAITING})
"""States that are taken over once ``lease_until`` has passed."""
FINAL_STATES = frozenset({SagaState.COMPLETED, SagaState.COMPENSATED, SagaState.FAILED})
"""States nothing changes any more."""

FOREVER = 253_402_300_799.0
"""``lease_until`` of a saga that waits with no deadline (9999-12-31): never taken over by time."""


class StepKind(enum.StrEnum):
    """Richardson's three kinds of saga transaction."""

    COMPENSATABLE = "compensatable"
    """Before the pivot; undone by its compensation when a later step fails."""
    PIVOT = "pivot"
    """The go/no-go point: once it succeeds, the saga only goes forward."""
    RETRIABLE = "retriable"
    """After the pivot; retried until it succeeds, never compensated."""


class StepState(enum.StrEnum):
    """Where one step of a saga instance stands."""

    STARTED = "started"
    """Its compensation is registered; the action may be running or may have crashed."""
    SUCCEEDED = "succeeded"
    """The action returned; its result is recorded."""
    FAILED = "failed"
    """The action failed for good; ``not_applied`` says whether it changed anything."""
    COMPENSATED = "compensated"
    """Its compensation succeeded."""
    COMPENSATION_FAILED = "compensation_failed"
    """Its compensation exhausted its retries; the saga needs attention."""


class CompensationPolicy(enum.StrEnum):
    """What a saga does when a compensation exhausts its retries (``on_compensation_failure=``)."""

    HALT = "halt"
    """Stop compensating: the saga needs attention at once; the earlier compensations wait for an
    operator (``retry`` or ``resolve``)."""
    CONTINUE = "continue"
    """Mark the step COMPENSATION_FAILED and run the earlier compensations still (in reverse order);
    the saga then needs attention with the cause(s), never COMPENSATED."""


@dataclass(frozen=True, slots=True)
class SagaRecord:
    """One saga instance as the journal holds it. Times are the journal's clock; JSON as text."""

    saga_id: str
    name: str
    version: int
    fingerprint: str
    """Fingerprint of the input: the same saga id with another input is a conflict."""
    input: str
    state: SagaState
    token: int
    """Fencing token: grows on every take-over; every commit must carry the current one."""
    lease_until: float
    """From when another runner may take the saga over: the runner's lease while it runs, the
    wake-up time while it waits (:data:`FOREVER` for a wait without deadline), 0 when it ended."""
    created_at: float
    updated_at: float
    """When the saga row was last written: the journal's clock at the latest commit or take-over."""
    error: str | None = None
    """Why the saga left RUNNING (the failed step's or compensation's error), as JSON; while a
    cancellation is pending, the cancellation's cause."""
    deadline: float = 0.0
    """The saga must reach its pivot by then (journal time); 0 when it has no deadline."""
    recoveries: int = 0
    """How often the saga was taken over after its runner's lease ran out (waking from WAITING does
    not count). Past the runner's ``max_recoveries`` it needs attention."""
    waiting_for: str | None = None
    """The signal the saga waits (or last waited) for."""
    wait_until: float = 0.0
    """That wait's deadline (journal time); 0 when it has none."""
    cancel_requested: bool = False
    """:func:`saga.cancel` asked for the saga to be undone; honoured before the pivot starts."""
    holder: str | None = None
    """Who took the lease last (a start, claim or take-over): the process's identity
    ``<host>|<pid>|<start time>`` (:func:`sagaguard.idempotency.holder.current`); None when unknown (a row
    written before holders were recorded). A live lease whose holder is provably dead on this host
    is taken over at once (:mod:`sagaguard.saga.lease`)."""

    def evolve(self, **changes: object) -> SagaRecord:
        """A copy with ``changes`` applied.

        Raises:
            TypeError: a change names no field.
        """
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of a saga instance. ``started_at``/``updated_at`` are stamped by the journal."""

    index: int
    name: str
    kind: StepKind
    state: StepState
    compensation: str | None = None
    """The registered compensation's name; None when the step has nothing to undo."""
    result: str | None = None
    error: str | None = None
    not_applied: bool = False
    """The failure was classified *not applied*: the step's own compensation is skipped."""
    compensation_error: str | None = None
    """Why the compensation failed (COMPENSATION_FAILED), as JSON."""
    attempts: int = 0
    compensation_attempts: int = 0
    started_at: float = 0.0
    updated_at: float = 0.0
    trace: str | None = None
    """The W3C ``traceparent`` of the step's span, written with the STARTED row, so that its
    compensation links to it even when it runs in another process (see :mod:`sagaguard.saga.telemetry`)."""
    resolution: str | None = None
    """An operator's note: the compensation was resolved by hand (:func:`sagaguard.saga.control.resolve`)."""

    def evolve(self, **changes: object) -> StepRecord:
        """A copy with ``changes`` applied.

        Raises:
            TypeError: a change names no field.
        """
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class SagaSnapshot:
    """A saga row with its step rows, ordered by index, and the signals delivered to it."""

    saga: SagaRecord
    steps: tuple[StepRecord, ...] = ()
    signals: Mapping[str, str] = field(default_factory=dict)
    """Payloads (JSON) of the signals delivered so far, by name."""

    def step(self, index: int) -> StepRecord | None:
        """The row of step ``index``, or None when it never started."""
        steps = self.steps
        if index < len(steps) and steps[index].index == index:
            return steps[index]  # rows are ordered by index and usually start at 0 without gaps
        for row in steps:
            if row.index == index:
                return row
        return None


@dataclass(frozen=True, slots=True)
class Phase:
    """One atomic journal commit: everything here is written together or not at all.

    The runner's typical phase is "step i-1 SUCCEEDED with its result + step i STARTED with its
    compensation registered", so the compensation is durable before step i touches the world.
    """

    steps: tuple[StepRecord, ...] = ()
    """Step rows to write, each replacing the row at its index (``started_at`` is kept)."""
    state: SagaState | None = None
    """The saga's new state; None keeps it."""
    error: str | None = None
    """Written with ``state`` (ignored without it): the cause of the new state, or None."""
    lease: float = 0.0
    """Seconds to extend the lease from now; 0 releases it (a phase that ends the run)."""
    waiting_for: str | None = None
    """With ``state=WAITING``: the signal the saga waits for."""
    wait_until: float = 0.0
    """With ``state=WAITING``: the wait's deadline (journal time), 0 for none."""
    wake_at: float = FOREVER
    """With ``state=WAITING``: the saga's new ``lease_until`` (the earlier of the wait's and the
    saga's deadline). The journal makes it *now* instead when the awaited signal is already
    recorded or (with ``wake_on_cancel``) a cancellation is pending, so a signal or cancellation
    that raced the parking is never lost."""
    wake_on_cancel: bool = True
    """With ``state=WAITING``: whether a pending cancellation makes the saga due at once (False once
    the pivot has started, when a cancellation is no longer honoured)."""
    unless_cancelled: bool = False
    """With ``state=COMPLETED``: complete the saga only if no cancellation is pending, checked in
    the same transaction. With one pending, the step rows are written all the same but the saga
    stays RUNNING with its error (the cancellation's cause) and its lease renewed by ``lease``, so
    its runner compensates instead (a cancellation that came while the last step ran is honoured).
    Without one, the saga completes and its lease is released (0) whatever ``lease`` says. Set by
    :func:`~sagaguard.saga.decisions.completion_yields_to_cancel` (False once the pivot has started)."""


class StartOutcome(enum.StrEnum):
    """What :meth:`SagaJournal.start` did."""

    CREATED = "created"
    """No saga had this id: the caller owns a new RUNNING saga (token 1)."""
    TOOK_OVER = "took_over"
    """A resumable saga whose ``lease_until`` passed, with the same name, version and input: the
    caller owns it under a new token and resumes it (a WAITING saga becomes RUNNING)."""
    EXISTING = "existing"
    """Anything else (finished, parked, leased by another runner, other input): unchanged."""


class SignalOutcome(enum.StrEnum):
    """What :meth:`SagaJournal.signal` did."""

    DELIVERED = "delivered"
    """Recorded; a saga waiting for it is due at once."""
    DUPLICATE = "duplicate"
    """A signal of that name was already recorded: the first one is kept, this one dropped."""
    TOO_LATE = "too_late"
    """The saga has ended (or needs attention): nothing was recorded."""


class CancelOutcome(enum.StrEnum):
    """What :func:`saga.cancel` did."""

    REQUESTED = "requested"
    """Recorded: the saga compensates at its runner's next step boundary (a waiting saga, or one
    nobody holds, when the recovery sweeper takes it over)."""
    ALREADY = "already"
    """A cancellation was already pending, or the saga is already compensating."""
    TOO_LATE = "too_late"
    """The saga has ended, needs attention, or has started its pivot (after which it only goes
    forward): nothing was recorded."""


@dataclass(frozen=True, slots=True)
class StartResult:
    """The outcome of a start with the saga and its steps as they stand after it."""

    outcome: StartOutcome
    snapshot: SagaSnapshot


@dataclass(frozen=True, slots=True)
class SagaOutcome:
    """What a saga run ended with (or, for a parked saga, where it stands).

    Attributes:
        saga_id: the caller-given id.
        state: COMPLETED, COMPENSATED, FAILED or NEEDS_ATTENTION; WAITING when a step waits for a
            signal (the runner returned without holding anything).
        results: the decoded result of every step that recorded one, by step name.
        error: why the saga did not complete (the failed step's or compensation's error), or None.
        replayed: True when the outcome was already recorded before this call.
        waiting_for: the signal a WAITING saga waits for, else None.
    """

    saga_id: str
    state: SagaState
    results: Mapping[str, Any] = field(default_factory=dict)
    error: ErrorInfo | None = None
    replayed: bool = False
    waiting_for: str | None = None

    @property
    def completed(self) -> bool:
        """Whether every step succeeded."""
        return self.state is SagaState.COMPLETED

    def result(self, step: Step[Any, R]) -> R:
        """The recorded result of ``step``.

        Raises:
            ResultUnavailable: the step recorded no result.
        """
        if step.name not in self.results:
            raise ResultUnavailable(step.name)
        return self.results[step.name]  # type: ignore[no-any-return]
