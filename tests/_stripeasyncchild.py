"""The child side of the async Stripe SIGKILL test (``tests/test_connector_stripe_async.py``).

Run as ``python tests/_stripeasyncchild.py '<json>'`` with ``$SAGAGUARD_CRASH_AT`` naming where to
die (``before_complete``: Stripe applied the charge, its record is not written). The JSON holds the
store ``spec`` (``StoreFactory.spec``), the local Stripe server's ``url``, the ``scope`` and the
``lease``. One ``await payments.charge_async(...)`` on an event loop; prints one JSON line and exits
as ``tests/_connectorchild.py`` does.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from _connectorchild import EXIT_OK, EXIT_UNKNOWN, NAMESPACE
from _procs import open_backend

from sagaguard.connectors.stripe import StripeEffects
from sagaguard.idempotency import Guard, OutcomeUnknown, scope
from sagaguard.idempotency.testing import CrashingStore


async def charge(guard: Guard, config: dict[str, Any]) -> dict[str, Any]:
    payments = StripeEffects(guard, api_key="sk_test_local", api_base=config["url"], timeout=5.0)
    try:
        with scope(config["scope"]):
            payment = await payments.charge_async(4200, "usd", payment_method="pm_card_visa")
    finally:
        await payments.aclose()
    return {"id": payment.id, "status": payment.status}


def main(config: dict[str, Any]) -> int:
    spec = config["spec"]
    inner = open_backend(
        spec["backend"], spec["url"], clock=None, table_name=spec["table_name"], prefix=spec["prefix"]
    )
    store = CrashingStore(inner)  # dies where $SAGAGUARD_CRASH_AT says
    guard = Guard(store, namespace=NAMESPACE, lease=config["lease"], wait=20.0, sleep=time.sleep)
    try:
        result = asyncio.run(charge(guard, config))
    except OutcomeUnknown as exc:
        print(json.dumps({"outcome": "unknown", "key": exc.key}), flush=True)
        return EXIT_UNKNOWN
    finally:
        guard.close()
        store.close()
    print(json.dumps({"outcome": "ok", **result}), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
