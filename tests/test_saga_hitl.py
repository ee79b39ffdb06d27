"""Human in the loop: a step waits for a named signal; the saga parks as WAITING, no process held.

Days pass on the injected clock, never in real time. A signal resumes the saga on whichever runner or
worker takes it next (another process, on SQLite and Postgres); a deadline fails the wait and the saga
compensates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _sagachild import read_log
from _sagajournals import JOURNALS, SHARED_SQL, JournalFactory, factory_for, finish_child, start_child
from conftest import FakeClock

from sagaguard.idempotency import Guard
from sagaguard.saga import (
    CancelOutcome,
    SagaJournal,
    SagaRunner,
    SagaState,
    SignalOutcome,
    StepContext,
    arecover,
    recover,
    signal,
)
from sagaguard.saga.definition import Saga
from sagaguard.saga.records import FOREVER

pytestmark = pytest.mark.timeout(120)

DAY = 86_400.0
LEASE = 30.0


@pytest.fixture(params=JOURNALS)
def journal_factory(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[JournalFactory]:
    yield from factory_for(request.param, clock, tmp_path)


@pytest.fixture(params=SHARED_SQL)
def shared_factory(
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
    amount: int


@dataclass
class Approval:
    by: str


ORDER = Order("o1", 700)


class Travel:
    """charge -> approval (a wait, 3 days) -> book (pivot) -> notify (a wait after the pivot)."""

    def __init__(self, guard: Guard, *, saga_timeout: float | None = None, early: Any = None) -> None:
        self.log: list[str] = []
        log = self.log
        travel: Saga[Order] = Saga("travel", input=Order, timeout=saga_timeout)
        self.saga = travel

        @guard.effect("psp.charge")
        def charge_card(order_id: str, amount: int) -> int:
            log.append("psp.charge")
            return amount

        def refund(ctx: StepContext, order: Order, charged: int | None) -> None:
            log.append(f"refund {charged}")

        @travel.step(compensate=refund)
        def charge(ctx: StepContext, order: Order) -> int:
            log.append("charge")
            if early is not None:
                early(ctx)
            return charge_card(order.id, order.amount)

        self.approval = travel.wait("approval", timeout=3 * DAY, payload=Approval)

        @travel.pivot
        def book(ctx: StepContext, order: Order) -> str:
            log.append(f"book for {ctx.result(self.approval).by}")
            return "booked"

        @travel.retriable
        def receipt(ctx: StepContext, order: Order) -> str:
            # a wait inside an ordinary step; the suspension is no Exception, so this except misses it
            try:
                sent = ctx.wait_for("receipt", timeout=DAY)
            except Exception:
                log.append("swallowed")
                raise
            log.append(f"receipt {sent}")
            return str(sent)


def _runner(journal: SagaJournal, guard: Guard) -> SagaRunner:
    return SagaRunner(journal, guard, lease=LEASE, wait=0, sleep=lambda _s: None)


def test_a_wait_parks_the_saga_and_the_runner_holds_nothing(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    travel = Travel(guard)
    runner = _runner(journal, guard)
    outcome = runner.run(travel.saga, "t-1", ORDER)
    assert outcome.state is SagaState.WAITING and outcome.waiting_for == "approval" and outcome.error is None
    assert outcome.results == {"charge": 700}
    assert runner.renewer is not None and runner.renewer.holding == 0
    snapshot = journal.load("t-1")
    assert snapshot is not None
    saga = snapshot.saga
    assert saga.state is SagaState.WAITING and saga.lease_until == clock.now + 3 * DAY == saga.wait_until
    assert snapshot.steps[1].state.value == "started"  # the wait step runs again when woken
    again = runner.run(travel.saga, "t-1", ORDER)  # nothing to do until the signal or deadline
    assert again.replayed and again.state is SagaState.WAITING
    assert travel.log == ["charge", "psp.charge"]
    runner.close()


def test_a_signal_days_later_resumes_it_on_another_runner(
    journal_factory: JournalFactory, guard: Guard, clock: FakeClock
) -> None:
    travel = Travel(guard)
    assert _runner(journal_factory.open(), guard).run(travel.saga, "t-2", ORDER).state is SagaState.WAITING
    clock.advance(2 * DAY)
    operator = journal_factory.open()
    assert recover(operator, guard, travel.saga).found == 0  # nothing is due before the signal
    assert signal(operator, "t-2", "approval", Approval("ana")) is SignalOutcome.DELIVERED
    assert signal(operator, "t-2", "approval", Approval("bob")) is SignalOutcome.DUPLICATE
    worker = journal_factory.open()
    outcome = recover(worker, guard, travel.saga).outcomes["t-2"]
    # it went on past the pivot and now waits for the next signal
    assert outcome.state is SagaState.WAITING and outcome.waiting_for == "receipt"
    assert outcome.results["approval"] == Approval("ana") and outcome.results["book"] == "booked"
    clock.advance(DAY / 2)
    signal(operator, "t-2", "receipt", {"sent": True})
    done = recover(worker, guard, travel.saga).outcomes["t-2"]
    assert done.state is SagaState.COMPLETED and done.results["receipt"] == "{'sent': True}"
    assert travel.log == ["charge", "psp.charge", "book for ana", "receipt {'sent': True}"]


def test_the_deadline_passing_fails_the_wait_and_compensates(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    travel = Travel(guard)
    _runner(journal, guard).run(travel.saga, "t-3", ORDER)
    clock.advance(3 * DAY - 1)
    assert recover(journal, guard, travel.saga).found == 0
    clock.advance(1)
    outcome = recover(journal, guard, travel.saga).outcomes["t-3"]
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.type_name == "sagaguard.saga.errors.SignalTimeout"
    assert travel.log == ["charge", "psp.charge", "refund 700"]
    snapshot = journal.load("t-3")
    assert snapshot is not None and snapshot.steps[1].not_applied  # the wait changed nothing
    assert signal(journal, "t-3", "approval", Approval("late")) is SignalOutcome.TOO_LATE


def test_a_wait_after_the_pivot_that_times_out_needs_attention(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    travel = Travel(guard)
    _runner(journal, guard).run(travel.saga, "t-4", ORDER)
    signal(journal, "t-4", "approval", Approval("ana"))
    assert recover(journal, guard, travel.saga).outcomes["t-4"].waiting_for == "receipt"
    clock.advance(DAY)
    outcome = recover(journal, guard, travel.saga).outcomes["t-4"]
    assert outcome.state is SagaState.NEEDS_ATTENTION  # after the pivot: never compensated
    assert "refund 700" not in travel.log


def test_a_signal_that_came_early_is_used_at_once(journal: SagaJournal, guard: Guard) -> None:
    def early(ctx: StepContext) -> None:
        signal(journal, ctx.saga_id, "approval", Approval("early"))  # arrives while the saga runs

    travel = Travel(guard, early=early)
    outcome = _runner(journal, guard).run(travel.saga, "t-5", ORDER)
    # parked, found its signal already there, took itself over and went on: one run() call
    assert outcome.state is SagaState.WAITING and outcome.waiting_for == "receipt"
    assert "book for early" in travel.log


def test_run_again_after_the_signal_finishes_it(journal: SagaJournal, guard: Guard, clock: FakeClock) -> None:
    travel = Travel(guard)
    runner = _runner(journal, guard)
    runner.run(travel.saga, "t-6", ORDER)
    clock.advance(DAY)
    signal(journal, "t-6", "approval", Approval("ana"))
    outcome = runner.run(travel.saga, "t-6", ORDER)  # takes the woken saga over itself
    assert not outcome.replayed and outcome.waiting_for == "receipt"
    snapshot = journal.load("t-6")
    assert snapshot is not None and snapshot.saga.recoveries == 0  # waking is not a recovery


def test_the_saga_deadline_also_ends_a_wait(journal: SagaJournal, guard: Guard, clock: FakeClock) -> None:
    travel = Travel(guard, saga_timeout=DAY)
    assert _runner(journal, guard).run(travel.saga, "t-7", ORDER).state is SagaState.WAITING
    snapshot = journal.load("t-7")
    assert snapshot is not None and snapshot.saga.lease_until == snapshot.saga.deadline == clock.now + DAY
    clock.advance(DAY)
    outcome = recover(journal, guard, travel.saga).outcomes["t-7"]
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None
    assert outcome.error.type_name == "sagaguard.saga.errors.SagaDeadlineExceeded"
    assert travel.log[-1] == "refund 700"


def test_a_cancel_after_the_pivot_leaves_a_waiting_saga_waiting_on_its_first_deadline(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    """Waiting after its pivot, the saga only goes forward: a cancel is TOO_LATE from the journal
    and neither wakes it nor moves its wait deadline; the signal then takes it on."""
    travel = Travel(guard)
    runner = _runner(journal, guard)
    runner.run(travel.saga, "t-8", ORDER)
    signal(journal, "t-8", "approval", Approval("ana"))
    recover(journal, guard, travel.saga)
    first = journal.load("t-8")
    assert first is not None and first.saga.wait_until == clock.now + DAY == first.saga.lease_until
    clock.advance(DAY / 2)
    assert journal.cancel("t-8", "{}") is CancelOutcome.TOO_LATE
    assert recover(journal, guard, travel.saga).found == 0
    again = journal.load("t-8")
    assert again is not None and again.saga == first.saga
    signal(journal, "t-8", "receipt", "r-1")
    outcome = recover(journal, guard, travel.saga).outcomes["t-8"]
    assert outcome.state is SagaState.COMPLETED and travel.log[-1] == "receipt r-1"


def test_a_wait_without_deadline_waits_forever(journal: SagaJournal, guard: Guard, clock: FakeClock) -> None:
    s: Saga[Order] = Saga("forever", input=Order)
    s.wait("go", payload=int)

    @s.step(compensate=None)
    def after(ctx: StepContext, order: Order) -> int:
        return ctx.signal("go", int) + 1

    assert _runner(journal, guard).run(s, "f-1", ORDER).waiting_for == "go"
    snapshot = journal.load("f-1")
    assert snapshot is not None and snapshot.saga.lease_until == FOREVER and snapshot.saga.wait_until == 0
    clock.advance(365 * DAY)
    assert recover(journal, guard, s).found == 0
    signal(journal, "f-1", "go", 41)
    assert recover(journal, guard, s).outcomes["f-1"].results == {"go": 41, "after": 42}


def test_async_steps_wait_too(journal: SagaJournal, guard: Guard) -> None:
    s: Saga[Order] = Saga("await", input=Order)

    @s.step(compensate=None)
    async def approve(ctx: StepContext, order: Order) -> str:
        await asyncio.sleep(0)
        approval = ctx.wait_for("ok", timeout=DAY, payload_type=Approval)
        return approval.by

    runner = _runner(journal, guard)
    assert asyncio.run(runner.arun(s, "a-1", ORDER)).state is SagaState.WAITING
    signal(journal, "a-1", "ok", Approval("eve"))
    report = asyncio.run(arecover(journal, guard, s))
    assert report.outcomes["a-1"].results == {"approve": "eve"}


def test_a_process_waits_and_exits_another_process_finishes_it_days_later(
    shared_factory: JournalFactory, clock: FakeClock, tmp_path: Path
) -> None:
    log = tmp_path / "effects.log"
    base = {"spec": shared_factory.spec(), "log": str(log)}
    order = {"id": "o-9", "amount": 700}
    t0 = clock.now
    # Four processes, started (and warmed up) at once; each goes when its gate opens.
    first, second, worker, late = (
        start_child({**base, "now": t0, "command": "run", "saga_id": "p-1", "order": order}, gate=True),
        start_child({**base, "now": t0, "command": "run", "saga_id": "p-2", "order": order}, gate=True),
        start_child({**base, "now": t0 + 2 * DAY, "command": "recover"}, gate=True),
        start_child({**base, "now": t0 + 4 * DAY, "command": "recover"}, gate=True),
    )
    ran = finish_child(first, go=True)
    assert ran == {"pid": first.pid, "state": "waiting", "waiting_for": "approval"}
    assert finish_child(second, go=True)["state"] == "waiting"
    # Both processes have exited: nothing holds the sagas. Days later an operator signals one.
    clock.advance(2 * DAY)
    operator = shared_factory.open()
    assert signal(operator, "p-1", "approval", {"by": "ana"}) is SignalOutcome.DELIVERED
    assert finish_child(worker, go=True)["outcomes"] == {"p-1": "completed"}
    # The other one's deadline passes: a fourth process compensates it.
    assert finish_child(late, go=True)["outcomes"] == {"p-2": "compensated"}
    assert read_log(str(log)) == [
        "charge", "psp.charge", "charge", "psp.charge", "book for ana", "refund 700",
    ]  # fmt: skip
    snapshot = operator.load("p-1")
    assert snapshot is not None and snapshot.saga.state is SagaState.COMPLETED
