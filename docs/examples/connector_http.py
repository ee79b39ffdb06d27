"""HTTP: a write carries an IETF Idempotency-Key derived from the effect; an answer lost after the
server applied it is re-sent under the same key and absorbed (here by the local test API)."""

import os

import httpx

from sagaguard.connectors.http import IdempotentHttp
from sagaguard.connectors.testing import LocalIdempotentApi
from sagaguard.idempotency import Guard, open_store, scope

store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///http.db"))
guard = Guard(store)

with LocalIdempotentApi(in_process=True) as api, httpx.Client(base_url=api.url, timeout=0.5) as client:
    billing = IdempotentHttp(guard, client)
    api.fault("timeout", "/invoices", method="POST", seconds=1.0)  # applied, answer lost
    with scope("order/4004"):
        invoice = billing.post("/invoices", json={"order": "4004", "total": 1999}, name="billing.invoice")
    with scope("order/4004"):  # the re-run replays the recorded answer: no request at all
        again = billing.post("/invoices", json={"order": "4004", "total": 1999}, name="billing.invoice")
        assert again == invoice

    counters = api.counters()
    assert counters["applied"] == 1
    print(f"invoice {invoice.json()['id']} ({invoice.status_code}) under key {invoice.json()['key'][:12]}...")
    print(f"applied at the server: {counters['applied']}, replayed answers: {counters['replays']}")

guard.close()
store.close()
