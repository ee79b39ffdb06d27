"""Recovery: sagas whose runner died are continued by :func:`saga.recover`, fenced, capped.

A runner "dies" by raising :class:`Crash` (a BaseException: the runner lets it through and leaves the
journal as a killed process would, lease held, step STARTED). The fake clock then passes the lease
and a sweep takes over. Every backend runs the in-process tests; SQLite and Postgres also race two
real processes for one saga.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import tenacity
from _sagachild import Order as ChildOrder
from _sagachild import build_travel, file_log, read_log
from _sagajournals import JOURNALS, SHARED_SQL, JournalFactory, factory_for, finish_child, start_child
from conftest import FakeClock

from sagaguard.idempotency import Guard
from sagaguard.idempotency.codec import decode_error
from sagaguard.idempotency.effect import Retry
from sagaguard.idempotency.keys import fingerprint
from sagaguard.saga import (
    LeaseRenewer,
    LostSagaLease,
    MemoryJournal,
    Phase,
    RecoveryWorker,
    Saga,
    SagaJournal,
    SagaRegistry,
    SagaRunner,
    SagaState,
    StepContext,
    StepKind,
    StepRecord,
    StepState,
    arecover,
    recover,
)

pytestmark = pytest.mark.timeout(120)

FAST = Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())
LEASE = 30.0


class Crash(BaseException):
    """The process dies here (the runner does not catch a BaseException)."""


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


ORDER = Order("o1", 500)


class Trip:
    """charge -> reserve -> book (pivot) -> email; ``crash[step]`` crashes a step that many times
    (after its guarded effect), ``crash_undo[step]`` its compensation (before it does anything)."""

    def __init__(self, guard: Guard, name: str = "trip") -> None:
        self.log: list[str] = []
        self.crash: dict[str, int] = {}
        self.crash_undo: dict[str, int] = {}
        self.fail: set[str] = set()
        saga: Saga[Order] = Saga(name, input=Order)
        self.saga = saga
        log = self.log

        @guard.effect("psp.charge")
        def psp_charge(order_id: str, amount: int) -> int:
            log.append("psp.charge")
            return amount

        def refund(ctx: StepContext, order: Order, charged: int | None) -> None:
            self._maybe_crash_undo("charge")
            log.append(f"refund {charged}")

        @saga.step(compensate=refund, retry=FAST)
        def charge(ctx: StepContext, order: Order) -> int:
            log.append("charge")
            charged = psp_charge(order.id, order.amount)
            self._maybe_crash("charge")
            return charged

        def release(ctx: StepContext, order: Order, seat: str | None) -> None:
            self._maybe_crash_undo("reserve")
            log.append(f"release {seat}")

        @saga.step(compensate=release, retry=FAST)
        def reserve(ctx: StepContext, order: Order) -> str:
            log.append("reserve")
            self._maybe_crash("reserve")
            if "reserve" in self.fail:
                raise RuntimeError("no seats")
            return "12A"

        @saga.pivot(retry=FAST)
        def book(ctx: StepContext, order: Order) -> str:
            log.append("book")
            self._maybe_crash("book")
            return "bk"

        @saga.retriable(retry=FAST)
        def email(ctx: StepContext, order: Order) -> None:
            log.append("email")

    def _maybe_crash(self, step: str) -> None:
        if self.crash.get(step, 0) > 0:
            self.crash[step] -= 1
            raise Crash(step)

    def _maybe_crash_undo(self, step: str) -> None:
        if self.crash_undo.get(step, 0) > 0:
            self.crash_undo[step] -= 1
            raise Crash(f"undo {step}")


def _runner(journal: SagaJournal, guard: Guard, **options: Any) -> SagaRunner:
    return SagaRunner(journal, guard, lease=LEASE, wait=0, sleep=lambda _s: None, renewer=False, **options)


def _crash(journal: SagaJournal, guard: Guard, trip: Trip, saga_id: str) -> None:
    with pytest.raises(Crash):
        _runner(journal, guard).run(trip.saga, saga_id, ORDER)


def test_recover_continues_forward_from_the_first_unfinished_step(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    trip = Trip(guard)
    trip.crash["charge"] = 1
    _crash(journal, guard, trip, "s-1")
    assert recover(journal, guard, trip.saga, lease=LEASE).found == 0  # its lease is still live
    clock.advance(LEASE + 1)
    report = recover(journal, guard, trip.saga, lease=LEASE, sleep=lambda _s: None)
    assert report.found == 1 and report.recovered == ("s-1",)
    outcome = report.outcomes["s-1"]
    assert outcome.state is SagaState.COMPLETED and outcome.results["charge"] == 500
    # the charge step ran again, but its card charge replayed: the world was charged once
    assert trip.log == ["charge", "psp.charge", "charge", "reserve", "book", "email"]
    snapshot = journal.load("s-1")
    assert snapshot is not None and snapshot.saga.recoveries == 1 and snapshot.saga.token == 2
    assert recover(journal, guard, trip.saga).found == 0


def test_recover_continues_compensating(journal: SagaJournal, guard: Guard, clock: FakeClock) -> None:
    trip = Trip(guard)
    trip.fail.add("reserve")
    trip.crash_undo["charge"] = 1
    _crash(journal, guard, trip, "s-2")
    snapshot = journal.load("s-2")
    assert snapshot is not None and snapshot.saga.state is SagaState.COMPENSATING
    clock.advance(LEASE + 1)
    outcome = recover(journal, guard, [trip.saga], sleep=lambda _s: None).outcomes["s-2"]
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.message == "no seats"
    assert trip.log == ["charge", "psp.charge", "reserve", "reserve", "release None", "refund 500"]


def test_recovery_attempts_are_capped(journal: SagaJournal, guard: Guard, clock: FakeClock) -> None:
    trip = Trip(guard)
    trip.crash["reserve"] = 100  # a poison step: kills every worker that runs it
    _crash(journal, guard, trip, "s-3")
    for _ in range(2):
        clock.advance(LEASE + 1)
        with pytest.raises(Crash):
            recover(journal, guard, trip.saga, lease=LEASE, max_recoveries=2)
    clock.advance(LEASE + 1)
    report = recover(journal, guard, trip.saga, lease=LEASE, max_recoveries=2)
    outcome = report.outcomes["s-3"]
    assert outcome.state is SagaState.NEEDS_ATTENTION
    assert outcome.error is not None and outcome.error.type_name == "sagaguard.saga.errors.RecoveryExhausted"
    assert trip.log.count("reserve") == 3  # the third take-over parks it without running the step
    snapshot = journal.load("s-3")
    assert snapshot is not None and snapshot.saga.recoveries == 3 and snapshot.saga.lease_until == 0
    assert snapshot.steps[1].state is StepState.STARTED  # left for an operator, compensation registered


def test_unknown_definitions_are_skipped_not_claimed(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    trip = Trip(guard)
    trip.crash["charge"] = 1
    _crash(journal, guard, trip, "s-4")
    clock.advance(LEASE + 1)
    other = Trip(guard, name="other")
    report = recover(journal, guard, SagaRegistry(other.saga))
    assert report.found == 1 and report.outcomes == {} and "trip" in report.skipped["s-4"]
    snapshot = journal.load("s-4")
    assert snapshot is not None and snapshot.saga.token == 1  # a worker that knows it will take it


def test_two_workers_racing_in_threads_only_one_proceeds(
    journal_factory: JournalFactory, guard: Guard, clock: FakeClock
) -> None:
    trip = Trip(guard)
    trip.crash["charge"] = 1
    _crash(journal_factory.open(), guard, trip, "s-5")
    clock.advance(LEASE + 1)
    workers = [journal_factory.open() for _ in range(4)]
    barrier = threading.Barrier(len(workers))
    reports: list[Any] = []
    lock = threading.Lock()

    def sweep(journal: SagaJournal) -> None:
        barrier.wait()
        report = recover(journal, guard, trip.saga, sleep=lambda _s: None)
        with lock:
            reports.append(report)

    threads = [threading.Thread(target=sweep, args=(j,)) for j in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    drove = [r for r in reports if "s-5" in r.outcomes]
    assert len(drove) == 1 and drove[0].outcomes["s-5"].state is SagaState.COMPLETED
    assert trip.log.count("charge") == 2 and trip.log.count("reserve") == 1  # one crash, one recovery
    assert trip.log.count("psp.charge") == 1


def _crashed_travel(journal: SagaJournal, guard: Guard, saga_id: str, log_path: Path) -> Saga[ChildOrder]:
    """Journal a travel saga as a runner killed inside its first step left it."""
    travel = build_travel(guard, file_log(str(log_path)))
    order = ChildOrder("o-race", 700)
    started = journal.start(
        saga_id,
        name="travel",
        version=1,
        input=travel.input_codec.encode(order),
        fingerprint=fingerprint({"input": order}),
        lease=LEASE,
    )
    charge = travel.steps[0]
    row = StepRecord(
        0, "charge", StepKind.COMPENSATABLE, StepState.STARTED, compensation=charge.compensation_name
    )
    journal.commit(saga_id, started.snapshot.saga.token, Phase(steps=(row,), lease=LEASE))
    return travel


def test_two_worker_processes_racing_for_one_saga_only_one_proceeds(
    shared_factory: JournalFactory, clock: FakeClock, tmp_path: Path
) -> None:
    journal = shared_factory.open()
    log = tmp_path / "effects.log"
    _crashed_travel(journal, shared_factory.guard(), "s-race", log)
    config = {
        "spec": shared_factory.spec(),
        "now": clock.now + LEASE + 1,
        "log": str(log),
        "command": "recover",
    }
    children = [start_child(config, gate=True) for _ in range(2)]
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    reports = [finish_child(child) for child in children]
    drove = [r for r in reports if "s-race" in r["outcomes"]]
    assert len(drove) == 1, reports
    assert drove[0]["outcomes"]["s-race"] == "waiting"  # it went on to the approval step
    assert all(r["errors"] == {} for r in reports)
    assert read_log(str(log)) == ["charge", "psp.charge"]  # the step and its effect ran once
    snapshot = journal.load("s-race")
    assert snapshot is not None and snapshot.saga.token == 2 and snapshot.saga.state is SagaState.WAITING


def test_a_renewed_lease_keeps_a_long_step_from_being_taken_over(clock: FakeClock) -> None:
    journal = MemoryJournal(clock=clock)
    guard = Guard(journal_store(clock), sleep=lambda _s: None)
    renewer = LeaseRenewer(journal, LEASE, thread=False)
    saga: Saga[Order] = Saga("long", input=Order)
    seen: list[object] = []

    @saga.step(compensate=None)
    def slow(ctx: StepContext, order: Order) -> str:
        for _ in range(3):
            clock.advance(LEASE / 2)
            assert renewer.beat_due(force=True) == 1
        seen.append(journal.claim(ctx.saga_id, lease=LEASE))  # another worker tries: refused
        return "done"

    runner = SagaRunner(journal, guard, lease=LEASE, wait=0, renewer=renewer)
    outcome = runner.run(saga, "long-1", ORDER)
    assert outcome.state is SagaState.COMPLETED and seen == [None] and renewer.holding == 0


def test_without_renewal_a_long_step_loses_its_saga(clock: FakeClock) -> None:
    journal = MemoryJournal(clock=clock)
    guard = Guard(journal_store(clock), sleep=lambda _s: None)
    saga: Saga[Order] = Saga("long", input=Order)

    @saga.step(compensate=None)
    def slow(ctx: StepContext, order: Order) -> str:
        clock.advance(LEASE * 2)
        assert journal.claim(ctx.saga_id, lease=LEASE) is not None  # taken over meanwhile
        return "done"

    with pytest.raises(LostSagaLease):
        SagaRunner(journal, guard, lease=LEASE, wait=0, renewer=False).run(saga, "long-2", ORDER)


def test_the_renewer_thread_renews_on_its_own() -> None:
    journal = MemoryJournal()  # real time: the thread's schedule is real
    from sagaguard.idempotency import MemoryStore

    guard = Guard(MemoryStore(), sleep=lambda _s: None)
    saga: Saga[Order] = Saga("threaded", input=Order)
    seen: list[object] = []

    @saga.step(compensate=None)
    def slow(ctx: StepContext, order: Order) -> None:
        time.sleep(0.6)  # twice the lease: the thread renews it every 0.1 s
        seen.append(journal.claim(ctx.saga_id, lease=0.3))

    runner = SagaRunner(journal, guard, lease=0.3, wait=0)
    try:
        assert runner.run(saga, "t-1", ORDER).state is SagaState.COMPLETED
    finally:
        runner.close()
    assert seen == [None]


def journal_store(clock: FakeClock) -> Any:
    from sagaguard.idempotency import MemoryStore

    return MemoryStore(clock=clock)


def test_a_journal_that_no_longer_matches_is_parked_with_a_clear_error(
    journal: SagaJournal, guard: Guard, clock: FakeClock
) -> None:
    trip = Trip(guard)
    trip.crash["reserve"] = 1
    _crash(journal, guard, trip, "s-6")
    clock.advance(LEASE + 1)
    changed: Saga[Order] = Saga("trip", input=Order)  # same name and version, other steps
    changed.step(name="charge", compensate=lambda ctx, o, r: None)(lambda ctx, o: 1)
    changed.step(name="hold_seat", compensate=None)(lambda ctx, o: 2)
    report = recover(journal, guard, changed)
    outcome = report.outcomes["s-6"]
    assert outcome.state is SagaState.NEEDS_ATTENTION
    assert outcome.error is not None and outcome.error.type_name == "sagaguard.saga.errors.StepMismatch"
    assert "'reserve'" in outcome.error.message and "'hold_seat'" in outcome.error.message
    snapshot = journal.load("s-6")
    assert snapshot is not None and snapshot.saga.state is SagaState.NEEDS_ATTENTION
    assert decode_error(snapshot.saga.error or "").type_name == "sagaguard.saga.errors.StepMismatch"


def test_async_sagas_are_recovered_too(journal: SagaJournal, guard: Guard, clock: FakeClock) -> None:
    saga: Saga[Order] = Saga("atrip", input=Order)
    log: list[str] = []
    crashes = [1]

    @saga.step(compensate=None)
    async def first(ctx: StepContext, order: Order) -> int:
        log.append("first")
        if crashes[0]:
            crashes[0] -= 1
            raise Crash("first")
        return 1

    @saga.step(compensate=None)
    def second(ctx: StepContext, order: Order) -> int:
        log.append("second")
        return 2

    with pytest.raises(Crash):
        asyncio.run(_runner(journal, guard).arun(saga, "a-1", ORDER))
    clock.advance(LEASE + 1)
    outcome = recover(journal, guard, saga).outcomes["a-1"]  # drives it with asyncio.run
    assert outcome.state is SagaState.COMPLETED and log == ["first", "first", "second"]
    with pytest.raises(Crash):
        crashes[0] = 1
        asyncio.run(_runner(journal, guard).arun(saga, "a-2", ORDER))
    clock.advance(LEASE + 1)
    report = asyncio.run(arecover(journal, guard, saga))
    assert report.outcomes["a-2"].state is SagaState.COMPLETED


def test_the_worker_sweeps_until_stopped(clock: FakeClock) -> None:
    journal = MemoryJournal(clock=clock)
    guard = Guard(journal_store(clock), sleep=lambda _s: None)
    trip = Trip(guard)
    trip.crash["charge"] = 1
    _crash(journal, guard, trip, "w-1")
    clock.advance(LEASE + 1)
    reports: list[Any] = []
    worker = RecoveryWorker(journal, guard, trip.saga, interval=0.01, on_report=reports.append)
    thread = threading.Thread(target=worker.run)
    thread.start()
    deadline = time.monotonic() + 10
    while not any("w-1" in r.outcomes for r in reports) and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop()
    thread.join(timeout=10)
    assert not thread.is_alive() and worker.stopping
    assert any(r.outcomes.get("w-1") and r.outcomes["w-1"].completed for r in reports)
    worker2 = RecoveryWorker(journal, guard, trip.saga, interval=0.0)
    worker2.run(sweeps=3)
    assert worker2.sweeps == 3


class Beaten:
    """A journal whose due list goes stale at once: another worker claims each saga it lists."""

    def __init__(self, inner: SagaJournal) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def due(self, *, limit: int = 100) -> list[Any]:
        found = self.inner.due(limit=limit)
        for record in found:
            self.inner.claim(record.saga_id, lease=LEASE)
        return found


def test_report_lists_sagas_another_worker_took(clock: FakeClock) -> None:
    journal = MemoryJournal(clock=clock)
    guard = Guard(journal_store(clock), sleep=lambda _s: None)
    trip = Trip(guard)
    trip.crash["charge"] = 1
    _crash(journal, guard, trip, "l-1")
    clock.advance(LEASE + 1)
    report = recover(cast(SagaJournal, Beaten(journal)), guard, trip.saga)
    assert report.found == 1 and report.lost == ("l-1",) and report.outcomes == {}
