"""The coordinator's pure decisions, table-tested: no journal, no guard, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sagaguard.idempotency.records import Disposition
from sagaguard.saga import DefinitionMismatch, Saga, SagaState, StepContext, StepKind, StepState
from sagaguard.saga.coordinator import (
    Abandon,
    Compensate,
    Done,
    Next,
    RunStep,
    SetState,
    StartAction,
    StartStep,
    apply,
    decide,
    decide_start,
    failure_state,
    needs_compensation,
)
from sagaguard.saga.decisions import FailedTry, cancel_outcome, completion_yields_to_cancel, failed_try
from sagaguard.saga.errors import SignalTimeout, StepTimeout
from sagaguard.saga.records import (
    FINAL_STATES,
    CancelOutcome,
    Phase,
    SagaRecord,
    SagaSnapshot,
    StartOutcome,
    StartResult,
    StepRecord,
)


@dataclass
class Order:
    id: str


def undo(ctx: StepContext, order: Order, result: object) -> None: ...


def _saga() -> Saga[Order]:
    s = Saga("trip", input=Order)
    s.step(name="a", compensate=undo)(lambda ctx, o: None)
    s.step(name="b", compensate=None)(lambda ctx, o: None)
    s.step(name="c", compensate=undo)(lambda ctx, o: None)
    s.pivot(name="p")(lambda ctx, o: None)
    s.retriable(name="r")(lambda ctx, o: None)
    return s.freeze()


SAGA = _saga()
KINDS = {
    "a": StepKind.COMPENSATABLE,
    "b": StepKind.COMPENSATABLE,
    "c": StepKind.COMPENSATABLE,
    "p": StepKind.PIVOT,
    "r": StepKind.RETRIABLE,
}
NAMES = ["a", "b", "c", "p", "r"]


def _record(state: SagaState = SagaState.RUNNING, **changes: object) -> SagaRecord:
    base = SagaRecord("id-1", "trip", 1, "f1", "{}", state, 1, 100.0, 0.0, 0.0)
    return base.evolve(**changes)


def _row(index: int, state: StepState, *, not_applied: bool = False) -> StepRecord:
    name = NAMES[index]
    compensation = "undo" if name in ("a", "c") else None
    return StepRecord(index, name, KINDS[name], state, compensation=compensation, not_applied=not_applied)


S, OK, F, C, CF = (
    StepState.STARTED,
    StepState.SUCCEEDED,
    StepState.FAILED,
    StepState.COMPENSATED,
    StepState.COMPENSATION_FAILED,
)


@pytest.mark.parametrize(
    ("state", "rows", "expected"),
    [
        (SagaState.RUNNING, [], StartStep(0)),
        (SagaState.RUNNING, [S], RunStep(0)),
        (SagaState.RUNNING, [OK], StartStep(1)),
        (SagaState.RUNNING, [OK, OK, S], RunStep(2)),
        (SagaState.RUNNING, [OK, OK, OK, OK, OK], SetState(SagaState.COMPLETED)),
        # compensation: reverse order, skipping steps without a compensation
        (SagaState.COMPENSATING, [OK, OK, F], Compensate(2)),
        (SagaState.COMPENSATING, [OK, OK, C], Compensate(0)),
        (SagaState.COMPENSATING, [C, OK, C], SetState(SagaState.COMPENSATED)),
        # a crash between the effect and its record: STARTED is compensated too
        (SagaState.COMPENSATING, [OK, S], Compensate(0)),
        (SagaState.COMPENSATING, [F], Compensate(0)),  # an applied failure undoes itself
        (SagaState.COMPENSATING, [OK, OK, OK, F], Compensate(2)),
        # finished and parked sagas are not driven
        (SagaState.COMPLETED, [OK, OK, OK, OK, OK], Done()),
        (SagaState.COMPENSATED, [C], Done()),
        (SagaState.NEEDS_ATTENTION, [OK, CF], Done()),
        (SagaState.FAILED, [], Done()),
    ],
)
def test_decide(state: SagaState, rows: list[StepState], expected: Next) -> None:
    snapshot = SagaSnapshot(_record(state), tuple(_row(i, s) for i, s in enumerate(rows)))
    assert decide(SAGA, snapshot) == expected


def _plain() -> Saga[Order]:
    s = Saga("plain", input=Order)
    s.step(name="a", compensate=undo)(lambda ctx, o: None)
    s.step(name="b", compensate=undo)(lambda ctx, o: None)
    return s.freeze()


PLAIN = _plain()
"""Two compensatable steps, no pivot: a cancellation is honoured to the end."""


@pytest.mark.parametrize(
    ("saga", "rows", "record", "expected"),
    [
        # every step succeeded, no cancellation: complete
        (PLAIN, [OK, OK], {}, SetState(SagaState.COMPLETED)),
        # a cancellation came while the last step ran (the journal kept the saga RUNNING): undo all
        (PLAIN, [OK, OK], {"cancel_requested": True, "error": "why"}, "Abandon:why"),
        (PLAIN, [OK, OK], {"cancel_requested": True}, "Abandon:SagaCancelled"),
        # past the pivot a cancellation is not honoured: complete
        (SAGA, [OK, OK, OK, OK, OK], {"cancel_requested": True}, SetState(SagaState.COMPLETED)),
        # a deadline passed at the end is not a cancellation: the last step finished in time
        (PLAIN, [OK, OK], {"deadline": 10.0, "updated_at": 20.0}, SetState(SagaState.COMPLETED)),
    ],
)
def test_decide_at_the_end(
    saga: Saga[Order], rows: list[StepState], record: dict[str, object], expected: object
) -> None:
    snapshot = SagaSnapshot(
        _record(**record).evolve(name=saga.name),
        tuple(StepRecord(i, saga.steps[i].name, saga.steps[i].kind, s) for i, s in enumerate(rows)),
    )
    move = decide(saga, snapshot)
    if isinstance(expected, str):
        cause = expected.split(":", 1)[1]
        assert isinstance(move, Abandon) and cause in move.cause
    else:
        assert move == expected


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([], True),
        ([(StepKind.COMPENSATABLE, OK, False)], True),
        ([(StepKind.COMPENSATABLE, OK, False), (StepKind.COMPENSATABLE, S, False)], True),
        ([(StepKind.COMPENSATABLE, OK, False), (StepKind.PIVOT, OK, False)], False),
        ([(StepKind.COMPENSATABLE, OK, False), (StepKind.PIVOT, S, False)], False),
        # a pivot that never applied does not count: the saga may still be undone
        ([(StepKind.COMPENSATABLE, OK, False), (StepKind.PIVOT, F, True)], True),
        ([(StepKind.PIVOT, OK, False), (StepKind.RETRIABLE, OK, False)], False),
    ],
)
def test_completion_yields_to_cancel(rows: list[tuple[StepKind, StepState, bool]], expected: bool) -> None:
    steps = tuple(
        StepRecord(i, f"s{i}", kind, state, not_applied=not_applied)
        for i, (kind, state, not_applied) in enumerate(rows)
    )
    assert completion_yields_to_cancel(SagaSnapshot(_record(), steps)) is expected


PIVOT_ROWS = [(StepKind.COMPENSATABLE, OK, False), (StepKind.PIVOT, S, False)]
TOO_LATE = CancelOutcome.TOO_LATE
Rows = list[tuple[StepKind, StepState, bool]]


@pytest.mark.parametrize(
    ("state", "changes", "rows", "expected"),
    [
        (SagaState.RUNNING, {}, [], CancelOutcome.REQUESTED),
        (SagaState.WAITING, {}, [(StepKind.COMPENSATABLE, OK, False)], CancelOutcome.REQUESTED),
        (SagaState.RUNNING, {"cancel_requested": True}, [], CancelOutcome.ALREADY),
        (SagaState.COMPENSATING, {}, [(StepKind.COMPENSATABLE, OK, False)], CancelOutcome.ALREADY),
        # the pivot (or a step after it) has a row: the saga only goes forward
        (SagaState.RUNNING, {}, PIVOT_ROWS, CancelOutcome.TOO_LATE),
        (SagaState.WAITING, {}, [(StepKind.PIVOT, OK, False), (StepKind.RETRIABLE, S, False)], TOO_LATE),
        # a pivot that never applied does not count
        (SagaState.RUNNING, {}, [(StepKind.PIVOT, F, True)], CancelOutcome.REQUESTED),
        # a pending cancellation is ALREADY, whatever the steps
        (SagaState.RUNNING, {"cancel_requested": True}, PIVOT_ROWS, CancelOutcome.ALREADY),
        *[(state, {}, [], TOO_LATE) for state in sorted(FINAL_STATES | {SagaState.NEEDS_ATTENTION})],
    ],
)
def test_cancel_outcome(
    state: SagaState, changes: dict[str, object], rows: Rows, expected: CancelOutcome
) -> None:
    steps = tuple(
        StepRecord(i, f"s{i}", kind, step_state, not_applied=not_applied)
        for i, (kind, step_state, not_applied) in enumerate(rows)
    )
    assert cancel_outcome(SagaSnapshot(_record(state, **changes), steps)) is expected


def test_not_applied_failure_skips_its_own_compensation() -> None:
    rows = (_row(0, OK), _row(1, OK), _row(2, F, not_applied=True))
    assert decide(SAGA, SagaSnapshot(_record(SagaState.COMPENSATING), rows)) == Compensate(0)
    nothing = SagaSnapshot(_record(SagaState.COMPENSATING), (_row(0, F, not_applied=True),))
    assert decide(SAGA, nothing) == SetState(SagaState.FAILED)


@pytest.mark.parametrize(
    ("kind", "not_applied", "expected"),
    [
        (StepKind.COMPENSATABLE, False, SagaState.COMPENSATING),
        (StepKind.COMPENSATABLE, True, SagaState.COMPENSATING),
        (StepKind.PIVOT, True, SagaState.COMPENSATING),
        (StepKind.PIVOT, False, SagaState.NEEDS_ATTENTION),
        (StepKind.RETRIABLE, False, SagaState.NEEDS_ATTENTION),
        (StepKind.RETRIABLE, True, SagaState.NEEDS_ATTENTION),
    ],
)
def test_failure_state(kind: StepKind, not_applied: bool, expected: SagaState) -> None:
    assert failure_state(kind, not_applied) is expected


@pytest.mark.parametrize(
    ("error", "late", "disposition", "expected"),
    [
        (SignalTimeout("approved"), False, None, FailedTry.FAIL_NOT_APPLIED),  # the wait changed nothing
        (SignalTimeout("approved"), True, None, FailedTry.FAIL_NOT_APPLIED),  # late or not
        (ValueError("x"), True, None, FailedTry.OVERRAN),  # past the deadline: the deadline's failure
        (StepTimeout("a", 5), True, None, FailedTry.OVERRAN),
        (StepTimeout("a", 5), False, None, FailedTry.FAIL),  # may have done part of its work
        (ValueError("x"), False, Disposition.PERMANENT, FailedTry.FAIL_NOT_APPLIED),
        (ValueError("x"), False, Disposition.RETRYABLE, FailedTry.RETRY),
        (ValueError("x"), False, Disposition.AMBIGUOUS, FailedTry.RETRY_MAY_HAVE_APPLIED),
    ],
)
def test_failed_try(
    error: Exception, late: bool, disposition: Disposition | None, expected: FailedTry
) -> None:
    asked: list[Exception] = []

    def classify(exc: Exception) -> Disposition:
        asked.append(exc)
        assert disposition is not None, "a timeout or a late try is not the classifier's to decide"
        return disposition

    assert failed_try(error, late=late, disposition=classify) is expected
    assert asked == ([] if disposition is None else [error])  # asked once, only when it decides


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (_row(0, OK), True),
        (_row(0, S), True),
        (_row(0, F), True),
        (_row(0, F, not_applied=True), False),
        (_row(0, C), False),
        (_row(0, CF), False),
        (_row(1, OK), False),  # no compensation registered
        (_row(3, OK), False),  # the pivot
    ],
)
def test_needs_compensation(row: StepRecord, expected: bool) -> None:
    assert needs_compensation(row) is expected


@pytest.mark.parametrize(
    ("outcome", "record", "expected"),
    [
        (StartOutcome.CREATED, _record(), StartAction.RESUME),
        (StartOutcome.TOOK_OVER, _record(token=2), StartAction.RESUME),
        (StartOutcome.EXISTING, _record(), StartAction.ATTACH),
        (StartOutcome.EXISTING, _record(SagaState.COMPENSATING), StartAction.ATTACH),
        (StartOutcome.EXISTING, _record(SagaState.COMPLETED), StartAction.REPLAY),
        (StartOutcome.EXISTING, _record(SagaState.NEEDS_ATTENTION), StartAction.REPLAY),
        (StartOutcome.EXISTING, _record(SagaState.COMPLETED, fingerprint="f2"), StartAction.CONFLICT),
        (StartOutcome.EXISTING, _record(name="other"), StartAction.MISMATCH),
        (StartOutcome.EXISTING, _record(version=2), StartAction.MISMATCH),
    ],
)
def test_decide_start(outcome: StartOutcome, record: SagaRecord, expected: StartAction) -> None:
    started = StartResult(outcome, SagaSnapshot(record))
    assert decide_start(started, name="trip", version=1, fingerprint="f1") is expected


def test_mismatched_journal_is_refused() -> None:
    renamed = SagaSnapshot(_record(), (StepRecord(0, "zzz", StepKind.COMPENSATABLE, OK),))
    with pytest.raises(DefinitionMismatch, match="zzz"):
        decide(SAGA, renamed)
    rows = (*(_row(i, OK) for i in range(5)), StepRecord(5, "extra", StepKind.RETRIABLE, S))
    beyond = SagaSnapshot(_record(), rows)
    with pytest.raises(DefinitionMismatch):
        decide(SAGA, beyond)
    with pytest.raises(DefinitionMismatch):
        decide(SAGA, SagaSnapshot(_record(version=3)))


def test_apply_is_what_the_journal_will_hold() -> None:
    snapshot = SagaSnapshot(_record(), (_row(0, S),))
    phase = Phase(steps=(_row(0, OK), _row(1, S)), state=None, lease=30)
    after = apply(snapshot, phase)
    assert [r.state for r in after.steps] == [OK, S]
    assert after.saga.state is SagaState.RUNNING
    failed = apply(after, Phase(steps=(_row(1, F),), state=SagaState.COMPENSATING, error="{}"))
    assert failed.saga.state is SagaState.COMPENSATING and failed.saga.error == "{}"
