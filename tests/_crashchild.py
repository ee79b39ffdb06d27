"""The child side of ``tests/test_crash.py``: one guarded charge in a process that may be SIGKILLed.

Run as ``python tests/_crashchild.py '<json>'`` with ``$SAGAGUARD_CRASH_AT`` naming where to die
(a store point handled by :class:`~sagaguard.idempotency.testing.CrashingStore`, or ``after_effect`` inside
the effect body). The JSON holds the store ``spec`` (see ``StoreFactory.spec``), the counter ``service``
URL, the ``scope`` (also the business key charged at the service), the resolution ``mode`` and the
``lease`` in seconds; with ``gate`` set, the child says ``ready`` once warmed up (imports done, store
open) and claims only after a line arrives on its stdin.

Modes (how an in-doubt charge is settled after a crash):
    reconciler: ask the service ``GET /charges?provider_key=...``.
    provider:   ``provider_idempotent=True``; the charge carries an ``Idempotency-Key`` header the
                service deduplicates on, so a re-send is absorbed.
    none:       neither: the default at-most-once policy raises ``OutcomeUnknown``.

The store runs on its server's own clock (``clock=None``): a child cannot share the test's fake
clock, so leases are short and real, and a restarted child waits for the dead one's lease the way
any duplicate does, by polling the record through the guard (``wait=``), not by sleeping blindly.

Prints one JSON line and exits :data:`EXIT_OK` with the charge and the fencing ``token`` the effect
body ran under (null when it did not run: a replay, a reconciled charge), or :data:`EXIT_UNKNOWN`
with the in-doubt record's key and token; both say how long the guard ``waited`` for a live claim.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

from _procs import open_backend

from sagaguard.idempotency import Guard, OutcomeUnknown, current_effect, scope
from sagaguard.idempotency.testing import Charge, CounterClient, CrashingStore, crash_point

EXIT_OK = 0
EXIT_UNKNOWN = 3
NAMESPACE = "crash-tests"
EFFECT = "charge"
AMOUNT = 1000


def main(config: dict[str, Any]) -> int:
    spec = config["spec"]
    inner = open_backend(
        spec["backend"], spec["url"], clock=None, table_name=spec["table_name"], prefix=spec["prefix"]
    )
    store = CrashingStore(inner)  # dies where $SAGAGUARD_CRASH_AT says, if it names a store point
    waited: list[float] = []
    ran_under: list[int] = []

    def sleep(seconds: float) -> None:
        # The guard polls a live claim's record between these sleeps (a dead worker's lease).
        waited.append(seconds)
        time.sleep(seconds)

    guard = Guard(store, namespace=NAMESPACE, lease=config["lease"], wait=20.0, sleep=sleep)
    client = CounterClient(config["service"])
    mode = config["mode"]
    order = config["scope"]

    @guard.effect(
        EFFECT,
        reconciler=client.reconciler() if mode == "reconciler" else None,
        provider_idempotent=mode == "provider",
    )
    def charge(amount: int) -> Charge:
        effect = current_effect()
        ran_under.append(effect.token)
        result = client.charge(
            order,
            amount,
            provider_key=effect.provider_key,
            idempotency_key=effect.provider_key if mode == "provider" else None,
        )
        crash_point("after_effect")
        return result

    if config.get("gate"):
        store.get("warm-up")  # connect now, so the claim after the gate is one quick round trip
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 2  # the test went away without opening the gate: charge nothing
    try:
        with scope(order):
            result = charge(AMOUNT)
    except OutcomeUnknown as exc:
        record = exc.record
        report = {"outcome": "unknown", "key": exc.key, "token": record.token, "waited": sum(waited)}
        print(json.dumps(report), flush=True)
        return EXIT_UNKNOWN
    finally:
        guard.close()
        store.close()
    report = {
        "outcome": "ok",
        "charge": dataclasses.asdict(result),
        "token": ran_under[-1] if ran_under else None,
        "waited": sum(waited),
    }
    print(json.dumps(report), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
