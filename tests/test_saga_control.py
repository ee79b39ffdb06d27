"""Cancellation, per-step and per-saga timeouts, and versioning through a registry.

Time is the injected clock (a step "takes" an hour by advancing it); the one async timeout test
cancels a real coroutine after 50 ms.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _sagajournals import JOURNALS, JournalFactory, factory_for
from conftest import FakeClock

from sagaguard.idempotency import Guard
from sagaguard.saga import (
    CancelOutcome,
    DefinitionError,
    DefinitionMismatch,
    LeaseRenewer,
    LostSagaLease,
    Saga,
    SagaJournal,
    SagaNotFound,
    SagaRegistry,
    SagaRunner,
    SagaState,
    StepContext,
    StepMismatch,
    StepState,
    UnknownSaga,
    cancel,
    recover,
    signal,
)
from sagaguard.saga.decisions import abandon_cause, step_deadline, wake_at
from sagaguard.saga.records import FOREVER, SagaRecord, SagaSnapshot, StepKind, StepRecord

HOUR = 3600.0
LEASE = 30.0

pytestmark = pytest.mark.timeout(60)


class Crash(BaseException):
    """The process dies here."""


@pytest.fixture(params=JOURNALS)
def journal_factory(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[JournalFactory]:
    yield from factory_for(request.param, clock, tmp_path)


@pytest.fixture
def journal(journal_factory: JournalFactory) -> SagaJournal:
    return journal_factory.open()


@pytest.fixture
def guard(journal_factory: JournalFactory) -> Guard:
    return journal_factory.guard()


@dataclass
class Order:
    id: str


ORDER = Order("o1")


def _runner(journal: SagaJournal, guard: Guard, **options: Any) -> SagaRunner:
    options.setdefault("renewer", False)
    return SagaRunner(journal, guard, lease=LEASE, wait=0, sleep=lambda _s: None, **options)


class Steps:
    """a -> b -> c (compensatable) -> p (pivot) -> r (retriable); each logs and may run ``hooks``."""

    def __init__(
        self, *, timeout: float | None = None, step_timeout: dict[str, float] | None = None, name: str = "ops"
    ) -> None:
        self.log: list[str] = []
        self.hooks: dict[str, Any] = {}
        saga: Saga[Order] = Saga(name, input=Order, timeout=timeout)
        self.saga = saga
        limits = step_timeout or {}
        for step in ("a", "b", "c"):
            saga.step(name=step, compensate=self._undo(step), timeout=limits.get(step))(self._act(step))
        saga.pivot(name="p", timeout=limits.get("p"))(self._act("p"))
        saga.retriable(name="r")(self._act("r"))

    def _act(self, step: str) -> Any:
        def act(ctx: StepContext, order: Order) -> str:
            self.log.append(step)
            hook = self.hooks.get(step)
            if hook is not None:
                hook(ctx)
            return f"{step}!"

        return act

    def _undo(self, step: str) -> Any:
        def undo(ctx: StepContext, order: Order, result: str | None) -> None:
            self.log.append(f"undo {step} {result}")

        return undo


# -- cancellation -------------------------------------------------------------------------------


def test_cancel_while_running_compensates_at_the_next_boundary(journal: SagaJournal, guard: Guard) -> None:
    steps = Steps()
    steps.hooks["b"] = lambda ctx: cancel(journal, ctx.saga_id, reason="customer withdrew")
    outcome = _runner(journal, guard).run(steps.saga, "c-1", ORDER)
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None
    assert (outcome.error.type_name, outcome.error.message) == (
        "sagaguard.saga.errors.SagaCancelled",
        "customer withdrew",
    )
    # b finished and is undone with its result; c was started (compensation registered) but never ran
    assert steps.log == ["a", "b", "undo b b!", "undo a a!"]
    snapshot = journal.load("c-1")
    assert snapshot is not None
    c = snapshot.steps[2]
    assert c.state is StepState.FAILED and c.not_applied


def test_cancel_a_waiting_saga(journal: SagaJournal, guard: Guard) -> None:
    steps = Steps()
    steps.hooks["b"] = lambda ctx: ctx.wait_for("go")
    assert _runner(journal, guard).run(steps.saga, "c-2", ORDER).state is SagaState.WAITING
    assert cancel(journal, "c-2") is CancelOutcome.REQUESTED
    assert cancel(journal, "c-2") is CancelOutcome.ALREADY
    outcome = recover(journal, guard, steps.saga).outcomes["c-2"]
    assert outcome.state is SagaState.COMPENSATED
    assert steps.log == ["a", "b", "undo b None", "undo a a!"]  # b was waiting: maybe applied


def test_cancel_a_saga_nobody_holds(journal: SagaJournal, guard: Guard, clock: FakeClock) -> None:
    steps = Steps()

    def die(ctx: StepContext) -> None:
        raise Crash

    steps.hooks["b"] = die
    with pytest.raises(Crash):
        _runner(journal, guard).run(steps.saga, "c-3", ORDER)
    assert cancel(journal, "c-3") is CancelOutcome.REQUESTED
    assert recover(journal, guard, steps.saga).found == 0  # the dead runner's lease must run out
    clock.advance(LEASE)
    outcome = recover(journal, guard, steps.saga).outcomes["c-3"]
    assert outcome.state is SagaState.COMPENSATED
    assert steps.log == ["a", "b", "undo b None", "undo a a!"]


def test_cancel_is_too_late_after_the_pivot_and_at_the_end(journal: SagaJournal, guard: Guard) -> None:
    steps = Steps()
    steps.hooks["r"] = lambda ctx: ctx.wait_for("receipt")
    assert _runner(journal, guard).run(steps.saga, "c-4", ORDER).waiting_for == "receipt"
    assert cancel(journal, "c-4") is CancelOutcome.TOO_LATE
    snapshot = journal.load("c-4")
    assert snapshot is not None and not snapshot.saga.cancel_requested
    signal(journal, "c-4", "receipt")
    assert recover(journal, guard, steps.saga).outcomes["c-4"].state is SagaState.COMPLETED
    assert cancel(journal, "c-4") is CancelOutcome.TOO_LATE
    with pytest.raises(SagaNotFound):
        cancel(journal, "nope")


def _last(
    journal: SagaJournal, log: list[str], seen: list[CancelOutcome], *, asynchronous: bool = False
) -> Saga[Order]:
    """a -> b (both compensatable); b, the last step, is cancelled by an operator while it runs."""
    s: Saga[Order] = Saga("last", input=Order)

    def a(ctx: StepContext, o: Order) -> str:
        log.append("a")
        return "a!"

    s.step(name="a", compensate=lambda ctx, o, r: log.append(f"undo a {r}"))(a)

    def b(ctx: StepContext, o: Order) -> str:
        log.append("b")
        seen.append(cancel(journal, ctx.saga_id, reason="operator"))
        return "b!"

    async def ab(ctx: StepContext, o: Order) -> str:
        return b(ctx, o)

    s.step(name="b", compensate=lambda ctx, o, r: log.append(f"undo b {r}"))(ab if asynchronous else b)
    return s


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_cancel_during_the_last_step_is_honoured(
    journal: SagaJournal, guard: Guard, asynchronous: bool
) -> None:
    """The cancel is answered REQUESTED while the last step runs: that step's result and the
    completion are one commit, which the journal refuses to complete (the saga stays RUNNING), so
    the runner undoes every step, the last one first, each once."""
    log: list[str] = []
    seen: list[CancelOutcome] = []
    saga = _last(journal, log, seen, asynchronous=asynchronous)
    runner = _runner(journal, guard)
    if asynchronous:
        outcome = asyncio.run(runner.arun(saga, "c-last", ORDER))
    else:
        outcome = runner.run(saga, "c-last", ORDER)
    assert seen == [CancelOutcome.REQUESTED]
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.type_name == "sagaguard.saga.errors.SagaCancelled"
    assert log == ["a", "b", "undo b b!", "undo a a!"]
    snapshot = journal.load("c-last")
    assert snapshot is not None
    assert [r.state for r in snapshot.steps] == [StepState.COMPENSATED, StepState.COMPENSATED]
    assert cancel(journal, "c-last") is CancelOutcome.TOO_LATE
    # Run again (a replay): nothing more runs or is undone.
    if asynchronous:
        again = asyncio.run(runner.arun(saga, "c-last", ORDER))
    else:
        again = runner.run(saga, "c-last", ORDER)
    assert again.state is SagaState.COMPENSATED and again.replayed
    assert log == ["a", "b", "undo b b!", "undo a a!"]


def test_a_cancel_during_the_last_step_after_the_pivot_is_too_late(
    journal: SagaJournal, guard: Guard
) -> None:
    """Past the pivot the saga only goes forward: a cancel while its last step (retriable, after
    the pivot) runs is TOO_LATE, from the journal itself, records nothing, and the saga completes."""
    steps = Steps()
    seen: list[CancelOutcome] = []
    steps.hooks["r"] = lambda ctx: seen.append(journal.cancel(ctx.saga_id, '{"why":"raced the pivot"}'))
    outcome = _runner(journal, guard).run(steps.saga, "c-pivot", ORDER)
    assert seen == [CancelOutcome.TOO_LATE]
    assert outcome.state is SagaState.COMPLETED
    assert steps.log == ["a", "b", "c", "p", "r"]
    snapshot = journal.load("c-pivot")
    assert snapshot is not None and not snapshot.saga.cancel_requested
    assert cancel(journal, "c-pivot") is CancelOutcome.TOO_LATE


def test_cancel_with_nothing_to_undo_fails_the_saga(journal: SagaJournal, guard: Guard) -> None:
    s: Saga[Order] = Saga("plain", input=Order)
    s.step(name="x", compensate=None)(lambda ctx, o: cancel(journal, ctx.saga_id))
    s.step(name="y", compensate=None)(lambda ctx, o: None)
    outcome = _runner(journal, guard).run(s, "c-5", ORDER)
    assert outcome.state is SagaState.FAILED
    assert outcome.error is not None and outcome.error.type_name == "sagaguard.saga.errors.SagaCancelled"


# -- timeouts -------------------------------------------------------------------------------------


def test_a_step_past_its_timeout_fails_maybe_applied(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    steps = Steps(step_timeout={"b": HOUR})
    steps.hooks["b"] = lambda ctx: clock.advance(HOUR + 1)
    outcome = _runner(journal, guard).run(steps.saga, "t-1", ORDER)
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.type_name == "sagaguard.saga.errors.StepTimeout"
    # not retried; its compensation gets None although it returned: a late result is not trusted
    assert steps.log == ["a", "b", "undo b None", "undo a a!"]


def test_an_async_step_is_cancelled_at_its_timeout(journal: SagaJournal, guard: Guard) -> None:
    s: Saga[Order] = Saga("slow", input=Order)
    log: list[str] = []

    def undo(ctx: StepContext, order: Order, result: str | None) -> None:
        log.append(f"undo {result}")

    @s.step(compensate=undo, timeout=0.05)
    async def slow(ctx: StepContext, order: Order) -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            log.append("cancelled")
            raise
        return "late"

    outcome = asyncio.run(_runner(journal, guard).arun(s, "t-2", ORDER))
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.type_name == "sagaguard.saga.errors.StepTimeout"
    assert log == ["cancelled", "undo None"]


def test_a_hung_step_loses_its_lease_at_its_timeout_and_recovery_fails_it(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    steps = Steps(step_timeout={"b": HOUR})
    renewer = LeaseRenewer(journal, LEASE, thread=False)
    seen: dict[str, Any] = {}

    def hang(ctx: StepContext) -> None:
        # The step runs for an hour: the renewer keeps the lease while the timeout has not passed...
        for _ in range(4):
            clock.advance(HOUR / 4 - 1)
            assert renewer.beat_due(force=True) == 1
        assert recover(journal, guard, steps.saga).found == 0
        # ...and stops once it has, so the lease runs out and another worker fails the step.
        clock.advance(10)
        assert renewer.beat_due(force=True) == 0
        clock.advance(LEASE)
        seen["report"] = recover(journal, guard, steps.saga)

    steps.hooks["b"] = hang
    with pytest.raises(LostSagaLease):  # the hung runner comes back to a saga that moved on
        _runner(journal, guard, renewer=renewer).run(steps.saga, "t-3", ORDER)
    outcome = seen["report"].outcomes["t-3"]
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.type_name == "sagaguard.saga.errors.StepTimeout"
    assert steps.log == ["a", "b", "undo b None", "undo a a!"]  # b was not run again


def test_the_saga_deadline_cuts_the_step_running_over_it(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    steps = Steps(timeout=HOUR)
    steps.hooks["a"] = lambda ctx: clock.advance(HOUR)
    outcome = _runner(journal, guard).run(steps.saga, "t-4", ORDER)
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.type_name == "sagaguard.saga.errors.StepTimeout"
    assert steps.log == ["a", "undo a None"]


def test_the_saga_deadline_passing_while_nobody_runs_it_compensates(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    steps = Steps(timeout=HOUR)

    def die(ctx: StepContext) -> None:
        raise Crash

    steps.hooks["b"] = die
    with pytest.raises(Crash):
        _runner(journal, guard).run(steps.saga, "t-5", ORDER)
    clock.advance(HOUR)
    outcome = recover(journal, guard, steps.saga).outcomes["t-5"]
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None
    assert outcome.error.type_name == "sagaguard.saga.errors.SagaDeadlineExceeded"
    assert steps.log == ["a", "b", "undo b None", "undo a a!"]


def test_after_the_pivot_the_saga_deadline_no_longer_applies(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    steps = Steps(timeout=HOUR)
    steps.hooks["p"] = lambda ctx: clock.advance(2 * HOUR)
    outcome = _runner(journal, guard).run(steps.saga, "t-6", ORDER)
    assert outcome.state is SagaState.COMPLETED and steps.log == ["a", "b", "c", "p", "r"]


# -- versioning -----------------------------------------------------------------------------------


def _v1_v2(log: list[str]) -> tuple[Saga[Order], Saga[Order]]:
    v1: Saga[Order] = Saga("order", version=1, input=Order)
    v1.step(name="reserve", compensate=None)(lambda ctx, o: log.append("v1 reserve"))
    v1.step(name="approve", compensate=None)(lambda ctx, o: ctx.wait_for("ok"))
    v1.step(name="ship", compensate=None)(lambda ctx, o: log.append("v1 ship"))
    v2: Saga[Order] = Saga("order", version=2, input=Order)
    v2.step(name="reserve", compensate=None)(lambda ctx, o: log.append("v2 reserve"))
    v2.step(name="fraud_check", compensate=None)(lambda ctx, o: log.append("v2 fraud"))
    v2.step(name="approve", compensate=None)(lambda ctx, o: ctx.wait_for("ok"))
    v2.step(name="ship", compensate=None)(lambda ctx, o: log.append("v2 ship"))
    return v1, v2


def test_an_instance_finishes_on_the_version_that_started_it(journal: SagaJournal, guard: Guard) -> None:
    log: list[str] = []
    v1, v2 = _v1_v2(log)
    assert _runner(journal, guard).run(v1, "v-1", ORDER).waiting_for == "ok"
    # a deploy: v2 is now the latest, v1 still registered for the instances in flight
    registry = SagaRegistry(v1, v2)
    assert registry.latest("order") is v2 and registry.versions("order") == [1, 2]
    runner = _runner(journal, guard, registry=registry)
    assert runner.run(v2, "v-2", ORDER).waiting_for == "ok"
    signal(journal, "v-1", "ok")
    signal(journal, "v-2", "ok")
    report = recover(journal, guard, registry)
    assert {k: o.state for k, o in report.outcomes.items()} == {
        "v-1": SagaState.COMPLETED,
        "v-2": SagaState.COMPLETED,
    }
    assert log == ["v1 reserve", "v2 reserve", "v2 fraud", "v1 ship", "v2 ship"]
    # run() with the new version on an old instance replays it on the old one
    assert runner.run(v2, "v-1", ORDER).results == {"reserve": None, "approve": None, "ship": None}


def test_a_runner_without_the_old_version_refuses_the_instance(journal: SagaJournal, guard: Guard) -> None:
    log: list[str] = []
    v1, v2 = _v1_v2(log)
    _runner(journal, guard).run(v1, "v-3", ORDER)
    with pytest.raises(DefinitionMismatch, match="v1"):
        _runner(journal, guard).run(v2, "v-3", ORDER)
    with pytest.raises(DefinitionMismatch):
        _runner(journal, guard, registry=SagaRegistry(v2)).run(v2, "v-3", ORDER)


def test_changed_steps_under_the_same_version_are_a_clear_error(journal: SagaJournal, guard: Guard) -> None:
    log: list[str] = []
    v1, _ = _v1_v2(log)
    _runner(journal, guard).run(v1, "v-4", ORDER)
    edited: Saga[Order] = Saga("order", version=1, input=Order)
    edited.step(name="reserve", compensate=None)(lambda ctx, o: None)
    edited.step(name="approve_v2", compensate=None)(lambda ctx, o: None)
    signal(journal, "v-4", "ok")
    with pytest.raises(StepMismatch) as caught:
        _runner(journal, guard).run(edited, "v-4", ORDER)
    error = caught.value
    assert (error.saga_id, error.index, error.recorded, error.expected) == ("v-4", 1, "approve", "approve_v2")
    assert "new saga version" in str(error)


def test_the_registry() -> None:
    log: list[str] = []
    v1, v2 = _v1_v2(log)
    registry = SagaRegistry(v1)
    registry.register(v2)
    registry.register(v2)  # the same object again: fine
    assert registry.get("order", 1) is v1 and ("order", 2) in registry and len(registry) == 2
    assert list(registry) == [v1, v2] and v1.frozen
    clash: Saga[Order] = Saga("order", version=2, input=Order)
    clash.step(name="x", compensate=None)(lambda ctx, o: None)
    with pytest.raises(DefinitionError, match="new version"):
        registry.register(clash)
    with pytest.raises(UnknownSaga):
        registry.get("order", 3)
    with pytest.raises(UnknownSaga):
        registry.latest("nothing")


# -- the pure decisions behind all this ------------------------------------------------------------


def _snapshot(rows: list[tuple[str, StepState]], **saga: Any) -> SagaSnapshot:
    kinds = {"a": StepKind.COMPENSATABLE, "b": StepKind.COMPENSATABLE, "p": StepKind.PIVOT}
    record = SagaRecord("id", "ops", 1, "f", "{}", SagaState.RUNNING, 1, 100.0, 0.0, 50.0).evolve(**saga)
    steps = tuple(StepRecord(i, name, kinds[name], state) for i, (name, state) in enumerate(rows))
    return SagaSnapshot(record, steps)


OK, STARTED = StepState.SUCCEEDED, StepState.STARTED


@pytest.mark.parametrize(
    ("rows", "saga", "fresh", "expected"),
    [
        ([("a", OK)], {}, None, None),
        ([("a", OK)], {"cancel_requested": True, "error": "why"}, None, "why"),
        ([("a", OK)], {"cancel_requested": True}, None, "SagaCancelled"),
        ([("a", OK), ("b", OK), ("p", STARTED)], {"cancel_requested": True}, None, None),
        ([("a", OK), ("b", OK), ("p", STARTED)], {"cancel_requested": True}, 2, "SagaCancelled"),
        ([("a", OK)], {"deadline": 60.0}, None, None),
        ([("a", OK)], {"deadline": 50.0}, None, "SagaDeadlineExceeded"),
        ([("a", OK), ("b", OK), ("p", OK)], {"deadline": 10.0}, None, None),
        ([("a", OK)], {"deadline": 10.0, "state": SagaState.COMPENSATING}, None, None),
    ],
)
def test_abandon_cause(
    rows: list[tuple[str, StepState]], saga: dict[str, Any], fresh: int | None, expected: Any
) -> None:
    cause = abandon_cause(_snapshot(rows, **saga), fresh)
    if expected is None:
        assert cause is None
    else:
        assert cause is not None and expected in cause


def test_wake_at_and_step_deadline() -> None:
    before = _snapshot([("a", OK)], deadline=500.0)
    assert (
        wake_at(before, 0.0) == 500.0 and wake_at(before, 400.0) == 400.0 and wake_at(before, 900.0) == 500.0
    )
    after = _snapshot([("a", OK), ("b", OK), ("p", OK)], deadline=500.0)
    assert wake_at(after, 0.0) == FOREVER and wake_at(after, 900.0) == 900.0
    steps = Steps(step_timeout={"b": 100.0, "p": 5.0}, name="d")
    snap = _snapshot([("a", OK), ("b", STARTED)], deadline=120.0)
    snap = SagaSnapshot(snap.saga, (snap.steps[0], snap.steps[1].evolve(started_at=50.0)))
    assert step_deadline(steps.saga, snap, 1) == 120.0  # the saga's deadline comes first
    assert step_deadline(steps.saga, _snapshot([("a", STARTED)]), 0) is None
