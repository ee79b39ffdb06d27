"""Running sagas end to end, on every journal: memory, SQLite, Postgres and Redis.

Each test gets its own data set (``tests/_sagajournals.py``): a SQLite file, a Postgres table prefix,
a Redis key prefix, dropped after. When Postgres or Redis does not answer its tests skip with the
reason, unless ``CI=true``: then they fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tenacity
from _sagajournals import JOURNALS, factory_for

from sagaguard.idempotency import Guard, KeyConflict, MemoryStore, NotApplied
from sagaguard.idempotency.effect import Retry
from sagaguard.idempotency.keys import EffectIdentity, fingerprint
from sagaguard.saga import (
    LostSagaLease,
    Phase,
    Saga,
    SagaInProgress,
    SagaJournal,
    SagaRunner,
    SagaState,
    StepContext,
    StepKind,
    StepRecord,
    StepState,
)

FAST = Retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_none())
ONCE = Retry(stop=tenacity.stop_after_attempt(1), wait=tenacity.wait_none())


class Clock:
    """A settable clock for journals and stores."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def saga_clock() -> Clock:
    return Clock()


@pytest.fixture(params=JOURNALS)
def journal(request: pytest.FixtureRequest, saga_clock: Clock, tmp_path: Path) -> Iterator[SagaJournal]:
    for factory in factory_for(request.param, saga_clock, tmp_path):  # type: ignore[arg-type]
        yield factory.open()


@pytest.fixture
def guard(saga_clock: Clock) -> Iterator[Guard]:
    g = Guard(MemoryStore(clock=saga_clock), sleep=lambda _s: None)
    yield g
    g.close()


@pytest.fixture
def runner(journal: SagaJournal, guard: Guard) -> SagaRunner:
    return SagaRunner(journal, guard, lease=30, wait=0, sleep=lambda _s: None)


@dataclass
class Order:
    id: str
    amount: int


@dataclass
class Receipt:
    charge_id: str
    amount: int


class CardDeclined(Exception):
    pass


class Trip:
    """A four-step saga whose steps log what they did; ``fail`` makes a step raise."""

    def __init__(self, guard: Guard, *, fail: dict[str, Any] | None = None) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.effects: list[str] = []
        self.fail = fail or {}
        self.undo_fail: set[str] = set()
        effects = self.effects

        @guard.effect("psp.charge")
        def psp_charge(order_id: str, amount: int) -> Receipt:
            effects.append("psp.charge")
            return Receipt(f"ch_{order_id}", amount)

        self.psp_charge = psp_charge
        s: Saga[Order] = Saga("trip", version=1, input=Order)
        self.saga = s

        def refund(ctx: StepContext, order: Order, receipt: Receipt | None) -> None:
            self._undo("charge", ctx, order, receipt)

        @s.step(compensate=refund, retry=FAST)
        def charge(ctx: StepContext, order: Order) -> Receipt:
            self._act("charge", ctx)
            return psp_charge(order.id, order.amount)

        @s.step(retry=FAST, compensation_retry=FAST, not_applied=(CardDeclined,))
        def reserve(ctx: StepContext, order: Order) -> int:
            self._act("reserve", ctx)
            return 12

        @reserve.compensation
        def release(ctx: StepContext, order: Order, seat: int | None) -> None:
            self._undo("reserve", ctx, order, seat)

        @s.step(retry=FAST, not_applied=(CardDeclined,))
        def hotel(ctx: StepContext, order: Order) -> str:
            self._act("hotel", ctx)
            return "h1"

        @hotel.compensation
        def cancel_hotel(ctx: StepContext, order: Order, booking: str | None) -> None:
            self._undo("hotel", ctx, order, booking)

        @s.pivot(retry=FAST)
        def book(ctx: StepContext, order: Order) -> str:
            self._act("book", ctx)
            return "bk"

        @s.retriable(retry=Retry(stop=tenacity.stop_after_attempt(4), wait=tenacity.wait_none()))
        def email(ctx: StepContext, order: Order) -> None:
            self._act("email", ctx)
            assert ctx.result(charge).amount == order.amount

        self.charge, self.reserve, self.email = charge, reserve, email

    def _act(self, name: str, ctx: StepContext) -> None:
        self.log.append(("act", name, ctx.attempt))
        failure = self.fail.get(name)
        if isinstance(failure, list) and failure:
            raise failure.pop(0)
        if isinstance(failure, BaseException):
            raise failure

    def _undo(self, name: str, ctx: StepContext, order: Order, result: Any) -> None:
        assert ctx.compensating and ctx.step == name and ctx.step_scope == f"{ctx.saga_id}/{name}"
        self.log.append(("undo", name, order.id, result))
        if name in self.undo_fail:
            raise RuntimeError(f"cannot undo {name}")

    def acts(self) -> list[str]:
        return [e[1] for e in self.log if e[0] == "act"]

    def undos(self) -> list[tuple[Any, ...]]:
        return [e[1:] for e in self.log if e[0] == "undo"]


