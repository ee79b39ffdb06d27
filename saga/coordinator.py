"""The saga's decisions, written once, free of I/O.

:func:`decide_start` maps a journal start to what the runner does (resume, replay, attach, refuse);
:func:`decide` maps a saga's journal snapshot to its next move; :func:`failure_state` says where a
failed step leaves the saga. All three are pure and table-tested. :class:`SagaFlow` strings them
together as a generator that *yields* the I/O it needs (:class:`Begin`, :class:`Write`,
:class:`Act`, :class:`Undo`, :class:`Sleep`) and receives the answers, so the sync and async drivers
in :mod:`saga.runner` are each a short loop (decide once, drive twice).
"""

from __future__ import annotations

import enum
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, cast

import tenacity

from idempotency.codec import decode_error, encode_error
from idempotency.effect import Retry
from idempotency.errors import CodecError
from idempotency.records import Disposition
from saga.definition import Saga, StepContext
from saga.errors import DefinitionMismatch, SagaConflict, SagaInProgress
from saga.records import (
    LIVE_STATES,
    Phase,
    SagaOutcome,
    SagaSnapshot,
    SagaState,
    StartOutcome,
    StartResult,
    StepKind,
    StepRecord,
    StepState,
)

__all__ = [
    "Act",
    "Begin",
    "Done",
    "Next",
    "RunStep",
    "SagaFlow",
    "SetState",
    "Sleep",
    "StartAction",
    "StartStep",
    "Undo",
    "Compensate",
    "Write",
    "apply",
    "decide",
    "decide_start",
    "failure_state",
]


# -- pure decisions ---------------------------------------------------------------------------


class StartAction(enum.Enum):
    """What the runner does with the result of a journal start."""

    RESUME = "resume"
    """We own the saga (new or taken over): drive it from where the journal stands."""
    REPLAY = "replay"
    """It is finished or parked: return its recorded outcome."""
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
    """Move the saga to ``state`` (nothing else is left to do in the current one)."""

    state: SagaState


@dataclass(frozen=True, slots=True)
class Done:
    """The saga is no longer live: report its outcome."""


Next = StartStep | RunStep | Compensate | SetState | Done


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


def needs_compensation(row: StepRecord) -> bool:
    """Whether a step row still has a registered compensation to run. Pure."""
    if row.compensation is None or row.kind is not StepKind.COMPENSATABLE:
        return False
    if row.state is StepState.FAILED:
        return not row.not_applied
    return row.state in (StepState.SUCCEEDED, StepState.STARTED)


def _check(saga: Saga[Any], snapshot: SagaSnapshot) -> None:
    record = snapshot.saga
    if (record.name, record.version) != (saga.name, saga.version):
        raise DefinitionMismatch(
            record.saga_id,
            f"journal has {record.name!r} v{record.version}, definition is {saga.name!r} v{saga.version}",
        )
    for row in snapshot.steps:
        if row.index >= len(saga.steps) or saga.steps[row.index].name != row.name:
            raise DefinitionMismatch(record.saga_id, f"journal step {row.index} is {row.name!r}")
        step = saga.steps[row.index]
        if row.compensation is not None and step.compensation_fn is None:
            raise DefinitionMismatch(
                record.saga_id, f"step {row.name!r} registered a compensation the definition lacks"
            )


def decide(saga: Saga[Any], snapshot: SagaSnapshot) -> Next:
    """The saga's next move, given its journal. Pure.

    Raises:
        DefinitionMismatch: the journal's name, version or steps do not match ``saga``.
    """
    _check(saga, snapshot)
    state = snapshot.saga.state
    if state not in LIVE_STATES:
        return Done()
    if state is SagaState.RUNNING:
        for step in saga.steps:
            row = snapshot.step(step.index)
            if row is None:
                return StartStep(step.index)
            if row.state is StepState.STARTED:
                return RunStep(step.index)
            if row.state is not StepState.SUCCEEDED:
                # Only a hand-edited journal gets here: failures change the saga state atomically.
                return SetState(failure_state(row.kind, row.not_applied))
        return SetState(SagaState.COMPLETED)
    for row in reversed(snapshot.steps):
        if needs_compensation(row):
            return Compensate(row.index)
    undone = any(row.state is StepState.COMPENSATED for row in snapshot.steps)
    return SetState(SagaState.COMPENSATED if undone else SagaState.FAILED)


def apply(snapshot: SagaSnapshot, phase: Phase) -> SagaSnapshot:
    """The snapshot after ``phase`` is committed (journal timestamps aside). Pure."""
    rows = {row.index: row for row in snapshot.steps}
    for row in phase.steps:
        rows[row.index] = row
    saga = snapshot.saga
    if phase.state is not None:
        saga = saga.evolve(state=phase.state, error=phase.error)
    return SagaSnapshot(saga, tuple(rows[i] for i in sorted(rows)))


