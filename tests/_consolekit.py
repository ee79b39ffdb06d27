"""A small ledger for the console's tests: a waiting saga, a parked one, a completed one, and an
effect left in doubt, written by the real runner and guard (no hand-made rows)."""

from __future__ import annotations

from dataclasses import dataclass, field

import tenacity

from sagaguard.idempotency import Guard, NotApplied
from sagaguard.idempotency.effect import Retry
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import Disposition
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga import Saga, SagaJournal, SagaRunner, SagaState, StepContext


@dataclass
class Order:
    id: str


@dataclass
class Psp:
    """Counts refunds; down until told otherwise."""

    down: bool = True
    refunds: list[str] = field(default_factory=list)

    def refund(self, charge: str) -> None:
        if self.down:
            raise ConnectionError("psp unreachable")
        self.refunds.append(charge)


def sagas(psp: Psp) -> tuple[Saga[Order], Saga[Order]]:
    """``trip`` (hold, wait for approval, finish) and ``refundable`` (charge, then a pivot that
    fails: its refund fails once and the saga needs attention)."""
    trip: Saga[Order] = Saga("trip", input=Order)

    def release(ctx: StepContext, order: Order, hold: str | None) -> None:
        psp.refunds.append(f"release {order.id}")

    @trip.step(compensate=release)
    def hold(ctx: StepContext, order: Order) -> str:
        return f"hold-{order.id}"

    trip.wait("approval", payload=dict)

    @trip.step(compensate=None)
    def finish(ctx: StepContext, order: Order) -> str:
        return "done"

    refundable: Saga[Order] = Saga("refundable", input=Order)

    def refund(ctx: StepContext, order: Order, charge: str | None) -> None:
        psp.refund(f"ch_{order.id}")

    @refundable.step(compensate=refund, compensation_retry=Retry(stop=tenacity.stop_after_attempt(1)))
    def charge(ctx: StepContext, order: Order) -> str:
        return f"ch_{order.id}"

    @refundable.pivot
    def ship(ctx: StepContext, order: Order) -> None:
        raise NotApplied("out of stock")

    return trip, refundable


def populate(store: IdempotencyStore, journal: SagaJournal, psp: Psp) -> dict[str, str]:
    """Write the ledger: returns the ids (``waiting``, ``parked``, ``done`` sagas, ``doubt`` key)."""
    trip, refundable = sagas(psp)
    guard = Guard(store)
    runner = SagaRunner(journal, guard, lease=30, wait=0, sleep=lambda _s: None)
    try:
        assert runner.run(trip, "trip-1", Order("1")).state is SagaState.WAITING
        assert runner.run(trip, "trip-2", Order("2")).state is SagaState.WAITING
        parked = runner.run(refundable, "refund-1", Order("3"))
        assert parked.state is SagaState.NEEDS_ATTENTION, parked
    finally:
        runner.close()
    identity = EffectIdentity.of("default", "pay-1", "stripe.charge", 0)
    claimed = store.claim(identity, "fp", 30.0).record
    store.fail(claimed.key, claimed.token, Disposition.AMBIGUOUS, '{"type": "TimeoutError"}', 60.0)
    return {"waiting": "trip-1", "waiting2": "trip-2", "parked": "refund-1", "doubt": claimed.key}