ORDER = Order("o1", 500)


def test_happy_path(runner: SagaRunner, guard: Guard, journal: SagaJournal) -> None:
    trip = Trip(guard)
    outcome = runner.run(trip.saga, "s-1", ORDER)
    assert outcome.state is SagaState.COMPLETED and outcome.completed and not outcome.replayed
    assert outcome.result(trip.charge) == Receipt("ch_o1", 500)
    assert outcome.results == {
        "charge": Receipt("ch_o1", 500),
        "reserve": 12,
        "hotel": "h1",
        "book": "bk",
        "email": None,
    }
    assert trip.acts() == ["charge", "reserve", "hotel", "book", "email"]
    assert trip.undos() == []
    snapshot = journal.load("s-1")
    assert snapshot is not None and snapshot.saga.lease_until == 0
    assert [r.state for r in snapshot.steps] == [StepState.SUCCEEDED] * 5
    assert snapshot.steps[0].compensation is not None and snapshot.steps[3].compensation is None


def test_failure_compensates_in_reverse_with_inputs_and_results(runner: SagaRunner, guard: Guard) -> None:
    trip = Trip(guard, fail={"hotel": RuntimeError("hotel down")})
    outcome = runner.run(trip.saga, "s-2", ORDER)
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.message == "hotel down"
    # retried 3 times (ambiguous), then its own compensation (result None) and the others, reversed
    assert trip.acts() == ["charge", "reserve", "hotel", "hotel", "hotel"]
    assert trip.undos() == [
        ("hotel", "o1", None),
        ("reserve", "o1", 12),
        ("charge", "o1", Receipt("ch_o1", 500)),
    ]


def test_not_applied_failure_skips_its_own_compensation(
    runner: SagaRunner, guard: Guard, journal: SagaJournal
) -> None:
    trip = Trip(guard, fail={"hotel": CardDeclined("no")})
    outcome = runner.run(trip.saga, "s-3", ORDER)
    assert outcome.state is SagaState.COMPENSATED
    assert trip.acts() == ["charge", "reserve", "hotel"]  # not applied: not retried
    assert [u[0] for u in trip.undos()] == ["reserve", "charge"]
    snapshot = journal.load("s-3")
    assert snapshot is not None
    hotel = snapshot.steps[2]
    assert hotel.state is StepState.FAILED and hotel.not_applied


def test_first_step_not_applied_fails_with_nothing_to_undo(runner: SagaRunner, guard: Guard) -> None:
    trip = Trip(guard, fail={"charge": NotApplied("declined")})
    outcome = runner.run(trip.saga, "s-3b", ORDER)
    assert outcome.state is SagaState.FAILED
    assert trip.undos() == []


def test_after_the_pivot_failures_are_retried_forward(runner: SagaRunner, guard: Guard) -> None:
    trip = Trip(guard, fail={"email": [RuntimeError("smtp"), RuntimeError("smtp")]})
    outcome = runner.run(trip.saga, "s-4", ORDER)
    assert outcome.state is SagaState.COMPLETED
    assert trip.acts()[-3:] == ["email", "email", "email"]
    assert trip.undos() == []


def test_forward_retries_exhausted_needs_attention_never_compensates(
    runner: SagaRunner, guard: Guard, journal: SagaJournal
) -> None:
    trip = Trip(guard, fail={"email": RuntimeError("smtp")})
    outcome = runner.run(trip.saga, "s-4b", ORDER)
    assert outcome.state is SagaState.NEEDS_ATTENTION
    assert outcome.error is not None and "smtp" in outcome.error.message
    assert trip.undos() == []
    assert journal.list(states=[SagaState.NEEDS_ATTENTION])[0].saga_id == "s-4b"