# -- the I/O a flow asks its driver for ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Begin:
    """Start (create or take over) the saga in the journal. Answer: :class:`StartResult`."""


@dataclass(frozen=True, slots=True)
class Write:
    """Commit ``phase`` under ``token``. Answer: the saga row after the commit."""

    token: int
    phase: Phase


@dataclass(frozen=True, slots=True)
class Act:
    """Run the action of step ``index`` in its scope. Answer: :class:`Ran`."""

    context: StepContext


@dataclass(frozen=True, slots=True)
class Undo:
    """Run the compensation of step ``context.index`` through the guard. Answer: :class:`Ran`."""

    context: StepContext
    result: Any


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait. Answer: None."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Ran:
    """The outcome of :class:`Act` or :class:`Undo`: a value, or the exception raised."""

    value: Any = None
    error: BaseException | None = None


Op = Begin | Write | Act | Undo | Sleep

_WAIT_FIRST = 0.05
_WAIT_MAX = 1.0


class _Retrier:
    """tenacity stop and wait strategies, consulted after each failure."""

    def __init__(self, retry: Retry) -> None:
        self._retry = retry
        self._state = tenacity.RetryCallState(cast(Any, None), None, (), {})
        self.attempt = 1

    def next_pause(self, exc: BaseException) -> float | None:
        """Seconds to wait before the next try, or None to give up."""
        state = self._state
        state.attempt_number = self.attempt
        state.set_exception((type(exc), exc, exc.__traceback__))
        if self._retry.stop(state):
            return None
        self.attempt += 1
        return float(self._retry.wait(state))


