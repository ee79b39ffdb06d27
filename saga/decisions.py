"""The saga's decisions, free of I/O, table-tested: what a start means, what a snapshot does next.

:func:`decide_start` maps a journal start to what the runner does (resume, replay, attach, refuse);
:func:`decide` maps a saga's journal snapshot to its next move; :func:`failed_try` says what a
step's failed try leads to (a retry, or failing for good, having applied or not);
:func:`failure_state` where a step that failed for good leaves the saga,
:func:`compensation_failure_state` where a failed compensation does;
:func:`abandon_cause`, :func:`completion_yields_to_cancel`, :func:`step_deadline` and
:func:`wake_at` say when cancellation and deadlines stop the saga going forward;
:func:`compensation_retry` says whether a failed compensation is retried in-line, parked for the
recovery worker, or given up. :mod:`sagaguard.saga.coordinator` strings them together; nothing
here reads a clock: "now" is the journal time of the snapshot's latest write (``saga.updated_at``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sagaguard.idempotency.codec import decode_error, encode_error
from sagaguard.idempotency.errors import CodecError
from sagaguard.idempotency.records import Disposition, State
from sagaguard.saga.definition import Saga
from sagaguard.saga.errors import (
    CompensationsFailed,
    DefinitionMismatch,
    SagaCancelled,
    SagaDeadlineExceeded,
    SignalTimeout,
    StepMismatch,
    StepTimeout,
)
from sagaguard.saga.records import (
    FOREVER,
    LIVE_STATES,
    RESUMABLE_STATES,
    CancelOutcome,
    CompensationPolicy,
    Phase,
    SagaSnapshot,
    SagaState,
    StartOutcome,
    StartResult,
    StepKind,
    StepRecord,
    StepState,
)

__all__ = [
    "Abandon",
    "CallOutcome",
    "Compensate",
    "Done",
    "Next",
    "RetryAction",
    "RunStep",
    "SetState",
    "StartAction",
    "StartStep",
    "abandon_cause",
    "applied",
    "apply",
    "call_outcome",
    "cancel_outcome",
    "check",
    "compensation_failure_state",
    "compensation_failures",
    "compensation_retry",
    "compensation_retry_base",
    "completion_yields_to_cancel",
    "decide",
    "decide_start",
    "fresh_undo_signal",
    "failure_state",
    "merge_steps",
    "needs_compensation",
    "pivot_failure",
    "pivot_started",
    "recovery_allowance",
    "step_deadline",
    "undo_round",
    "wake_at",
]


class StartAction(enum.Enum):
    """What the runner does with the result of a journal start."""

    RESUME = "resume"
    """We own the saga (new or taken over): drive it from where the journal stands."""
    REPLAY = "replay"
    """It is finished, parked or waiting: return its recorded outcome."""
    ATTACH = "attach"
    """Another runner holds a live lease: wait, then start again."""
    CONFLICT = "conflict"
    """Same id, other input."""
    MISMATCH = "mismatch"
    """Same id, another saga name or version."""


def decide_start(started: StartResult, *, name: str, version: int, fingerprint: str) -> StartAction:
    """The next action for a journal start. Pure."""
    if started.outcome is not StartOutcome.EXISTING:
        return StartAction.RESUME
    saga = started.snapshot.saga
    if (saga.name, saga.version) != (name, version):
        return StartAction.MISMATCH
    if saga.fingerprint != fingerprint:
        return StartAction.CONFLICT
    if saga.state in LIVE_STATES:
        return StartAction.ATTACH
    return StartAction.REPLAY


@dataclass(frozen=True, slots=True)
class StartStep:
    """Write step ``index`` STARTED with its compensation registered (no action runs yet)."""

    index: int


@dataclass(frozen=True, slots=True)
class RunStep:
    """Step ``index`` is STARTED: run its action (again, after a crash: its effects replay)."""

    index: int


@dataclass(frozen=True, slots=True)
class Compensate:
    """Run the compensation of step ``index``."""

    index: int


@dataclass(frozen=True, slots=True)
class SetState:
    """Move the saga to ``state`` (nothing else is left to do in the current one).

    ``error`` is the cause (JSON) to record with it; None keeps the saga's current one.
    """

    state: SagaState
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Abandon:
    """Stop going forward and compensate: the saga was cancelled or passed its deadline.

    ``cause`` is the error (JSON) the saga records.
    """

    cause: str


@dataclass(frozen=True, slots=True)
class Done:
    """The saga is no longer live: report its outcome."""


Next = StartStep | RunStep | Compensate | SetState | Abandon | Done


def failure_state(kind: StepKind, not_applied: bool) -> SagaState:
    """Where a step that failed for good leaves the saga. Pure.

    - compensatable: COMPENSATING (its own compensation runs unless ``not_applied``);
    - pivot: COMPENSATING when it did not apply, else NEEDS_ATTENTION: it may have happened, and
      undoing the steps before it would be wrong if it did;
    - retriable: NEEDS_ATTENTION: after the pivot the saga only goes forward.
    """
    if kind is StepKind.COMPENSATABLE or (kind is StepKind.PIVOT and not_applied):
        return SagaState.COMPENSATING
    return SagaState.NEEDS_ATTENTION


class FailedTry(enum.Enum):
    """What one failed try of a step's action leads to (:func:`failed_try`)."""

    RETRY = "retry"
    """Ask the step's retrier for a pause; when it gives none the step fails for good, having
    changed nothing (the error was *retryable*)."""
    RETRY_MAY_HAVE_APPLIED = "retry_may_have_applied"
    """The same, but a step whose retries run out may have applied (the error was *ambiguous*)."""
    FAIL = "fail"
    """The step fails for good now; it may have applied (it timed out: it may have done part)."""
    FAIL_NOT_APPLIED = "fail_not_applied"
    """The step fails for good now and changed nothing (a permanent error, a signal that never
    came): a compensatable step's own compensation is skipped, a pivot compensates before it."""
    OVERRAN = "overran"
    """The step's deadline passed while it ran: it fails for good with
    :class:`~sagaguard.saga.errors.StepTimeout` and is never run again."""


