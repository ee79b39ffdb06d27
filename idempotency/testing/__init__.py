"""Test helpers shipped to users: a service that counts effects, and a store that dies on cue.

Crash tests of code that changes the world need two things: a world that counts what reached it,
in *another* process so that killing the worker does not kill the evidence, and a worker that dies
for real (SIGKILL: no ``finally``, no ``atexit``, no flush) at a chosen point::

    with CounterService() as service:                  # its own process on 127.0.0.1
        env = {**os.environ, CRASH_ENV: "before_complete"}
        subprocess.run([sys.executable, "worker.py", service.url], env=env)  # killed after the POST
        subprocess.run([sys.executable, "worker.py", service.url])           # resolves the doubt
        assert service.count() == 1

and in ``worker.py``::

    guard = Guard(CrashingStore(open_store(url)), lease=0.5)
    client = CounterClient(service_url)

    @guard.effect("charge", reconciler=client.reconciler())
    def charge(order: str, amount: int) -> Charge:
        result = client.charge(order, amount, provider_key=current_effect().provider_key)
        crash_point("after_effect")                     # or let the store die at "before_complete"
        return result

Crash points are not hooks in the guard: :class:`CrashingStore` wraps any store, and
:func:`crash_point` is called by the effect body itself. Production code carries neither.

Run ``python -m sagaguard.idempotency.testing counter --port 0`` to start the service by hand; it prints one
JSON line ``{"url": ..., "port": ...}`` when it listens.
"""

from __future__ import annotations

from sagaguard.idempotency.testing.children import child_environment
from sagaguard.idempotency.testing.counter_client import (
    Charge,
    CounterClient,
    CounterService,
    CounterServiceError,
)
from sagaguard.idempotency.testing.counter_server import (
    main as main,  # `python -m` entry point, not in __all__
)
from sagaguard.idempotency.testing.counter_server import serve_counter
from sagaguard.idempotency.testing.crash import (
    CRASH_ENV,
    STORE_CRASH_POINTS,
    CrashingStore,
    crash_at,
    crash_point,
    sigkill,
)

__all__ = [
    "CRASH_ENV",
    "STORE_CRASH_POINTS",
    "Charge",
    "CounterClient",
    "CounterService",
    "CounterServiceError",
    "CrashingStore",
    "crash_at",
    "child_environment",
    "crash_point",
    "serve_counter",
    "sigkill",
]
