"""A compensation that exhausts its retries: halt (the default) or continue with the earlier ones.

The decisions are table-tested without I/O; the runs go over every journal (``tests/_sagajournals.py``:
memory and SQLite always, Postgres and Redis when they answer).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tenacity
from _sagajournals import JOURNALS, factory_for
from conftest import FakeClock

from sagaguard.idempotency import Guard, MemoryStore
from sagaguard.idempotency.codec import encode_error
from sagaguard.idempotency.effect import Retry
from sagaguard.saga import (
    CompensationPolicy,
    CompensationsFailed,
    DefinitionError,
    Saga,
    SagaJournal,
    SagaRecord,
    SagaRunner,
    SagaSnapshot,
    SagaState,
    StepContext,
    StepKind,
    StepRecord,
    StepState,
    recover,
    retry,
)
from sagaguard.saga.decisions import (
    Compensate,
    SetState,
    compensation_failure_state,
    compensation_failures,
    decide,
)

FAST = Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())
STEPS = ("a", "b", "c")


@dataclass
class Order:
    id: str


class Broken(Exception):
    """The step that fails, so the saga compensates."""


class Trip:
    """Steps a, b, c (each undoable), then ``fail`` which raises; ``undo_fail`` breaks compensations."""

    def __init__(self, policy: str | None = None, *, step_policy: dict[str, str] | None = None) -> None:
        self.undo_fail: set[str] = set()
        self.undone: list[tuple[str, str | None]] = []
        options: dict[str, Any] = {} if policy is None else {"on_compensation_failure": policy}
        s: Saga[Order] = Saga("trip", version=1, input=Order, **options)
        self.saga = s
        for name in STEPS:
            extra = (step_policy or {}).get(name)
            s.step(
                name=name,
                compensate=self._undo,
                retry=FAST,
                compensation_retry=FAST,
                on_compensation_failure=extra,
            )(self._act)

        @s.step(compensate=None, retry=FAST, not_applied=(Broken,))
        def fail(ctx: StepContext, order: Order) -> None:
            raise Broken("sold out")

    @staticmethod
    def _act(ctx: StepContext, order: Order) -> str:
        return f"{ctx.step}-{order.id}"

    def _undo(self, ctx: StepContext, order: Order, result: str | None) -> None:
        self.undone.append((ctx.step, ctx.error))
        if ctx.step in self.undo_fail:
            raise RuntimeError(f"cannot undo {ctx.step}")

    def steps_undone(self) -> list[str]:
        return [step for step, _ in self.undone]


@pytest.fixture
def journal(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[SagaJournal]:
    for factory in factory_for(request.param, clock, tmp_path):
        yield factory.open()


@pytest.fixture
def guard(clock: FakeClock) -> Iterator[Guard]:
    g = Guard(MemoryStore(clock=clock), sleep=lambda _s: None)
    yield g
    g.close()


def _runner(journal: SagaJournal, guard: Guard) -> SagaRunner:
    return SagaRunner(journal, guard, lease=30, wait=0, sleep=lambda _s: None)


def _rows(journal: SagaJournal, saga_id: str) -> dict[str, StepRecord]:
    snapshot = journal.load(saga_id)
    assert snapshot is not None
    return {row.name: row for row in snapshot.steps}


# ------------------------------------------------------------------------------------ definition


@pytest.mark.parametrize("policy", ["halt", "continue", CompensationPolicy.CONTINUE])
def test_policy_is_taken_by_value_or_enum(policy: str) -> None:
    s: Saga[Order] = Saga("t", input=Order, on_compensation_failure=policy)
    assert s.on_compensation_failure is CompensationPolicy(policy)


def test_default_is_halt_and_a_step_inherits_or_overrides() -> None:
    trip = Trip(step_policy={"b": "continue"})
    assert trip.saga.on_compensation_failure is CompensationPolicy.HALT
    policies = {step.name: step.on_compensation_failure for step in trip.saga.steps}
    assert policies == {
        "a": CompensationPolicy.HALT,
        "b": CompensationPolicy.CONTINUE,
        "c": CompensationPolicy.HALT,
        "fail": CompensationPolicy.HALT,
    }


@pytest.mark.parametrize("bad", ["skip", "", "HALT ", 1, None])
def test_a_bad_policy_is_refused_when_declared(bad: Any) -> None:
    with pytest.raises(DefinitionError, match="on_compensation_failure"):
        Saga("t", input=Order, on_compensation_failure=bad)


def test_a_bad_step_policy_is_refused_when_declared() -> None:
    s: Saga[Order] = Saga("t", input=Order)
    with pytest.raises(DefinitionError, match="step 'x'"):
        s.step(name="x", compensate=None, on_compensation_failure="ignore")(Trip._act)
    assert s.steps == []


# ------------------------------------------------------------------------------------- decisions

_NAMES = ("a", "b", "c")
_SAGA = Trip().saga
_CAUSE = encode_error(Broken("sold out"))


def _row(index: int, state: StepState, error: str | None = None) -> StepRecord:
    return StepRecord(
        index, _NAMES[index], StepKind.COMPENSATABLE, state, compensation="_undo", compensation_error=error
    )


def _snapshot(*rows: StepRecord) -> SagaSnapshot:
    record = SagaRecord("id-1", "trip", 1, "f", "{}", SagaState.COMPENSATING, 1, 100.0, 0.0, 0.0)
    return SagaSnapshot(record.evolve(error=_CAUSE), rows)


OK, C, CF = StepState.SUCCEEDED, StepState.COMPENSATED, StepState.COMPENSATION_FAILED
_B_ERR = encode_error(RuntimeError("cannot undo b"))
_A_ERR = encode_error(RuntimeError("cannot undo a"))


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (CompensationPolicy.HALT, SagaState.NEEDS_ATTENTION),
        (CompensationPolicy.CONTINUE, SagaState.COMPENSATING),
    ],
)
def test_compensation_failure_state(policy: CompensationPolicy, expected: SagaState) -> None:
    assert compensation_failure_state(policy) is expected


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        # going on past a failed compensation: the earlier ones still run, in reverse order
        ((_row(0, OK), _row(1, CF, _B_ERR), _row(2, C)), Compensate(0)),
        ((_row(0, OK), _row(1, OK), _row(2, CF, _B_ERR)), Compensate(1)),
        # none left: NEEDS_ATTENTION with the failure's cause, never COMPENSATED
        ((_row(0, C), _row(1, CF, _B_ERR), _row(2, C)), SetState(SagaState.NEEDS_ATTENTION, _B_ERR)),
        ((_row(0, C), _row(1, C), _row(2, C)), SetState(SagaState.COMPENSATED)),
    ],
)
def test_decide_after_a_failed_compensation(rows: tuple[StepRecord, ...], expected: object) -> None:
    assert decide(_SAGA, _snapshot(*rows)) == expected


def test_several_failures_are_one_cause_naming_each() -> None:
    snapshot = _snapshot(_row(0, CF, _A_ERR), _row(1, C), _row(2, CF, _B_ERR))
    move = decide(_SAGA, snapshot)
    assert isinstance(move, SetState) and move.state is SagaState.NEEDS_ATTENTION
    assert move.error == compensation_failures(snapshot)
    data = json.loads(move.error or "")
    assert data["type"] == "sagaguard.saga.errors.CompensationsFailed"
    assert "c: RuntimeError: cannot undo b; a: RuntimeError: cannot undo a" in data["message"]
    assert compensation_failures(_snapshot(_row(0, C))) is None


def test_compensations_failed_carries_its_data() -> None:
    exc = CompensationsFailed("s-1", {"b": "RuntimeError: x", "a": "OSError: y"})
    assert exc.saga_id == "s-1" and list(exc.failures) == ["b", "a"]
    assert "2 compensations failed" in str(exc)


# ------------------------------------------------------------------------------------------ runs


@pytest.mark.parametrize("journal", JOURNALS, indirect=True)
def test_halt_default_stops_at_the_failed_compensation(journal: SagaJournal, guard: Guard) -> None:
    trip = Trip()
    trip.undo_fail.add("b")
    outcome = _runner(journal, guard).run(trip.saga, "s-halt", Order("o1"))
    assert outcome.state is SagaState.NEEDS_ATTENTION
    assert outcome.error is not None and outcome.error.message == "cannot undo b"
    assert trip.steps_undone() == ["c", "b", "b"]  # a waits for an operator
    rows = _rows(journal, "s-halt")
    assert [rows[n].state for n in STEPS] == [OK, CF, C]


@pytest.mark.parametrize("journal", JOURNALS, indirect=True)
def test_continue_runs_the_earlier_compensations_then_needs_attention(
    journal: SagaJournal, guard: Guard
) -> None:
    trip = Trip("continue")
    trip.undo_fail.add("b")
    outcome = _runner(journal, guard).run(trip.saga, "s-cont", Order("o1"))
    assert outcome.state is SagaState.NEEDS_ATTENTION
    assert outcome.error is not None
    assert outcome.error.type_name == "builtins.RuntimeError" and outcome.error.message == "cannot undo b"
    assert trip.steps_undone() == ["c", "b", "b", "a"]
    # a's compensation is still told what made the saga compensate, not b's failure
    assert trip.undone[-1][1] is not None and "sold out" in trip.undone[-1][1]
    rows = _rows(journal, "s-cont")
    assert [rows[n].state for n in STEPS] == [C, CF, C]
    assert rows["b"].compensation_attempts == 2
    assert rows["b"].compensation_error is not None and "cannot undo b" in rows["b"].compensation_error
    replay = _runner(journal, guard).run(trip.saga, "s-cont", Order("o1"))
    assert replay.replayed and replay.state is SagaState.NEEDS_ATTENTION


@pytest.mark.parametrize("journal", JOURNALS, indirect=True)
def test_continue_with_several_failures_records_each_cause(journal: SagaJournal, guard: Guard) -> None:
    trip = Trip("continue")
    trip.undo_fail.update({"c", "a"})
    outcome = _runner(journal, guard).run(trip.saga, "s-two", Order("o1"))
    assert outcome.state is SagaState.NEEDS_ATTENTION
    assert outcome.error is not None
    assert outcome.error.type_name == "sagaguard.saga.errors.CompensationsFailed"
    assert "c: RuntimeError: cannot undo c; a: RuntimeError: cannot undo a" in outcome.error.message
    assert trip.steps_undone() == ["c", "c", "b", "a", "a"]
    rows = _rows(journal, "s-two")
    assert [rows[n].state for n in STEPS] == [CF, C, CF]


@pytest.mark.parametrize("journal", JOURNALS, indirect=True)
def test_continue_then_an_operator_retry_compensates(journal: SagaJournal, guard: Guard) -> None:
    trip = Trip("continue")
    trip.undo_fail.update({"c", "a"})
    assert _runner(journal, guard).run(trip.saga, "s-op", Order("o1")).state is SagaState.NEEDS_ATTENTION
    trip.undo_fail.clear()  # the fault is fixed
    assert retry(journal, "s-op").state is SagaState.COMPENSATING
    report = recover(journal, guard, trip.saga)
    assert report.outcomes["s-op"].state is SagaState.COMPENSATED
    assert trip.steps_undone()[-2:] == ["c", "a"]
    rows = _rows(journal, "s-op")
    assert [rows[n].state for n in STEPS] == [C, C, C]


@pytest.mark.parametrize("journal", ["memory", "sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("saga_policy", "step_policy", "undone", "states"),
    [
        (None, {"b": "continue"}, ["c", "b", "b", "a"], [C, CF, C]),
        ("continue", {"b": "halt"}, ["c", "b", "b"], [OK, CF, C]),
    ],
)
def test_a_step_overrides_the_saga(  # noqa: PLR0917  (pytest passes fixtures and parameters by name)
    journal: SagaJournal,
    guard: Guard,
    saga_policy: str | None,
    step_policy: dict[str, str],
    undone: list[str],
    states: list[StepState],
) -> None:
    trip = Trip(saga_policy, step_policy=step_policy)
    trip.undo_fail.add("b")
    outcome = _runner(journal, guard).run(trip.saga, "s-mix", Order("o1"))
    assert outcome.state is SagaState.NEEDS_ATTENTION
    assert trip.steps_undone() == undone
    rows = _rows(journal, "s-mix")
    assert [rows[n].state for n in STEPS] == states