def failed_try(error: Exception, *, late: bool, disposition: Callable[[Exception], Disposition]) -> FailedTry:
    """What the failed try ``error`` of a step leads to. Pure: the step's retry budget and its
    sleep stay with the caller (a :class:`~sagaguard.idempotency.driving.Retrier`).

    ``late``: the try finished past the step's deadline. ``disposition``: the step's classifier,
    called once, and only for an error it decides (not for a timeout). A signal that timed out
    changed nothing, whenever it ends; past the deadline, anything else is the deadline's failure;
    a step that timed out by itself may have done part of its work; then the classifier: a
    permanent error changed nothing, a retryable or ambiguous one is retried (tests/test_saga_decisions.py
    holds the table).
    """
    if isinstance(error, SignalTimeout):
        return FailedTry.FAIL_NOT_APPLIED
    if late:
        return FailedTry.OVERRAN
    if isinstance(error, StepTimeout):
        return FailedTry.FAIL
    found = disposition(error)
    if found is Disposition.PERMANENT:
        return FailedTry.FAIL_NOT_APPLIED
    return FailedTry.RETRY if found is Disposition.RETRYABLE else FailedTry.RETRY_MAY_HAVE_APPLIED


def compensation_failure_state(policy: CompensationPolicy) -> SagaState:
    """Where a compensation that exhausted its retries leaves the saga. Pure.

    - halt: NEEDS_ATTENTION at once; the earlier compensations wait for an operator;
    - continue: still COMPENSATING, so the earlier compensations run; :func:`decide` ends the saga
      NEEDS_ATTENTION once none is left (see :func:`compensation_failures`).
    """
    if policy is CompensationPolicy.CONTINUE:
        return SagaState.COMPENSATING
    return SagaState.NEEDS_ATTENTION


