from dataclasses import dataclass

from sagaguard.idempotency import Guard, current_effect, open_store, scope


@dataclass
class Receipt:
    charge_id: str


guard = Guard(open_store("sqlite:///sagaguard.db"))  # or postgresql://..., redis://...


@guard.effect("stripe.charge")
def charge(customer: str, amount: int) -> Receipt:
    key = current_effect().provider_key  # pass to Stripe as idempotency_key=key
    return Receipt(charge_id=f"ch_{key[-8:]}")  # your real call goes here


with scope("order-1001"):  # the unit of work that a crash or a replay re-runs
    print(charge("cus_42", 1000))  # runs once; every re-run replays the receipt
