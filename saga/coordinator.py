"""One saga run as a generator of I/O requests: :class:`SagaFlow` (decide once, drive twice).

The flow strings the pure decisions of :mod:`sagaguard.saga.decisions` together and *yields* the I/O it needs
(:class:`Begin`, :class:`Claim`, :class:`Write`, :class:`Act`, :class:`Undo`, :class:`Sleep`) and
receives the answers, so the sync and async drivers in :mod:`sagaguard.saga.runner` are each a short loop.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from sagaguard.idempotency.codec import decode_error, encode_error
from sagaguard.idempotency.driving import Retrier
from sagaguard.idempotency.effect import Retry
from sagaguard.idempotency.errors import CodecError
from sagaguard.saga.decisions import (
    Abandon,
    Compensate,
    Done,
    FailedTry,
    Next,
    RetryAction,
    RunStep,
    SetState,
    StartAction,
    StartStep,
    applied,
    apply,
    check,
    compensation_failure_state,
    compensation_retry,
    compensation_retry_base,
    completion_yields_to_cancel,
    decide,
    decide_start,
    failed_try,
    failure_state,
    merge_steps,
    needs_compensation,
    pivot_started,
    recovery_allowance,
    step_deadline,
    wake_at,
)
from sagaguard.saga.definition import Saga, Step, StepContext
from sagaguard.saga.errors import (
    DefinitionMismatch,
    NothingToUndo,
    RecoveryExhausted,
    SagaConflict,
    SagaInProgress,
    SagaSuspended,
    StepTimeout,
    UnknownSaga,
)
from sagaguard.saga.ops import Act, Begin, Claim, Op, Ran, Sleep, Undo, Write
from sagaguard.saga.records import (
    LIVE_STATES,
    Phase,
    SagaOutcome,
    SagaSnapshot,
    SagaState,
    StartOutcome,
    StartResult,
    StepRecord,
    StepState,
)

if TYPE_CHECKING:
    from sagaguard.saga.registry import SagaRegistry

__all__ = [
    "Abandon",
    "Act",
    "Begin",
    "Claim",
    "Compensate",
    "Done",
    "Next",
    "Ran",
    "RunStep",
    "SagaFlow",
    "SetState",
    "Sleep",
    "StartAction",
    "StartStep",
    "Undo",
    "Write",
    "apply",
    "decide",
    "decide_start",
    "failure_state",
    "needs_compensation",
]


_RECLAIMS = 8
"""Times in a row a flow takes back a saga that was due the moment it parked, before it leaves it
to the recovery sweeper (a safety bound: a delivered signal ends the wait on the first)."""
_WAIT_FIRST = 0.05
_WAIT_MAX = 1.0


@dataclass(frozen=True, slots=True)
class _Budget:
    """A step's (or compensation's) retry strategies, for :class:`~sagaguard.idempotency.driving.Retrier`:
    every failure it is handed may be retried (the flow has already decided which are)."""

    retry: Retry

    def retries(self, exc: BaseException) -> bool:
        return True


_NO_WAIT = Phase()
"""The wait fields of a phase that does not park the saga."""



def _overran(step: Step[Any, Any], deadline: float | None, row: StepRecord) -> StepTimeout:
    """The error of a step that ran (or would run) past its deadline."""
    return StepTimeout(step.name, (deadline or 0.0) - row.started_at)


def _stamped(rows: tuple[StepRecord, ...], stamp: float) -> tuple[StepRecord, ...]:
    """``rows`` with those written STARTED just now (``started_at`` 0) started at ``stamp``; ``rows``
    itself when none was."""
    out: list[StepRecord] | None = None
    for position, row in enumerate(rows):
        if row.state is StepState.STARTED and row.started_at == 0:
            if out is None:
                out = list(rows)
            out[position] = row.evolve(started_at=stamp)
    return rows if out is None else tuple(out)


class SagaFlow:
    """One saga run, as a generator of I/O requests. Drive :meth:`run` with :mod:`sagaguard.saga.runner`.

    Args:
        saga: the (frozen) definition.
        saga_id: the instance's id.
        input: the input value; ``input_text`` and ``fingerprint`` are its JSON and fingerprint.
        lease: seconds each commit extends the saga's lease by.
        wait: seconds to attach to a saga another runner holds before :class:`SagaInProgress`.
        max_recoveries: take-overs after a lost lease a saga may have before it needs attention;
            None for no cap.
        registry: where the definition of another version of this saga is found, so an instance
            started on that version finishes on it.
        compensation_inline: seconds the flow may sleep between attempts of one failing
            compensation before it parks the saga for the recovery worker (see
            :func:`~sagaguard.saga.decisions.compensation_retry`).
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
        max_recoveries: int | None = None,
        registry: SagaRegistry | None = None,
        compensation_inline: float = 2.0,
    ) -> None:
        self.saga = saga
        self.saga_id = saga_id
        self.input = input
        self.input_text = input_text
        self.fingerprint = fingerprint
        self.lease = lease
        self.wait = wait
        self.max_recoveries = max_recoveries
        self.registry = registry
        self.compensation_inline = compensation_inline
        self.token = 0
        self._parked = False
        """Set when a failing compensation parked the saga for a later retry: the run ends there."""
        self.results: dict[str, Any] = {}
        self.signals: dict[str, str] = {}
        self._fresh: int | None = None
        """A step this flow wrote STARTED and has not run yet (a cancellation fails it unrun)."""
        self.trace_step: Callable[[int], str | None] | None = None
        """Set by the driver: starts step ``index``'s span and returns its ``traceparent``, which
        is written with the step's STARTED row (see :mod:`sagaguard.saga.telemetry`)."""
        self.untrace_step: Callable[[int], None] | None = None
        """Set by the driver: forgets the span :attr:`trace_step` started for a row that was not
        written after all (the first step's, when the start did not create the saga)."""

    @classmethod
    def claimed(
        cls,
        saga: Saga[Any],
        snapshot: SagaSnapshot,
        *,
        lease: float,
        max_recoveries: int | None = None,
        compensation_inline: float = 2.0,
    ) -> SagaFlow:
        """A flow for a saga already taken over with ``journal.claim``; drive :meth:`resume`.

        Raises:
            CodecError: the recorded input does not read back as the definition's input type.
        """
        record = snapshot.saga
        value = saga.input_codec.decode(record.input)
        flow = cls(
            saga, record.saga_id, value, record.input, record.fingerprint,
            lease=lease, wait=0.0, max_recoveries=max_recoveries, compensation_inline=compensation_inline,
        )  # fmt: skip
        return flow

    def run(self) -> Generator[Op, Any, SagaOutcome]:
        """Start or attach, then go forward or compensate until the saga ends or waits."""
        started = yield from self._begin()
        if started.outcome is StartOutcome.EXISTING:
            return self.outcome(started.snapshot, replayed=True)
        return (yield from self.resume(started.snapshot))

    def resume(self, snapshot: SagaSnapshot) -> Generator[Op, Any, SagaOutcome]:
        """Drive a saga this flow has just created or taken over (``snapshot`` is after that)."""
        for attempt in range(_RECLAIMS):
            self.token = snapshot.saga.token
            self.signals = dict(snapshot.signals)
            self.results = self._decoded_results(snapshot)
            self._fresh = None
            self._parked = False
            check(self.saga, snapshot)  # the journal's rows, once per take-over
            snapshot = yield from self._cap_recoveries(snapshot)
            snapshot = yield from self._drive(snapshot)
            saga = snapshot.saga
            due = saga.state is SagaState.WAITING and saga.lease_until <= saga.updated_at
            if due and attempt < _RECLAIMS - 1:
                # The awaited signal (or a cancellation) was already there when we parked.
                claimed: SagaSnapshot | None = yield Claim()
                if claimed is not None:
                    snapshot = claimed
                    continue
            break
        return self.outcome(snapshot)

    def _cap_recoveries(self, snapshot: SagaSnapshot) -> Generator[Op, Any, SagaSnapshot]:
        record = snapshot.saga
        limit = self.max_recoveries
        if limit is None or record.state not in LIVE_STATES:
            return snapshot
        if record.recoveries <= limit + recovery_allowance(snapshot):  # parked retries do not count
            return snapshot
        error = encode_error(RecoveryExhausted(self.saga_id, record.recoveries, limit))
        return (yield from self._write(snapshot, Phase(state=SagaState.NEEDS_ATTENTION, error=error)))

    def _drive(self, snapshot: SagaSnapshot) -> Generator[Op, Any, SagaSnapshot]:
        while True:
            # Checked by resume(); every later snapshot holds the rows this flow wrote from the saga.
            move: Next = decide(self.saga, snapshot, self._fresh, checked=True)
            # The moves are disjoint types: the one every step takes is tested first.
            if isinstance(move, RunStep):
                self._fresh = None
                snapshot = yield from self._run_step(snapshot, move.index)
            elif isinstance(move, Done):
                return snapshot
            elif isinstance(move, StartStep):
                snapshot = yield from self._commit(snapshot, (self._started(move.index),))
                self._fresh = move.index
            elif isinstance(move, Compensate):
                snapshot = yield from self._compensate(snapshot, move.index)
                if self._parked:
                    return snapshot  # the recovery worker retries it when its lease runs out
            elif isinstance(move, Abandon):
                snapshot = yield from self._abandon(snapshot, move.cause)
            else:
                error = snapshot.saga.error if move.error is None else move.error
                snapshot = yield from self._commit(snapshot, (), move.state, error)

    def _begin(self) -> Generator[Op, Any, StartResult]:
        waited, delay = 0.0, _WAIT_FIRST
        # A new saga's first move is always "start step 0" (decide: no rows, no cancellation yet,
        # its deadline ahead), so that row goes with the start: creating the saga and registering
        # the first compensation is one commit. Only the first start can create the saga.
        first = self._started(0) if self.saga.steps else None
        while True:
            started: StartResult = yield Begin(first)
            if first is not None and started.outcome is not StartOutcome.CREATED:
                if self.untrace_step is not None:
                    self.untrace_step(0)  # that row was not written: its span never happened
                first = None
            saga = self.saga
            action = decide_start(started, name=saga.name, version=saga.version, fingerprint=self.fingerprint)
            record = started.snapshot.saga
            if action in (StartAction.RESUME, StartAction.REPLAY):
                return started
            if action is StartAction.MISMATCH:
                self._switch_version(started)
                continue
            if action is StartAction.CONFLICT:
                raise SagaConflict(self.saga_id, record.fingerprint, self.fingerprint)
            if waited >= self.wait:
                raise SagaInProgress(self.saga_id)
            pause = min(delay, self.wait - waited)
            yield Sleep(pause, 0)
            waited += pause
            delay = min(delay * 2, _WAIT_MAX)

    def _switch_version(self, started: StartResult) -> None:
        """Finish an instance on the version that started it, when the registry has it."""
        record = started.snapshot.saga
        mismatch = DefinitionMismatch(self.saga_id, f"it was started as {record.name!r} v{record.version}")
        if self.registry is None or record.name != self.saga.name:
            raise mismatch
        try:
            other = self.registry.get(record.name, record.version)
        except UnknownSaga as exc:
            raise mismatch from exc
        self.saga = other
        self.input = other.input_codec.decode(record.input)
        self.input_text = record.input

    def _write(
        self, snapshot: SagaSnapshot, phase: Phase, lease: float | None = None
    ) -> Generator[Op, Any, SagaSnapshot]:
        """Commit ``phase`` (see :meth:`_commit`; its lease is the flow's, or ``lease``)."""
        return (yield from self._commit(snapshot, phase.steps, phase.state, phase.error, phase, lease=lease))

    def _commit(
        self,
        snapshot: SagaSnapshot,
        steps: tuple[StepRecord, ...],
        state: SagaState | None = None,
        error: str | None = None,
        wait: Phase = _NO_WAIT,
        *,
        lease: float | None = None,
    ) -> Generator[Op, Any, SagaSnapshot]:
        """Commit the phase of ``steps``, ``state`` and ``error`` (with the wait fields of
        ``wait``), folding in the next move when it is only a journal write, so that "step i
        succeeded + step i+1 started" (or "+ saga completed") is one commit. A live saga's lease
        is the flow's, or ``lease`` seconds when given."""
        after = applied(snapshot, steps, state, error)
        move = decide(self.saga, after, checked=True)
        given = steps
        fresh: StepRecord | None = None
        if state is None:
            if isinstance(move, StartStep):
                fresh = self._started(move.index)
                steps = (*steps, fresh)
            elif isinstance(move, SetState):
                state = move.state
                error = after.saga.error if move.error is None else move.error
        now = snapshot.saga.state if state is None else state
        # Completing, the saga stays RUNNING (and leased) if a cancellation that came meanwhile is
        # still honoured: decide() then abandons it.
        unless_cancelled = now is SagaState.COMPLETED and completion_yields_to_cancel(after)
        live = now in LIVE_STATES or unless_cancelled
        phase = Phase(
            steps=steps,
            state=state,
            error=error,
            lease=(self.lease if lease is None else lease) if live else 0.0,
            waiting_for=wait.waiting_for,
            wait_until=wait.wait_until,
            wake_at=wait.wake_at,
            wake_on_cancel=wait.wake_on_cancel,
            unless_cancelled=unless_cancelled,
        )
        record = yield Write(self.token, phase)
        if fresh is not None:
            self._fresh = fresh.index
        # Rows written STARTED just now started at the commit's time (the journal stamps it so).
        stamp = record.updated_at
        stamped = _stamped(given, stamp)
        # The rows after the commit are the rows apply() predicted, unless stamping changed one.
        rows = after.steps if stamped is given else merge_steps(snapshot.steps, stamped)
        if fresh is not None:  # STARTED, started_at 0: see _started()
            rows = merge_steps(rows, (fresh.evolve(started_at=stamp),))
        return SagaSnapshot(record, rows, snapshot.signals)

    def _started(self, index: int) -> StepRecord:
        """Step ``index``'s row to write STARTED (``started_at`` 0: the journal stamps it), with
        the ``traceparent`` of the span :attr:`trace_step` starts for it."""
        row = self.saga.started_row(index)
        if self.trace_step is None:
            return row
        trace = self.trace_step(index)
        return row if trace is None else row.evolve(trace=trace)

    def context(
        self, index: int, attempt: int, *, error: str | None = None, snapshot: SagaSnapshot | None = None
    ) -> StepContext:
        """The context handed to step ``index``'s action (or, with ``error``, its compensation)."""
        deadline = None
        if snapshot is not None and error is None:
            deadline = step_deadline(self.saga, snapshot, index)
        return self._context(index, attempt, error, snapshot, deadline)

    def _context(
        self,
        index: int,
        attempt: int,
        error: str | None,
        snapshot: SagaSnapshot | None,
        deadline: float | None,
    ) -> StepContext:
        saga = self.saga
        record = None if snapshot is None else snapshot.saga
        return StepContext(
            saga_id=self.saga_id,
            saga=saga.name,
            version=saga.version,
            step=saga.steps[index].name,
            index=index,
            attempt=attempt,
            compensating=error is not None,
            error=error,
            deadline=deadline,
            now=0.0 if record is None else record.updated_at,
            _results=self.results.copy(),
            _signals=self.signals.copy(),
            _wait=(None, 0.0) if record is None else (record.waiting_for, record.wait_until),
        )

    def _abandon(self, snapshot: SagaSnapshot, cause: str) -> Generator[Op, Any, SagaSnapshot]:
        steps: tuple[StepRecord, ...] = ()
        fresh = None if self._fresh is None else snapshot.step(self._fresh)
        if fresh is not None and fresh.state is StepState.STARTED:
            # Written STARTED by this flow and never run: it changed nothing.
            steps = (fresh.evolve(state=StepState.FAILED, error=cause, not_applied=True),)
        self._fresh = None
        return (
            yield from self._write(snapshot, Phase(steps=steps, state=SagaState.COMPENSATING, error=cause))
        )

    def _run_step(self, snapshot: SagaSnapshot, index: int) -> Generator[Op, Any, SagaSnapshot]:
        step = self.saga.steps[index]
        row = cast(StepRecord, snapshot.step(index))
        retrier: Retrier | None = None  # built on the first failure only
        attempt = 1
        deadline = step_deadline(self.saga, snapshot, index)
        not_applied = False
        attempts = row.attempts
        if deadline is not None and snapshot.saga.updated_at >= deadline:
            # It overran before a crash: never run it again.
            error: BaseException = _overran(step, deadline, row)
        else:
            while True:
                ctx = self._context(index, attempt, None, snapshot, deadline)
                ran: Ran = yield Act(ctx, self.token)
                attempts = row.attempts + attempt
                failure = ran.error
                finished = ran.finished_at
                late = deadline is not None and finished is not None and finished >= deadline
                if failure is None:
                    if late:
                        error = _overran(step, deadline, row)
                        break
                    try:
                        text = step.codec.encode(ran.value)
                    except CodecError as exc:
                        # It ran but its result cannot be stored: re-running would not help.
                        error = exc
                        break
                    self.results[step.name] = ran.value
                    done = row.evolve(state=StepState.SUCCEEDED, result=text, error=None, attempts=attempts)
                    return (yield from self._commit(snapshot, (done,)))
                if isinstance(failure, SagaSuspended):
                    return (yield from self._park(snapshot, failure, finished))
                if not isinstance(failure, Exception):
                    raise failure  # cancelled or interrupted: the step stays STARTED, as after a crash
                error = failure
                verdict = failed_try(failure, late=late, disposition=step.disposition)
                if verdict is FailedTry.OVERRAN:
                    error = _overran(step, deadline, row)
                    break
                if verdict in (FailedTry.FAIL, FailedTry.FAIL_NOT_APPLIED):
                    not_applied = verdict is FailedTry.FAIL_NOT_APPLIED
                    break
                if retrier is None:
                    retrier = Retrier(_Budget(step.retry))
                pause = retrier.next_pause(error)
                if pause is None:
                    not_applied = verdict is FailedTry.RETRY
                    break
                if deadline is not None and finished is not None and finished + pause >= deadline:
                    error = _overran(step, deadline, row)
                    break
                yield Sleep(pause, self.token)
                attempt = retrier.attempt
        text = encode_error(error)
        failed = row.evolve(state=StepState.FAILED, error=text, not_applied=not_applied, attempts=attempts)
        return (yield from self._commit(snapshot, (failed,), failure_state(step.kind, not_applied), text))

    def _park(
        self, snapshot: SagaSnapshot, suspended: SagaSuspended, now: float | None
    ) -> Generator[Op, Any, SagaSnapshot]:
        """Park the saga as WAITING for ``suspended.signal``; the step row stays STARTED."""
        record = snapshot.saga
        if now is None:
            now = record.updated_at
        if record.waiting_for == suspended.signal:
            wait_until = record.wait_until  # waiting again after a take-over: the first deadline holds
        elif suspended.deadline is not None:
            wait_until = suspended.deadline
        elif suspended.timeout is not None:
            wait_until = now + suspended.timeout
        else:
            wait_until = 0.0
        phase = Phase(
            state=SagaState.WAITING,
            error=record.error,
            waiting_for=suspended.signal,
            wait_until=wait_until,
            wake_at=wake_at(snapshot, wait_until),
            wake_on_cancel=not pivot_started(snapshot),
        )
        return (yield from self._write(snapshot, phase))

    def _compensate(self, snapshot: SagaSnapshot, index: int) -> Generator[Op, Any, SagaSnapshot]:
        step = self.saga.steps[index]
        row = cast(StepRecord, snapshot.step(index))
        result = None
        if row.state is StepState.SUCCEEDED and row.result is not None:
            result = step.codec.decode(row.result)
        retrier = Retrier(_Budget(step.compensation_retry), first=1 + compensation_retry_base(row))
        cause = snapshot.saga.error or encode_error(RuntimeError("compensating"))
        tries, slept = 0, 0.0
        while True:
            ctx = self.context(index, retrier.attempt, error=cause, snapshot=snapshot)
            ran: Ran = yield Undo(ctx, result, self.token, row.trace)
            tries += 1
            attempts = row.compensation_attempts + tries
            if ran.error is None:
                done = row.evolve(state=StepState.COMPENSATED, compensation_attempts=attempts)
                return (yield from self._write(snapshot, Phase(steps=(done,))))
            error = ran.error
            if isinstance(error, NothingToUndo):
                # Its effect never happened: the step failed *not applied*; nothing was undone.
                skipped = row.evolve(state=StepState.FAILED, error=encode_error(error), not_applied=True)
                return (yield from self._write(snapshot, Phase(steps=(skipped,))))
            if not isinstance(error, Exception):
                raise error
            pause = retrier.next_pause(error)
            action = compensation_retry(pause, slept, self.compensation_inline)
            if action is RetryAction.GIVE_UP or pause is None:
                break
            if action is RetryAction.RETRY_LATER:
                # Parked COMPENSATING, its lease ending when the next attempt is due: the caller
                # returns now and the recovery worker takes the saga over then.
                pending = row.evolve(compensation_error=encode_error(error), compensation_attempts=attempts)
                self._parked = True
                return (yield from self._write(snapshot, Phase(steps=(pending,)), lease=max(pause, 1e-3)))
            yield Sleep(pause, self.token)
            slept += pause
        text = encode_error(error)
        failed = row.evolve(
            state=StepState.COMPENSATION_FAILED, compensation_error=text, compensation_attempts=attempts
        )
        state = compensation_failure_state(step.on_compensation_failure)
        # Going on, the saga keeps its cause (the next compensations are told it); the failures
        # are recorded with the saga once none is left to run (decide: compensation_failures).
        recorded = text if state is SagaState.NEEDS_ATTENTION else cause
        phase = Phase(steps=(failed,), state=state, error=recorded)
        return (yield from self._write(snapshot, phase))

    def _decoded_results(self, snapshot: SagaSnapshot) -> dict[str, Any]:
        results: dict[str, Any] = {}
        steps = self.saga.steps
        count = len(steps)
        for row in snapshot.steps:
            if row.result is not None and row.index < count:
                results[row.name] = steps[row.index].codec.decode(row.result)
        return results

    def outcome(self, snapshot: SagaSnapshot, *, replayed: bool = False) -> SagaOutcome:
        """The outcome a finished, parked or waiting snapshot reports."""
        check(self.saga, snapshot)
        record = snapshot.saga
        error = record.error
        waiting = record.state is SagaState.WAITING
        return SagaOutcome(
            saga_id=self.saga_id,
            state=record.state,
            results=self._decoded_results(snapshot),
            error=None if error is None or waiting else decode_error(error),
            replayed=replayed,
            waiting_for=record.waiting_for if waiting else None,
        )