def test_pivot_failing_ambiguously_needs_attention(runner: SagaRunner, guard: Guard) -> None:
    trip = Trip(guard, fail={"book": TimeoutError("maybe booked")})
    outcome = runner.run(trip.saga, "s-4c", ORDER)
    assert outcome.state is SagaState.NEEDS_ATTENTION
    assert trip.undos() == []


def test_pivot_not_applied_compensates(runner: SagaRunner, guard: Guard) -> None:
    trip = Trip(guard, fail={"book": NotApplied("sold out")})
    outcome = runner.run(trip.saga, "s-4d", ORDER)
    assert outcome.state is SagaState.COMPENSATED
    assert [u[0] for u in trip.undos()] == ["hotel", "reserve", "charge"]


def test_compensation_exhausting_retries_needs_attention(
    runner: SagaRunner, guard: Guard, journal: SagaJournal
) -> None:
    trip = Trip(guard, fail={"hotel": CardDeclined("no")})
    trip.undo_fail.add("reserve")
    outcome = runner.run(trip.saga, "s-5", ORDER)
    assert outcome.state is SagaState.NEEDS_ATTENTION
    assert outcome.error is not None and outcome.error.message == "cannot undo reserve"
    assert [u[0] for u in trip.undos()] == ["reserve"] * 3  # stops there: charge is not undone
    snapshot = journal.load("s-5")
    assert snapshot is not None
    reserve, charge = snapshot.steps[1], snapshot.steps[0]
    assert reserve.state is StepState.COMPENSATION_FAILED and reserve.compensation_attempts == 3
    assert reserve.compensation_error is not None and "cannot undo" in reserve.compensation_error
    assert charge.state is StepState.SUCCEEDED


def test_same_saga_id_returns_the_recorded_outcome(runner: SagaRunner, guard: Guard) -> None:
    trip = Trip(guard, fail={"hotel": CardDeclined("no")})
    first = runner.run(trip.saga, "s-6", ORDER)
    calls = len(trip.log)
    again = runner.run(trip.saga, "s-6", ORDER)
    assert again.replayed and again.state is first.state and again.results == first.results
    assert again.error == first.error
    assert len(trip.log) == calls


def test_other_input_under_the_same_id_is_a_key_conflict(runner: SagaRunner, guard: Guard) -> None:
    trip = Trip(guard)
    runner.run(trip.saga, "s-7", ORDER)
    with pytest.raises(KeyConflict):
        runner.run(trip.saga, "s-7", Order("o1", 999))


def test_live_saga_elsewhere_is_in_progress(runner: SagaRunner, guard: Guard, journal: SagaJournal) -> None:
    trip = Trip(guard)
    journal.start(
        "s-8", name="trip", version=1, input="{}", fingerprint=fingerprint({"input": ORDER}), lease=30
    )
    with pytest.raises(SagaInProgress):
        runner.run(trip.saga, "s-8", ORDER)


def _crash_after_effect(journal: SagaJournal, trip: Trip, saga_id: str) -> int:
    """Journal: charge SUCCEEDED, reserve STARTED (compensation registered), as a crashed runner
    left it. Returns the runner's token."""
    started = journal.start(
        saga_id,
        name="trip",
        version=1,
        input='{"id":"o1","amount":500}',
        fingerprint=fingerprint({"input": ORDER}),
        lease=30,
    )
    charge = trip.saga.steps[0]
    token = started.snapshot.saga.token
    journal.commit(
        saga_id,
        token,
        Phase(
            steps=(
                StepRecord(
                    0,
                    "charge",
                    StepKind.COMPENSATABLE,
                    StepState.SUCCEEDED,
                    compensation=charge.compensation_name,
                    result=charge.codec.encode(Receipt("ch_o1", 500)),
                    attempts=1,
                ),
                StepRecord(
                    1,
                    "reserve",
                    StepKind.COMPENSATABLE,
                    StepState.STARTED,
                    compensation=trip.saga.steps[1].compensation_name,
                ),
            ),
            lease=30,
        ),
    )
    return token