def compensation_failures(snapshot: SagaSnapshot) -> str | None:
    """The cause (JSON) a saga records when it ends compensating with failed compensations, or
    None when none failed. Pure.

    One failure: that compensation's error. Several: :class:`~sagaguard.saga.errors.CompensationsFailed`
    naming each step (latest first) with its error's message.
    """
    failed = [row for row in reversed(snapshot.steps) if row.state is StepState.COMPENSATION_FAILED]
    if not failed:
        return None
    if len(failed) == 1:
        return failed[0].compensation_error or encode_error(RuntimeError("compensation failed"))
    failures: dict[str, str] = {}
    for row in failed:
        message = "compensation failed"
        if row.compensation_error is not None:
            try:
                info = decode_error(row.compensation_error)
                message = f"{info.type_name.rsplit('.', 1)[-1]}: {info.message}"
            except CodecError:
                message = row.compensation_error
        failures[row.name] = message
    return encode_error(CompensationsFailed(snapshot.saga.saga_id, failures))


class RetryAction(enum.Enum):
    """What the flow does after a compensation attempt failed (see :func:`compensation_retry`)."""

    RETRY_INLINE = "retry_inline"
    """Sleep the pause, then try again in this run: the caller waits."""
    RETRY_LATER = "retry_later"
    """Park the saga COMPENSATING with its lease running out at the next attempt's time and return:
    the recovery worker takes it then. The caller does not wait."""
    GIVE_UP = "give_up"
    """The retry policy is spent: the compensation failed for good."""


def compensation_retry(pause: float | None, slept: float, inline: float) -> RetryAction:
    """What to do after a failed compensation attempt. Pure.

    Args:
        pause: the retry policy's wait before the next attempt, or None when it says stop.
        slept: seconds this run has already slept between attempts of this compensation.
        inline: seconds a run may sleep in-line between attempts of one compensation; a pause that
            would take it past that parks the saga for the recovery worker instead.
    """
    if pause is None:
        return RetryAction.GIVE_UP
    if slept + pause <= inline:
        return RetryAction.RETRY_INLINE
    return RetryAction.RETRY_LATER


def compensation_retry_base(row: StepRecord) -> int:
    """The attempts of ``row``'s compensation that count against its retry policy when it is
    tried again: those already recorded once one has failed (a parked retry, or an operator's retry
    of a spent one), so the policy's stop and backoff go on across runs instead of restarting. Pure.
    """
    return row.compensation_attempts if row.compensation_error is not None else 0


def recovery_allowance(snapshot: SagaSnapshot) -> int:
    """Take-overs of the saga not counted against ``max_recoveries``. Pure.

    A compensation parked for a later retry is taken over by the recovery worker when it is due,
    which the journal counts as a recovery. Each parking follows at least one recorded attempt, so
    the recorded compensation attempts bound the parkings: the cap allows that many more.
    """
    return sum(row.compensation_attempts for row in snapshot.steps)


def needs_compensation(row: StepRecord) -> bool:
    """Whether a step row still has a registered compensation to run. Pure."""
    if row.compensation is None or row.kind is not StepKind.COMPENSATABLE:
        return False
    if row.state is StepState.FAILED:
        return not row.not_applied
    return row.state in (StepState.SUCCEEDED, StepState.STARTED)


def pivot_started(snapshot: SagaSnapshot, fresh: int | None = None) -> bool:
    """Whether the pivot (or a step after it) has a row, so the saga may only go forward. Pure.

    ``fresh`` is the index of a row the caller wrote STARTED and knows never ran: it does not count.
    """
    return any(
        row.kind is not StepKind.COMPENSATABLE and row.index != fresh and not row.not_applied
        for row in snapshot.steps
    )


