"""In doubt: the reply was lost after the provider acted. The next run asks the provider instead of
charging again.
"""

import os

from sagaguard.idempotency import (
    NOT_APPLIED,
    Applied,
    Guard,
    NotAppliedResolution,
    OutcomeUnknown,
    ReconcileRequest,
    current_effect,
    open_store,
    scope,
)

provider: dict[str, int] = {}  # the payment provider's own records, by idempotency key
network_down = True


def psp_charge(amount: int, idempotency_key: str) -> int:
    provider.setdefault(idempotency_key, amount)  # the charge happens...
    if network_down:
        raise TimeoutError("read timed out")  # ...but the reply never arrives
    return amount


def find_charge(request: ReconcileRequest) -> Applied[int] | NotAppliedResolution:
    """Ask the provider whether the lost attempt happened (Stripe: list by metadata)."""
    if request.provider_key in provider:
        return Applied(provider[request.provider_key])
    return NOT_APPLIED


store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///in_doubt.db"))
guard = Guard(store)


@guard.effect("psp.charge", reconciler=find_charge)
def charge(amount: int) -> int:
    return psp_charge(amount, current_effect().provider_key)


with scope("order/2002"):
    try:
        charge(1500)  # a TimeoutError is ambiguous: the record is left IN_DOUBT, not retried
    except OutcomeUnknown as doubt:
        print(f"first run: {doubt}")

network_down = False
with scope("order/2002"):  # the re-run: the reconciler finds the charge and records it
    charge_result = charge(1500)
    assert charge_result == 1500

assert len(provider) <= 1  # charged once (zero when an earlier run of this script already did)
print(f"second run: {charge_result}; charges at the provider from this process: {len(provider)}")
guard.close()
store.close()
