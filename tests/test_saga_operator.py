"""Operator controls: a saga that needs attention is retried, or resolved by hand, and its timeline
shows it all. Every journal backend (memory, SQLite, Postgres, Redis) runs the same stories; the CLI
runs them on SQLite.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tenacity
from _sagajournals import JOURNALS, JournalFactory, factory_for
from conftest import FakeClock

from sagaguard.idempotency import Guard
from sagaguard.idempotency.effect import Retry
from sagaguard.idempotency.stores.memory import MemoryStore
from sagaguard.saga import (
    NotParked,
    Saga,
    SagaJournal,
    SagaNotFound,
    SagaRunner,
    SagaState,
    StepContext,
    StepState,
    recover,
    render,
    resolve,
    retry,
    timeline,
)
from sagaguard.saga.cli import main
from sagaguard.saga.journals.sql import SqlJournal

pytestmark = pytest.mark.timeout(120)

TWICE = Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())


@dataclass
class Order:
    id: str
    amount: int


ORDER = Order("o-1", 420)


class Trip:
    """charge the card -> reserve the seat -> book the hotel (fails when ``hotel_full``) -> email.

    ``seat_desk_down`` makes releasing the seat fail (the fault an operator fixes or works around).
    """

    def __init__(self) -> None:
        self.log: list[str] = []
        self.hotel_full = True
        self.seat_desk_down = True
        self.ask_after_pivot = 0
        trip: Saga[Order] = Saga("trip_op", input=Order)
        self.saga = trip

        def refund(ctx: StepContext, order: Order, charged: int | None) -> None:
            self.log.append(f"refund {charged}")

        @trip.step(compensate=refund, retry=TWICE, compensation_retry=TWICE)
        def charge_card(ctx: StepContext, order: Order) -> int:
            self.log.append("charge")
            return order.amount

        def release(ctx: StepContext, order: Order, seat: str | None) -> None:
            if self.seat_desk_down:
                self.log.append("release failed")
                raise ConnectionError("seat desk unreachable")
            self.log.append(f"release {seat}")

        @trip.step(compensate=release, retry=TWICE, compensation_retry=TWICE)
        def reserve_seat(ctx: StepContext, order: Order) -> str:
            self.log.append("reserve")
            return "12A"

        @trip.pivot(retry=TWICE, not_applied=(LookupError,))
        def book_hotel(ctx: StepContext, order: Order) -> str:
            self.log.append("book")
            if self.hotel_full:
                raise LookupError("hotel full")
            return "H-7"

        @trip.retriable(retry=TWICE)
        def email_receipt(ctx: StepContext, order: Order) -> None:
            self.log.append("email")
            if self.ask_after_pivot > 0:
                self.ask_after_pivot -= 1
                raise ConnectionError("smtp down")


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


def _runner(journal: SagaJournal, guard: Guard) -> SagaRunner:
    return SagaRunner(journal, guard, sleep=lambda _s: None, renewer=False)


def _parked(journal: SagaJournal, guard: Guard, trip: Trip, saga_id: str = "trip-1") -> None:
    outcome = _runner(journal, guard).run(trip.saga, saga_id, ORDER)
    assert outcome.state is SagaState.NEEDS_ATTENTION
    snapshot = journal.load(saga_id)
    assert snapshot is not None
    states = {row.name: row.state for row in snapshot.steps}
    assert states == {
        "charge_card": StepState.SUCCEEDED,
        "reserve_seat": StepState.COMPENSATION_FAILED,
        "book_hotel": StepState.FAILED,
    }
    assert trip.log[-5:] == ["charge", "reserve", "book", "release failed", "release failed"]


def test_exhausted_compensation_needs_attention_then_retry_compensates(
    journal: SagaJournal, guard: Guard
) -> None:
    trip = Trip()
    _parked(journal, guard, trip)
    with pytest.raises(NotParked):
        resolve(journal, "trip-1", "charge_card")  # its compensation did not fail
    trip.seat_desk_down = False  # the operator fixed the fault
    record = retry(journal, "trip-1")
    assert record.state is SagaState.COMPENSATING
    with pytest.raises(NotParked):
        retry(journal, "trip-1")  # a second click finds it no longer parked
    report = recover(journal, guard, trip.saga)
    assert report.outcomes["trip-1"].state is SagaState.COMPENSATED
    assert trip.log[-2:] == ["release 12A", "refund 420"]
    snapshot = journal.load("trip-1")
    assert snapshot is not None
    rows = {row.name: row for row in snapshot.steps}
    assert rows["reserve_seat"].state is StepState.COMPENSATED
    assert rows["reserve_seat"].compensation_attempts == 3
    assert rows["charge_card"].state is StepState.COMPENSATED
    text = render(snapshot)
    assert "step reserve_seat: compensated  (3 compensation attempts; earlier error ConnectionError" in text
    assert "step book_hotel: failed  (1 attempt; not applied; LookupError: hotel full)" in text
    assert "step charge_card: compensated  (1 compensation attempt)" in text
    assert text.splitlines()[-1].split("saga: ", 1)[1].startswith("compensated")


def test_resolved_by_hand_continues_with_earlier_compensations(journal: SagaJournal, guard: Guard) -> None:
    trip = Trip()
    _parked(journal, guard, trip)
    record = resolve(journal, "trip-1", "reserve_seat", note="seat released by phone")
    assert record.state is SagaState.COMPENSATING
    report = recover(journal, guard, trip.saga)
    assert report.outcomes["trip-1"].state is SagaState.COMPENSATED
    assert trip.log[-1] == "refund 420"
    assert "release 12A" not in trip.log  # the operator did it; the compensation is not re-run
    snapshot = journal.load("trip-1")
    assert snapshot is not None
    events = [(e.step or "", e.what) for e in timeline(snapshot)]
    assert events[0] == ("", "created") and events[-1] == ("", "compensated")
    assert sorted(events) == sorted(
        [
            ("", "created"),
            ("charge_card", "started"),
            ("charge_card", "succeeded"),
            ("reserve_seat", "started"),
            ("reserve_seat", "succeeded"),
            ("book_hotel", "started"),
            ("book_hotel", "failed"),
            ("charge_card", "compensated"),
            ("reserve_seat", "resolved by hand"),
            ("", "compensated"),
        ]
    )
    assert "seat released by phone; after 2 compensation attempts" in render(snapshot)


def test_retry_after_the_pivot_goes_forward(journal: SagaJournal, guard: Guard) -> None:
    trip = Trip()
    trip.hotel_full = False
    trip.ask_after_pivot = 2  # both tries of the retriable step fail
    outcome = _runner(journal, guard).run(trip.saga, "trip-2", ORDER)
    assert outcome.state is SagaState.NEEDS_ATTENTION
    record = retry(journal, "trip-2")
    assert record.state is SagaState.RUNNING
    report = recover(journal, guard, trip.saga)
    assert report.outcomes["trip-2"].state is SagaState.COMPLETED
    assert trip.log.count("email") == 3 and not any(e.startswith("refund") for e in trip.log)


def test_operator_actions_refuse_what_does_not_need_attention(journal: SagaJournal, guard: Guard) -> None:
    trip = Trip()
    trip.hotel_full = False
    assert _runner(journal, guard).run(trip.saga, "trip-3", ORDER).completed
    with pytest.raises(NotParked) as info:
        retry(journal, "trip-3")
    assert info.value.state is SagaState.COMPLETED
    with pytest.raises(NotParked):
        resolve(journal, "trip-3", "reserve_seat")
    with pytest.raises(SagaNotFound):
        retry(journal, "nope")


# ------------------------------------------------------------------------------------------- CLI


def test_cli_retry_resolve_and_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/ops.db"
    monkeypatch.setenv("SAGAGUARD_JOURNAL", url)
    journal = SqlJournal(url)
    guard = Guard(MemoryStore(), sleep=lambda _s: None)
    trip = Trip()
    try:
        _parked(journal, guard, trip, "trip-a")
        _parked(journal, guard, trip, "trip-b")
        trip.hotel_full = False
        assert _runner(journal, guard).run(trip.saga, "trip-c", ORDER).completed
        capsys.readouterr()

        assert main(["sagas", "list"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in lines[1:]] == ["trip-a", "trip-b", "trip-c"]
        assert "needs_attention" in lines[1] and "completed" in lines[3]

        assert main(["sagas", "show", "trip-a"]) == 0
        shown = capsys.readouterr().out
        assert "timeline:" in shown
        assert "step reserve_seat: compensation failed  (2 compensation attempts; ConnectionError" in shown

        trip.seat_desk_down = False
        assert main(["sagas", "retry", "trip-a"]) == 0
        assert "compensating, due now" in capsys.readouterr().out
        assert main(["sagas", "retry", "trip-a"]) == 1
        assert "not needs_attention" in capsys.readouterr().err

        assert main(["sagas", "resolve", "trip-b", "charge_card"]) == 1
        assert "no failed compensation" in capsys.readouterr().err
        assert main(["sagas", "resolve", "trip-b", "reserve_seat", "--note", "done by phone"]) == 0
        capsys.readouterr()

        report = recover(journal, guard, trip.saga)
        assert {k: v.state for k, v in report.outcomes.items()} == {
            "trip-a": SagaState.COMPENSATED,
            "trip-b": SagaState.COMPENSATED,
        }
        assert main(["sagas", "show", "trip-b"]) == 0
        assert "step reserve_seat: resolved by hand  (done by phone" in capsys.readouterr().out
    finally:
        journal.close()


def test_a_journal_created_before_schema_3_gains_the_new_step_columns(tmp_path: Path) -> None:
    """Schema 3 added the steps' ``trace`` and ``resolution``: an older table is upgraded in place."""
    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path}/old.db"
    SqlJournal(url).close()
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # what a schema-2 table looks like
        conn.execute(sa.text("ALTER TABLE sagaguard_saga_steps DROP COLUMN trace"))
        conn.execute(sa.text("ALTER TABLE sagaguard_saga_steps DROP COLUMN resolution"))
        conn.execute(sa.text("DROP TABLE sagaguard_journal_version"))  # made before versioned schemas
    engine.dispose()
    journal = SqlJournal(url, create=True)  # create=True: upgraded in place
    try:
        trip = Trip()
        guard = Guard(MemoryStore(), sleep=lambda _s: None)
        _parked(journal, guard, trip)
        resolve(journal, "trip-1", "reserve_seat", note="by hand")
        snapshot = journal.load("trip-1")
        assert snapshot is not None and snapshot.step(1) is not None
        assert snapshot.steps[1].resolution == "by hand"
    finally:
        journal.close()