def test_resume_after_a_crash_mid_step(
    runner: SagaRunner, guard: Guard, journal: SagaJournal, saga_clock: Clock
) -> None:
    trip = Trip(guard)
    # The crashed runner had charged through the guard in the charge step's scope.
    from sagaguard.idempotency.keys import scope

    with scope("s-9/charge"):
        trip.psp_charge("o1", 500)
    token = _crash_after_effect(journal, trip, "s-9")
    saga_clock.now += 31  # the crashed runner's lease runs out
    outcome = runner.run(trip.saga, "s-9", ORDER)
    assert outcome.state is SagaState.COMPLETED
    assert trip.acts() == ["reserve", "hotel", "book", "email"]  # charge is not run again
    assert trip.effects == ["psp.charge"]
    # the crashed runner is fenced out
    with pytest.raises(LostSagaLease):
        journal.commit("s-9", token, Phase(lease=30))


def test_resume_rerun_replays_guarded_effects(
    runner: SagaRunner, guard: Guard, journal: SagaJournal, saga_clock: Clock
) -> None:
    trip = Trip(guard)
    from sagaguard.idempotency.keys import scope

    _crash_after_effect(journal, trip, "s-10")
    # Step 0 is recorded; re-running the saga from a crash *inside* charge would replay its charge:
    journal_step = journal.load("s-10")
    assert journal_step is not None and journal_step.steps[1].state is StepState.STARTED
    with scope("s-10/charge"):
        first = trip.psp_charge("o1", 500)
    with scope("s-10/charge"):
        again = trip.psp_charge("o1", 500)
    assert first == again and trip.effects == ["psp.charge"]


def test_crash_between_effect_and_record_compensates_with_none(
    runner: SagaRunner, guard: Guard, journal: SagaJournal, saga_clock: Clock
) -> None:
    trip = Trip(guard)

    @guard.effect("seat.hold")
    def hold(order_id: str) -> int:
        return 12

    trip.saga.steps[1].action = lambda ctx, order: hold(order.id)
    _crash_after_effect(journal, trip, "s-11")
    # The crashed runner claimed the seat effect and died before recording it.
    identity = EffectIdentity.of(guard.namespace, "s-11/reserve", "seat.hold", 0)
    guard.store.claim(identity, fingerprint({"order_id": "o1"}), 30)
    saga_clock.now += 31
    outcome = runner.run(trip.saga, "s-11", ORDER)
    # in doubt (at most once): the step fails as maybe-applied, so its compensation runs with None
    assert outcome.state is SagaState.COMPENSATED
    assert trip.undos() == [("reserve", "o1", None), ("charge", "o1", Receipt("ch_o1", 500))]


def test_async_run(journal: SagaJournal, guard: Guard) -> None:
    runner = SagaRunner(journal, guard, lease=30, wait=0, async_sleep=_no_sleep)
    s: Saga[Order] = Saga("atrip", input=Order)
    log: list[Any] = []

    async def unhold(ctx: StepContext, order: Order, seat: int | None) -> None:
        log.append(("unhold", seat))

    @guard.effect("a.hold")
    async def hold_effect(order_id: str) -> int:
        log.append("hold-effect")
        return 3

    @s.step(compensate=unhold, retry=FAST)
    async def hold(ctx: StepContext, order: Order) -> int:
        return await hold_effect(order.id)

    def unsync(ctx: StepContext, order: Order, result: str | None) -> None:
        log.append(("unsync", result))

    @s.step(compensate=unsync, retry=FAST)
    def sync_step(ctx: StepContext, order: Order) -> str:
        return "s"

    @s.step(compensate=None, retry=FAST)
    async def boom(ctx: StepContext, order: Order) -> None:
        raise NotApplied("nope")

    outcome = asyncio.run(runner.arun(s, "a-1", ORDER))
    assert outcome.state is SagaState.COMPENSATED
    assert log == ["hold-effect", ("unsync", "s"), ("unhold", 3)]
    again = asyncio.run(runner.arun(s, "a-1", ORDER))
    assert again.replayed and again.results == {"hold": 3, "sync_step": "s"}


async def _no_sleep(_seconds: float) -> None:
    return None


def test_sync_run_refuses_async_steps(runner: SagaRunner) -> None:
    from sagaguard.idempotency.errors import ConfigurationError

    s: Saga[Order] = Saga("x", input=Order)

    @s.step(compensate=None)
    async def a(ctx: StepContext, order: Order) -> None: ...

    with pytest.raises(ConfigurationError, match="arun"):
        runner.run(s, "x-1", ORDER)
