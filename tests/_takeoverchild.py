"""The child side of ``tests/test_takeover_crash.py``: a guarded charge on the **default** Guard.

Run as ``python tests/_takeoverchild.py '<json>'``. The JSON holds the store ``spec`` (see
``StoreFactory.spec``), the counter ``service`` URL, the ``scope`` (the business key charged) and
the ``role``:

    hang:   claim and charge, print ``charged``, then block until the test SIGKILLs the process.
    resume: run the same call again. The store's clock is a fake one that starts at the instant
            the dead child claimed (read from the record on the server's clock) and advances only
            when the guard sleeps, so the dead child's lease never runs out on its own: the call
            finishes at once only by taking over a dead holder, and otherwise only after the
            guard has waited out the lease (each wait advancing the fake clock, nothing sleeping).

``$SAGAGUARD_HOST_ID`` in the resume child's environment plays "another host". Prints one JSON line:
the ``outcome``, how many ``busy`` (AlreadyInProgress) answers, the seconds ``waited``, the token
the body ran under (``ran``, null when the reconciler settled it) and the record's final ``token``
and ``attempts``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from _procs import open_backend

from sagaguard.idempotency import AlreadyInProgress, Guard, current_effect, scope
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.testing import Charge, CounterClient

NAMESPACE = "takeover-tests"
EFFECT = "charge"
AMOUNT = 700


class SteppedClock:
    """A store clock that moves only when the guard sleeps."""

    def __init__(self, start: float) -> None:
        self.now = start
        self.waited = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.waited += seconds


def main(config: dict[str, Any]) -> int:
    spec = config["spec"]

    def backend(clock: Any) -> Any:
        return open_backend(
            spec["backend"], spec["url"], clock=clock, table_name=spec["table_name"], prefix=spec["prefix"]
        )

    order, role = config["scope"], config["role"]
    key = EffectIdentity.of(NAMESPACE, order, EFFECT, 0).key
    client = CounterClient(config["service"])
    ran: list[int] = []
    clock = SteppedClock(0.0)
    if role == "hang":
        store = backend(None)
        guard = Guard(store, namespace=NAMESPACE)
    else:
        server = backend(None)
        claimed = server.get(key)
        server.close()
        assert claimed is not None, "the killed child left no claim"
        clock = SteppedClock(claimed.updated_at)
        store = backend(clock)
        guard = Guard(store, namespace=NAMESPACE, sleep=clock.sleep)

    @guard.effect(EFFECT, reconciler=client.reconciler() if config.get("reconciler") else None,
                  provider_idempotent=not config.get("reconciler"))  # fmt: skip
    def charge(amount: int) -> Charge:
        effect = current_effect()
        ran.append(effect.token)
        result = client.charge(order, amount, provider_key=effect.provider_key,
                               idempotency_key=effect.provider_key)  # fmt: skip
        if role == "hang":
            print("charged", flush=True)
            sys.stdin.readline()  # blocks: the test SIGKILLs the process here
        return result

    busy = 0
    try:
        with scope(order):
            charge(AMOUNT)
        outcome = "ok"
    except AlreadyInProgress:
        busy, outcome = 1, "busy"
    record = store.get(key)
    report = {
        "outcome": outcome,
        "busy": busy,
        "waited": clock.waited,
        "ran": ran[-1] if ran else None,
        "token": record.token if record else None,
        "attempts": record.attempts if record else None,
        "state": str(record.state) if record else None,
    }
    guard.close()
    store.close()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
