"""The worked example: a four-step trip whose every effect and compensation is counted at a
:class:`~sagaguard.idempotency.testing.CounterService`, and its scenario factory and checks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import tenacity

from sagaguard.idempotency.effect import Retry, current_effect
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.testing import Charge, CounterClient
from sagaguard.saga.definition import Saga, StepContext
from sagaguard.saga.records import (
    SagaState,
)
from sagaguard.saga.testing.scenario import Scenario


class TripRejected(RuntimeError):
    """Raised by the step :attr:`Trip.fail_at` names, *after* its effect reached the service: an
    ambiguous failure, so the step's own compensation runs with ``result=None``."""


@dataclass(frozen=True, slots=True)
class Trip:
    """The trip saga's input."""

    order: str
    """Business key: every effect is counted at the service as ``{order}/{effect}``."""
    amount: int = 100
    fail_at: str | None = None
    """A step that fails after its effect (a compensation run), or None."""


TRIP_EFFECTS: Mapping[str, tuple[str, str | None]] = {
    "charge_card": ("card.charge", "card.refund"),
    "reserve_seat": ("seat.reserve", "seat.release"),
    "book_hotel": ("hotel.book", "hotel.cancel"),
    "send_receipt": ("receipt.send", None),
}
"""Each step's effect and the effect that undoes it, as counted at the service."""

_ONE_RETRY = Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())


def trip_saga(guard: Guard, client: CounterClient, *, guarded: bool = True) -> Saga[Trip]:
    """The four-step trip: charge the card, reserve a seat, book a hotel (each undone by a refund,
    a release, a cancellation), then the pivot, sending the receipt.

    Every effect and compensation is an HTTP call to the counter service, guarded with a
    reconciler that asks the service for a call with the effect's provider key, so an effect a
    crash left in doubt is settled by asking the world, never by calling it again.

    Args:
        guard: declares the effects.
        client: talks to the counter service.
        guarded: False makes the effects plain HTTP calls: the negative control, which a crash
            between an effect and its step's commit makes happen twice.
    """
    reconcile = client.reconciler()

    def http_effect(name: str) -> Callable[[str, int], Charge]:
        def call(business_key: str, amount: int) -> Charge:
            return client.charge(business_key, amount, provider_key=current_effect().provider_key)

        def unguarded(business_key: str, amount: int) -> Charge:
            return client.charge(business_key, amount)

        return guard.effect(name, reconciler=reconcile)(call) if guarded else unguarded

    calls = {name: http_effect(name) for pair in TRIP_EFFECTS.values() for name in pair if name}

    def forward(step: str, trip: Trip) -> Charge:
        effect = TRIP_EFFECTS[step][0]
        done = calls[effect](f"{trip.order}/{effect}", trip.amount)
        if trip.fail_at == step:
            raise TripRejected(f"{step} was rejected after {effect}")
        return done

    def undo(ctx: StepContext, trip: Trip, done: Charge | None) -> None:
        effect, reverse = TRIP_EFFECTS[ctx.step]
        assert reverse is not None
        if done is None:
            # The step's result was never recorded (it failed, or crashed, after its effect): ask
            # the service whether the effect happened, by the provider key it was sent under.
            sent = guard.provider_key(EffectIdentity.of(guard.namespace, ctx.step_scope, effect, 0))
            found = client.charges(provider_key=sent)
            if not found:
                return
            done = found[0]
        calls[reverse](f"{trip.order}/{reverse}", done.amount)

    trip: Saga[Trip] = Saga("trip", version=1, input=Trip)

    @trip.step
    def charge_card(ctx: StepContext, t: Trip) -> Charge:
        return forward("charge_card", t)

    @charge_card.compensation
    def refund(ctx: StepContext, t: Trip, charge: Charge | None) -> None:
        undo(ctx, t, charge)

    @trip.step
    def reserve_seat(ctx: StepContext, t: Trip) -> Charge:
        return forward("reserve_seat", t)

    @reserve_seat.compensation
    def release(ctx: StepContext, t: Trip, seat: Charge | None) -> None:
        undo(ctx, t, seat)

    @trip.step(retry=_ONE_RETRY)
    def book_hotel(ctx: StepContext, t: Trip) -> Charge:
        return forward("book_hotel", t)

    @book_hotel.compensation
    def cancel(ctx: StepContext, t: Trip, booking: Charge | None) -> None:
        undo(ctx, t, booking)

    @trip.pivot
    def send_receipt(ctx: StepContext, t: Trip) -> Charge:
        return forward("send_receipt", t)

    return trip


def trip_scenario(guard: Guard, params: Mapping[str, str]) -> Scenario:
    """The scenario factory of :func:`trip_saga` (``sagaguard.saga.testing:trip_scenario``).

    Params: ``service`` (the counter service URL), ``saga_id`` (also the order), ``fail_at``
    (optional step name), ``guarded`` (``no`` for the unguarded negative control).
    """
    saga = trip_saga(guard, CounterClient(params["service"]), guarded=params.get("guarded") != "no")
    return Scenario(saga, Trip(order=params["saga_id"], fail_at=params.get("fail_at") or None))


def trip_ledger(client: CounterClient, order: str) -> dict[str, int]:
    """How often the service saw each effect of ``order``, by effect name (``card.charge``...)."""
    prefix = f"{order}/"
    return {key[len(prefix) :]: n for key, n in client.counts().items() if key.startswith(prefix)}


def trip_problems(state: SagaState | None, ledger: Mapping[str, int]) -> list[str]:
    """What is wrong with a trip's end, counted at the service (empty when nothing is).

    Each effect at most once; a COMPLETED trip made every forward effect once and undid none; a
    COMPENSATED trip undid every forward effect it made, exactly once, and sent no receipt.
    """
    found = [f"{name} happened {n} times" for name, n in sorted(ledger.items()) if n > 1]
    forward = [pair[0] for pair in TRIP_EFFECTS.values()]
    undos = [pair[1] for pair in TRIP_EFFECTS.values() if pair[1]]
    if state is SagaState.COMPLETED:
        found += [f"{name} never happened in a completed trip" for name in forward if not ledger.get(name)]
        found += [f"{name} happened in a completed trip" for name in undos if ledger.get(name, 0)]
    elif state is SagaState.COMPENSATED:
        for effect, reverse in TRIP_EFFECTS.values():
            if reverse and ledger.get(effect, 0) != ledger.get(reverse, 0):
                found.append(f"{effect} x{ledger.get(effect, 0)} but {reverse} x{ledger.get(reverse, 0)}")
        if ledger.get("receipt.send", 0):
            found.append("a compensated trip sent its receipt")
    elif state is not SagaState.NEEDS_ATTENTION:
        found.append(f"the trip ended {state}")
    return found
