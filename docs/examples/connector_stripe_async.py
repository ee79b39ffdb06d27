"""Stripe from async code: ``charge_async`` and friends are the same effects on the SDK's async API.

An async saga charges the card; the hotel is sold out, so the saga compensates and the async refund
compensation refunds what the charge made. A re-run of the charge replays its record (the same
effect, key and record as the sync ``charge``). Here Stripe is the local test server.
"""

import asyncio
import os
import uuid
from dataclasses import dataclass

import tenacity

from sagaguard.connectors.errors import ProviderRejected
from sagaguard.connectors.stripe import Payment, StripeEffects, refund_compensation
from sagaguard.connectors.testing import LocalStripe
from sagaguard.idempotency import Guard, Retry, open_store, scope
from sagaguard.saga import MemoryJournal, Saga, SagaRunner, StepContext


@dataclass
class Trip:
    traveller: str
    amount: int


async def main(stripe_server: LocalStripe, guard: Guard) -> None:
    payments = StripeEffects(guard, api_key=stripe_server.api_key, api_base=stripe_server.api_base)
    trip: Saga[Trip] = Saga("async_trip", input=Trip)

    @trip.step(compensate=refund_compensation(payments, use_async=True))
    async def charge(ctx: StepContext, t: Trip) -> Payment:
        return await payments.charge_async(t.amount, "eur", payment_method="pm_card_visa")

    @trip.step(compensate=None, retry=Retry(stop=tenacity.stop_after_attempt(1)))
    async def book_hotel(ctx: StepContext, t: Trip) -> str:
        raise ProviderRejected("sold out", "hotel", 409)

    saga_id = f"trip-{uuid.uuid4().hex[:8]}"
    runner = SagaRunner(MemoryJournal(), guard, renewer=False)
    try:
        outcome = await runner.arun(trip, saga_id, Trip("ada", 12900))
        with scope(f"{saga_id}/charge"):  # the step's scope: the charge is replayed, not sent
            again = await payments.charge_async(12900, "eur", payment_method="pm_card_visa")
    finally:
        runner.close()
        await payments.aclose()  # the async HTTP client the first async call opened

    counters = stripe_server.counters()
    assert counters["charges"] == 1 and counters["refunds"] == 1
    print(f"saga {outcome.state.value}; {again.id} charged once and refunded once")


guard = Guard(open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///stripe_async.db")))
with LocalStripe(in_process=True) as stripe_server:
    asyncio.run(main(stripe_server, guard))
guard.close()
