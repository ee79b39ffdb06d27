"""Stripe: a charge whose answer is lost is charged once; a crash between the charge and its record
is settled by asking Stripe (here the local Stripe-compatible test server, with the real SDK)."""

import os

from sagaguard.connectors.stripe import StripeEffects
from sagaguard.connectors.testing import LocalStripe
from sagaguard.idempotency import Guard, open_store, scope

store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///stripe.db"))
guard = Guard(store)

with LocalStripe(in_process=True) as stripe_server:
    payments = StripeEffects(
        guard, api_key=stripe_server.api_key, api_base=stripe_server.api_base, timeout=0.5
    )
    # Stripe applies the charge, then the answer is lost: the guard re-sends under the same
    # Idempotency-Key, and Stripe replays its first answer instead of charging again.
    stripe_server.fault("timeout", "/v1/payment_intents", method="POST", seconds=1.0)
    with scope("order/3003"):
        payment = payments.charge(1999, "eur", payment_method="pm_card_visa")
    with scope("order/3003"):  # a re-run of the same unit of work replays the record
        assert payments.charge(1999, "eur", payment_method="pm_card_visa") == payment

    # The saga failed later: refund what the charge made, found by the charge's identity.
    with scope("order/3003/~compensate"):
        refunds = payments.undo_charges("order/3003")

    counters = stripe_server.counters()
    assert counters["charges"] == 1 and counters["refunds"] == 1
    print(f"{payment.id}: {payment.status}, refunded {refunds[0].amount} {refunds[0].currency}")
    print(f"charges at Stripe: {counters['charges']}, replayed answers: {counters['replays']}")

guard.close()
store.close()