class SagaFlow:
    """One saga run, as a generator of I/O requests. Drive :meth:`run` with :mod:`saga.runner`.

    Args:
        saga: the (frozen) definition.
        saga_id: the instance's id.
        input: the input value; ``input_text`` and ``fingerprint`` are its JSON and fingerprint.
        lease: seconds each commit extends the saga's lease by.
        wait: seconds to attach to a saga another runner holds before :class:`SagaInProgress`.
    """

    def __init__(
        self,
        saga: Saga[Any],
        saga_id: str,
        input: Any,
        input_text: str,
        fingerprint: str,
        *,
        lease: float,
        wait: float,
    ) -> None:
        self.saga = saga
        self.saga_id = saga_id
        self.input = input
        self.input_text = input_text
        self.fingerprint = fingerprint
        self.lease = lease
        self.wait = wait
        self.token = 0
        self.results: dict[str, Any] = {}

    def run(self) -> Generator[Op, Any, SagaOutcome]:
        """Start or attach, then go forward or compensate until the saga is no longer live."""
        started = yield from self._begin()
        snapshot = started.snapshot
        if started.outcome is StartOutcome.EXISTING:
            return self.outcome(snapshot, replayed=True)
        self.token = snapshot.saga.token
        self.results = self._decoded_results(snapshot)
        while True:
            move = decide(self.saga, snapshot)
            if isinstance(move, Done):
                return self.outcome(snapshot)
            if isinstance(move, StartStep):
                snapshot = yield from self._write(snapshot, Phase(steps=(self._started(move.index),)))
            elif isinstance(move, RunStep):
                snapshot = yield from self._run_step(snapshot, move.index)
            elif isinstance(move, Compensate):
                snapshot = yield from self._compensate(snapshot, move.index)
            else:
                phase = Phase(state=move.state, error=snapshot.saga.error)
                snapshot = yield from self._write(snapshot, phase)

    def _begin(self) -> Generator[Op, Any, StartResult]:
        saga, waited, delay = self.saga, 0.0, _WAIT_FIRST
        while True:
            started: StartResult = yield Begin()
            action = decide_start(started, name=saga.name, version=saga.version, fingerprint=self.fingerprint)
            record = started.snapshot.saga
            if action in (StartAction.RESUME, StartAction.REPLAY):
                return started
            if action is StartAction.MISMATCH:
                raise DefinitionMismatch(self.saga_id, f"it was started as {record.name!r} v{record.version}")
            if action is StartAction.CONFLICT:
                raise SagaConflict(self.saga_id, record.fingerprint, self.fingerprint)
            if waited >= self.wait:
                raise SagaInProgress(self.saga_id)
            pause = min(delay, self.wait - waited)
            yield Sleep(pause)
            waited += pause
            delay = min(delay * 2, _WAIT_MAX)

    def _write(self, snapshot: SagaSnapshot, phase: Phase) -> Generator[Op, Any, SagaSnapshot]:
        """Commit ``phase``, folding in the next move when it is only a journal write, so that
        "step i succeeded + step i+1 started" (or "+ saga completed") is one commit."""
        after = apply(snapshot, phase)
        move = decide(self.saga, after)
        if isinstance(move, StartStep):
            steps = (*phase.steps, self._started(move.index))
            phase = Phase(steps=steps, state=phase.state, error=phase.error)
        elif isinstance(move, SetState) and phase.state is None:
            phase = Phase(steps=phase.steps, state=move.state, error=after.saga.error)
        final = apply(snapshot, phase)
        live = final.saga.state in LIVE_STATES
        lease = self.lease if live else 0.0
        phase = Phase(steps=phase.steps, state=phase.state, error=phase.error, lease=lease)
        record = yield Write(self.token, phase)
        return SagaSnapshot(record, final.steps)

    def _started(self, index: int) -> StepRecord:
        step = self.saga.steps[index]
        return StepRecord(index, step.name, step.kind, StepState.STARTED, compensation=step.compensation_name)

    def context(self, index: int, attempt: int, *, error: str | None = None) -> StepContext:
        """The context handed to step ``index``'s action (or, with ``error``, its compensation)."""
        saga = self.saga
        return StepContext(
            saga_id=self.saga_id,
            saga=saga.name,
            version=saga.version,
            step=saga.steps[index].name,
            index=index,
            attempt=attempt,
            compensating=error is not None,
            error=error,
            _results=dict(self.results),
        )

    def _run_step(self, snapshot: SagaSnapshot, index: int) -> Generator[Op, Any, SagaSnapshot]:
        step = self.saga.steps[index]
        row = cast(StepRecord, snapshot.step(index))
        retrier = _Retrier(step.retry)
        while True:
            ran: Ran = yield Act(self.context(index, retrier.attempt))
            attempts = row.attempts + retrier.attempt
            if ran.error is None:
                try:
                    text = step.codec.encode(ran.value)
                except CodecError as exc:
                    # It ran but its result cannot be stored: re-running would not help.
                    error: BaseException = exc
                    not_applied = False
                    break
                self.results[step.name] = ran.value
                done = row.evolve(state=StepState.SUCCEEDED, result=text, error=None, attempts=attempts)
                return (yield from self._write(snapshot, Phase(steps=(done,))))
            error = ran.error
            if not isinstance(error, Exception):
                raise error  # cancelled or interrupted: the step stays STARTED, as after a crash
            disposition = step.disposition(error)
            if disposition is Disposition.PERMANENT:
                not_applied = True
                break
            pause = retrier.next_pause(error)
            if pause is None:
                not_applied = disposition is Disposition.RETRYABLE
                break
            yield Sleep(pause)
        text = encode_error(error)
        failed = row.evolve(state=StepState.FAILED, error=text, not_applied=not_applied, attempts=attempts)
        phase = Phase(steps=(failed,), state=failure_state(step.kind, not_applied), error=text)
        return (yield from self._write(snapshot, phase))

    def _compensate(self, snapshot: SagaSnapshot, index: int) -> Generator[Op, Any, SagaSnapshot]:
        step = self.saga.steps[index]
        row = cast(StepRecord, snapshot.step(index))
        result = None
        if row.state is StepState.SUCCEEDED and row.result is not None:
            result = step.codec.decode(row.result)
        retrier = _Retrier(step.compensation_retry)
        cause = snapshot.saga.error or encode_error(RuntimeError("compensating"))
        while True:
            ran: Ran = yield Undo(self.context(index, retrier.attempt, error=cause), result)
            attempts = row.compensation_attempts + retrier.attempt
            if ran.error is None:
                done = row.evolve(state=StepState.COMPENSATED, compensation_attempts=attempts)
                return (yield from self._write(snapshot, Phase(steps=(done,))))
            error = ran.error
            if not isinstance(error, Exception):
                raise error
            pause = retrier.next_pause(error)
            if pause is None:
                break
            yield Sleep(pause)
        text = encode_error(error)
        failed = row.evolve(
            state=StepState.COMPENSATION_FAILED, compensation_error=text, compensation_attempts=attempts
        )
        phase = Phase(steps=(failed,), state=SagaState.NEEDS_ATTENTION, error=text)
        return (yield from self._write(snapshot, phase))

    def _decoded_results(self, snapshot: SagaSnapshot) -> dict[str, Any]:
        results: dict[str, Any] = {}
        for row in snapshot.steps:
            if row.result is not None and row.index < len(self.saga.steps):
                results[row.name] = self.saga.steps[row.index].codec.decode(row.result)
        return results

    def outcome(self, snapshot: SagaSnapshot, *, replayed: bool = False) -> SagaOutcome:
        """The outcome a finished or parked snapshot reports."""
        _check(self.saga, snapshot)
        error = snapshot.saga.error
        return SagaOutcome(
            saga_id=self.saga_id,
            state=snapshot.saga.state,
            results=self._decoded_results(snapshot),
            error=None if error is None else decode_error(error),
            replayed=replayed,
        )
