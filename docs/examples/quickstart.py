"""Quickstart: a guarded charge runs once, however often its unit of work is re-run.

Run it twice: the second run charges nothing and prints the receipt the first run recorded.
"""

import os
from dataclasses import dataclass

from sagaguard.idempotency import Guard, current_effect, open_store, scope


@dataclass
class Receipt:
    charge_id: str
    amount: int


charges: list[str] = []  # stands in for the payment provider: one entry per real charge

store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///quickstart.db"))
guard = Guard(store)


@guard.effect("payments.charge")
def charge(customer: str, amount: int) -> Receipt:
    # A provider that deduplicates gets the effect's provider key (Stripe: idempotency_key=...).
    provider_key = current_effect().provider_key
    charges.append(provider_key)
    return Receipt(charge_id=f"ch_{provider_key[-8:]}", amount=amount)


def place_order(order_id: str) -> Receipt:
    with scope(f"order/{order_id}"):  # the unit of work a crash or a replay re-runs from its start
        return charge("cus_42", 1000)


first = place_order("1001")
again = place_order("1001")  # the re-run: the recorded receipt comes back, nothing is charged
assert again == first
assert len(charges) <= 1
print(f"receipt {first.charge_id}; charges made by this process: {len(charges)}")

guard.close()
store.close()