def cancel_outcome(snapshot: SagaSnapshot) -> CancelOutcome:
    """What an operator's cancel does to the saga of ``snapshot``, read in the very transaction of
    the journal that records it (:meth:`~sagaguard.saga.journal.SagaJournal.cancel`). Pure.

    TOO_LATE when the saga has ended or needs attention, or when its pivot has started
    (:func:`pivot_started`): the runner would no longer honour it, so it is refused rather than
    recorded. ALREADY when a cancellation is pending or the saga is compensating anyway. Otherwise
    REQUESTED, and the journal records it. Deciding on the rows of the recording transaction is
    what keeps a cancel racing the pivot's own commit honest: either the pivot's row is there
    (TOO_LATE) or the pivot's commit comes after and finds the cancellation (the runner abandons).
    """
    saga = snapshot.saga
    if saga.state not in RESUMABLE_STATES:
        return CancelOutcome.TOO_LATE
    if saga.cancel_requested or saga.state is SagaState.COMPENSATING:
        return CancelOutcome.ALREADY
    if pivot_started(snapshot):
        return CancelOutcome.TOO_LATE
    return CancelOutcome.REQUESTED


def abandon_cause(snapshot: SagaSnapshot, fresh: int | None = None) -> str | None:
    """Why a RUNNING saga must stop going forward (its cause as JSON), or None. Pure.

    A pending cancellation, or the saga's deadline passed (as of its latest write); both only before
    the pivot started (see :func:`pivot_started`).
    """
    saga = snapshot.saga
    if saga.state is not SagaState.RUNNING:
        return None
    cancelled = saga.cancel_requested
    if not cancelled and not 0 < saga.deadline <= saga.updated_at:
        return None  # the usual case, decided without looking at the steps
    if pivot_started(snapshot, fresh):
        return None
    if cancelled:
        return saga.error or encode_error(SagaCancelled())
    return encode_error(SagaDeadlineExceeded(saga.saga_id))


def completion_yields_to_cancel(snapshot: SagaSnapshot) -> bool:
    """Whether a phase completing the saga of ``snapshot`` (its rows as the phase leaves them)
    must leave it RUNNING when a cancellation is pending, the journal checking that in the
    commit's own transaction (:attr:`~sagaguard.saga.records.Phase.unless_cancelled`). Pure.

    A cancellation that came while the last step ran (a tool call, for an agent run) is honoured
    like one between steps: every step is undone, the last one included. Only until the pivot
    started (see :func:`pivot_started`): after it the saga only goes forward, and completes.
    """
    return not pivot_started(snapshot)


def step_deadline(saga: Saga[Any], snapshot: SagaSnapshot, index: int) -> float | None:
    """When step ``index`` (STARTED) must be done: its timeout from its start and, for a step
    before the pivot, the saga's deadline; None when neither applies. Pure."""
    step = saga.steps[index]
    deadline: float | None = None
    if step.timeout is not None:
        row = snapshot.step(index)
        if row is not None:
            deadline = row.started_at + step.timeout
    if step.kind is StepKind.COMPENSATABLE:
        overall = snapshot.saga.deadline
        if overall > 0 and (deadline is None or overall < deadline):
            deadline = overall
    return deadline


def wake_at(snapshot: SagaSnapshot, wait_until: float) -> float:
    """When a saga parked with a wait deadline of ``wait_until`` (0: none) must be taken over:
    the earlier of that and, before the pivot, the saga's deadline. Pure."""
    found = [FOREVER]
    if wait_until > 0:
        found.append(wait_until)
    if snapshot.saga.deadline > 0 and not pivot_started(snapshot):
        found.append(snapshot.saga.deadline)
    return min(found)


def check(saga: Saga[Any], snapshot: SagaSnapshot) -> None:
    """Refuse a journal written by another definition. Pure.

    Raises:
        DefinitionMismatch: another name or version, or a registered compensation the step lacks.
        StepMismatch: a journal step's name differs from the definition's step at that position.
    """
    record = snapshot.saga
    if (record.name, record.version) != (saga.name, saga.version):
        raise DefinitionMismatch(
            record.saga_id,
            f"journal has {record.name!r} v{record.version}, definition is {saga.name!r} v{saga.version}",
        )
    steps = saga.steps
    count = len(steps)
    for row in snapshot.steps:
        if row.index >= count or steps[row.index].name != row.name:
            expected = steps[row.index].name if row.index < count else None
            raise StepMismatch(record.saga_id, row.index, row.name, expected)
        step = steps[row.index]
        if row.compensation is not None and step.compensation_fn is None:
            raise DefinitionMismatch(
                record.saga_id, f"step {row.name!r} registered a compensation the definition lacks"
            )


