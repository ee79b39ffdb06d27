"""Sagas: book a trip (charge the card, reserve the seat, book the hotel, email the receipt).

A full hotel undoes the trip in reverse order; a compensation that keeps failing parks the saga for an
operator, who retries it once the fault is fixed. Every call to the outside world is a guarded effect.
"""

import os
from dataclasses import dataclass

import tenacity

from sagaguard.idempotency import Guard, Retry, open_store
from sagaguard.saga import Saga, SagaRunner, SagaState, StepContext, recover, render, retry
from sagaguard.saga.journals import open_journal


@dataclass
class Trip:
    traveller: str
    amount: int
    hotel: str


world: list[str] = []  # stands in for the card processor, the airline, the hotel and the mail server
full_hotels = {"Hotel Full"}
seat_desk_up = True

url = os.environ.get("SAGAGUARD_STORE", "sqlite:///trips.db")
guard = Guard(open_store(url))
journal = open_journal(url)  # the saga journal can share the store's database
QUICK = Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_fixed(0.01))

trip: Saga[Trip] = Saga("book_trip", version=1, input=Trip)


def refund(ctx: StepContext, t: Trip, charge_id: str | None) -> None:
    world.append(f"refund {charge_id or 'the charge found by its key'}")  # must be idempotent


@trip.step(compensate=refund)
def charge_card(ctx: StepContext, t: Trip) -> str:
    world.append(f"charge {t.amount}")
    return f"ch_{t.traveller}"


def release_seat(ctx: StepContext, t: Trip, seat: str | None) -> None:
    if not seat_desk_up:
        raise ConnectionError("the airline's desk is down")
    world.append(f"release seat {seat}")


@trip.step(compensate=release_seat, compensation_retry=QUICK)
def reserve_seat(ctx: StepContext, t: Trip) -> str:
    world.append("reserve seat 12A")
    return "12A"


@trip.pivot(not_applied=(LookupError,))  # the go/no-go point: after it, only forward
def book_hotel(ctx: StepContext, t: Trip) -> str:
    if t.hotel in full_hotels:
        raise LookupError(f"{t.hotel} is full")  # not applied: nothing to undo at the hotel
    world.append(f"book {t.hotel}")
    return "H-7"


@trip.retriable(retry=QUICK)  # after the pivot: retried, never compensated
def email_receipt(ctx: StepContext, t: Trip) -> None:
    world.append(f"email {t.traveller} the receipt for {ctx.result(book_hotel)}")


runner = SagaRunner(journal, guard)

done = runner.run(trip, "trip-1001", Trip("ana", 420, "Grand Hotel"))
assert done.state is SagaState.COMPLETED, done
print(f"trip-1001: {done.state} (hotel {done.result(book_hotel)})")

undone = runner.run(trip, "trip-1002", Trip("bo", 380, "Hotel Full"))
assert undone.state is SagaState.COMPENSATED, undone
print(f"trip-1002: {undone.state} because {undone.error.message if undone.error else '?'}")

seat_desk_up = False  # releasing the seat now fails: the saga needs an operator
stuck = runner.run(trip, "trip-1003", Trip("cy", 510, "Hotel Full"))
if stuck.state is SagaState.NEEDS_ATTENTION:  # (on a re-run over the same file it is already done)
    seat_desk_up = True  # the desk is back: the operator retries (`sagaguard sagas retry trip-1003`)
    retry(journal, "trip-1003")
    recover(journal, guard, trip)  # what `sagaguard sagas worker` does on its next sweep
snapshot = journal.load("trip-1003")
assert snapshot is not None and snapshot.saga.state is SagaState.COMPENSATED
print(render(snapshot))  # what `sagaguard sagas show trip-1003` prints under "timeline:"
print("\n".join(world))

runner.close()
journal.close()
guard.close()
