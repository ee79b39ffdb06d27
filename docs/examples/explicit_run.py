"""The explicit API: guard a call you cannot decorate, under a key you choose."""

import os

from sagaguard.idempotency import Guard, KeyConflict, open_store

sent: list[str] = []


def send_invoice(customer: str, total: int) -> str:  # e.g. a method of a third-party client
    sent.append(customer)
    return f"inv_{customer}_{total}"


store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///explicit.db"))
guard = Guard(store, namespace="billing")  # a tenant: part of every key's hash


def invoice_once(customer: str, total: int) -> str:
    return guard.run(
        "billing.send_invoice",
        lambda: send_invoice(customer, total),
        arguments={"customer": customer, "total": total},  # must match on replay (the fingerprint)
        key=f"invoice/2026-05/{customer}",  # an explicit key wins over scope + ordinal
        result_type=str,
    )


invoice = invoice_once("cus_7", 4200)
assert invoice_once("cus_7", 4200) == invoice  # replayed
assert len(sent) <= 1

# The same key with other arguments is a conflict, never a silent replay of the first result.
try:
    invoice_once("cus_7", 9999)
except KeyConflict as conflict:
    print(f"refused: {conflict}")
else:
    raise AssertionError("expected KeyConflict")

print(f"{invoice}; invoices sent by this process: {len(sent)}")
guard.close()
store.close()