def decide(
    saga: Saga[Any], snapshot: SagaSnapshot, fresh: int | None = None, *, checked: bool = False
) -> Next:
    """The saga's next move, given its journal. Pure.

    ``fresh``: see :func:`pivot_started`. ``checked``: the caller already ran :func:`check` on
    these rows (a flow re-deciding on the rows it wrote itself from ``saga``), so it is skipped.

    Raises:
        DefinitionMismatch: the journal's name, version or steps do not match ``saga``.
    """
    if not checked:
        check(saga, snapshot)
    record = snapshot.saga
    state = record.state
    if state is SagaState.RUNNING:
        # The first step, in order, that has no row or has not succeeded (rows are ordered by
        # index, and check() keeps every index within the definition).
        steps = snapshot.steps
        pending = len(steps)
        row: StepRecord | None = None
        for position, found in enumerate(steps):
            if found.index != position:
                pending = position  # a gap: this step has no row
                break
            if found.state is not StepState.SUCCEEDED:
                pending, row = position, found
                break
        if pending >= len(saga.steps):
            if record.cancel_requested:
                # Every step succeeded, but a cancellation came while the last one ran (the
                # journal refused to complete the saga, see completion_yields_to_cancel): it is
                # honoured, every step undone, until the pivot started.
                cause = abandon_cause(snapshot, fresh)
                if cause is not None:
                    return Abandon(cause)
            return SetState(SagaState.COMPLETED)
        if record.cancel_requested or 0 < record.deadline <= record.updated_at:
            # Only then may abandon_cause() find one (the usual case is decided without calling it).
            cause = abandon_cause(snapshot, fresh)
            if cause is not None:
                return Abandon(cause)
        if row is None:
            return StartStep(pending)
        if row.state is StepState.STARTED:
            return RunStep(pending)
        # Only a hand-edited journal gets here: failures change the saga state atomically.
        return SetState(failure_state(row.kind, row.not_applied))
    if state is not SagaState.COMPENSATING:
        return Done()  # not live
    for row in reversed(snapshot.steps):
        if needs_compensation(row):
            return Compensate(row.index)
        if row.kind is StepKind.PIVOT and row.state in (StepState.SUCCEEDED, StepState.STARTED):
            break  # a pivot that ran (or may have): the steps before it are never undone
    failed = compensation_failures(snapshot)
    if failed is not None:
        return SetState(SagaState.NEEDS_ATTENTION, failed)
    undone = any(row.state is StepState.COMPENSATED for row in snapshot.steps)
    return SetState(SagaState.COMPENSATED if undone else SagaState.FAILED)


def merge_steps(rows: tuple[StepRecord, ...], new: tuple[StepRecord, ...]) -> tuple[StepRecord, ...]:
    """``rows`` (ordered by index) with each of ``new`` replacing the row at its index or added,
    still ordered by index. Pure."""
    if not new:
        return rows
    merged = list(rows)
    for row in new:
        index = row.index
        count = len(merged)
        if index < count and merged[index].index == index:
            merged[index] = row  # the usual layout: rows 0..n-1, in order
        elif index == count and (not count or merged[-1].index == index - 1):
            merged.append(row)
        else:  # gaps: by index
            by_index = {r.index: r for r in merged}
            by_index[index] = row
            merged = [by_index[i] for i in sorted(by_index)]
    return tuple(merged)


def apply(snapshot: SagaSnapshot, phase: Phase) -> SagaSnapshot:
    """The snapshot after ``phase`` is committed (journal timestamps aside). Pure."""
    return applied(snapshot, phase.steps, phase.state, phase.error)


def applied(
    snapshot: SagaSnapshot, steps: tuple[StepRecord, ...], state: SagaState | None, error: str | None
) -> SagaSnapshot:
    """:func:`apply` for a phase given by its rows, ``state`` and ``error`` (what a flow has in hand
    before it builds the phase). Pure."""
    saga = snapshot.saga
    if state is not None:
        saga = saga.evolve(state=state, error=error)
    return SagaSnapshot(saga, merge_steps(snapshot.steps, steps), snapshot.signals)


class CallOutcome(enum.StrEnum):
    """What really happened to a tool call's effect, as the timeline and ``sagas show`` report it
    (see :func:`call_outcome`)."""

    NOT_STARTED = "not started"
    """Registered, but its effect was never claimed (a crash between the two), or not yet."""
    IN_FLIGHT = "in flight"
    """Its effect is claimed by a process whose lease is live: it may be running now."""
    IN_DOUBT = "in doubt"
    """Its effect may have happened and nobody is running it: a crash cut it, or it failed in a
    way that may have applied it. The ledger's record says so until it is resolved."""
    FAILED = "failed"
    """Its effect failed and was not applied."""
    SUCCEEDED = "succeeded"
    """Its effect happened (the ledger holds its result)."""
    UNDONE = "undone"
    """Its undo ran (or an operator resolved it by hand)."""


def call_outcome(row: StepRecord, ledger: State | None, *, lease_live: bool = False) -> CallOutcome:
    """The real outcome of a tool call whose row is ``row`` and whose effect's ledger record is in
    ``ledger`` (None: no record), ``lease_live`` when that record's lease has not run out. Pure.

    An agent row records the call from its start, so the row alone cannot tell a call that
    succeeded from one that failed or was cut by a crash: the ledger can. The row wins where it
    knows more (undone, a result recorded, failed *not applied*).
    """
    if row.state is StepState.COMPENSATED:
        return CallOutcome.UNDONE
    if row.state is StepState.FAILED and row.not_applied:
        return CallOutcome.FAILED
    if ledger is State.SUCCEEDED:
        return CallOutcome.SUCCEEDED
    if ledger is State.FAILED:
        return CallOutcome.FAILED
    if ledger is State.IN_DOUBT or (ledger is State.IN_PROGRESS and not lease_live):
        return CallOutcome.IN_DOUBT
    if ledger is State.IN_PROGRESS:
        return CallOutcome.IN_FLIGHT
    return CallOutcome.NOT_STARTED


def pivot_failure(outcome: CallOutcome) -> SagaState:
    """Where a run that fails leaves its saga when its pivot's call has not recorded a result and
    the pivot's effect stands at ``outcome`` (see :func:`call_outcome`). Pure.

    - not started, failed (not applied): COMPENSATING, and the pivot row is marked *not applied*:
      it never happened, so the calls before it are undone;
    - succeeded: COMPENSATING, stopping at the pivot (it happened: the calls before it stay);
    - in doubt, in flight: NEEDS_ATTENTION, as a declared saga's pivot that may have applied: the
      calls before it must not be undone if it did, and it must never be sent again under a new
      identity. Once its record is settled (``sagaguard effects resolve``), ``sagaguard sagas
      retry`` puts the run back to RUNNING and a re-opened run replays (or re-sends under the same
      key) the pivot.
    """
    if outcome in (CallOutcome.IN_DOUBT, CallOutcome.IN_FLIGHT):
        return SagaState.NEEDS_ATTENTION
    return SagaState.COMPENSATING


_FRESH_UNDO = "sagaguard.undo.fresh."


def fresh_undo_signal(index: int, nth: int) -> str:
    """The signal an operator's ``retry(..., fresh=True)`` delivers to send step ``index``'s
    compensation again under new keys, for the ``nth`` time (1, 2, ...). Pure."""
    return f"{_FRESH_UNDO}{index}.{nth}"


def undo_round(signals: Mapping[str, str], index: int) -> int:
    """How many fresh retries step ``index``'s compensation was given (the signals of
    :func:`fresh_undo_signal` delivered to the saga): 0 runs it under its first key. Pure."""
    prefix = f"{_FRESH_UNDO}{index}."
    return sum(1 for name in signals if name.startswith(prefix))
