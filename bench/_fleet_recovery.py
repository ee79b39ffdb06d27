"""bench/fleet.py's recovery run: a worker SIGKILLed under load, its sagas resumed on another host.

Load workers on host ``fleet-host-a`` (``SAGAGUARD_HOST_ID``) run the agent saga back to back,
each step's tool and undo charging the counter service (a separate process) under the effect's
own key with deduplication off, so a repeated effect would be counted there, then taking
:data:`LATENCY` seconds. One sweeper
(:class:`~sagaguard.saga.recovery.RecoveryWorker`) runs on host ``fleet-host-b``, with the
library's defaults (lease and sweep interval) unless told otherwise. After ``kill_after`` seconds
one load worker is SIGKILLed; its unfinished sagas are read from the journal, and the time from
the kill (the process reaped) until the start of the sweep that took each over is the wait (the
time until that sweep had driven it to its end is reported too). The other workers keep loading
until then. Afterwards: every saga of the run must be COMPLETED (none left behind) and the counter
service must hold exactly one charge per step of each (no duplicate, none missing).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from typing import Any

from _fleet_procs import Fleet, WorkerFailed, errors, spawn

from sagaguard.idempotency.testing import CounterService
from sagaguard.saga import SagaState
from sagaguard.saga.journals import open_journal

HOST_A, HOST_B = "fleet-host-a", "fleet-host-b"
GRACE = 30.0
"""Seconds past one lease plus one sweep interval the run waits before it gives up (then the
figure is reported as not met, with what was found)."""
ACTIVE = (SagaState.RUNNING, SagaState.COMPENSATING)
LATENCY = 0.05
"""Seconds each tool call takes after its charge: most of a saga's time, so the kill most likely
leaves an effect in doubt (charged, not recorded), the case the reconciler settles."""


def _listed(journal: Any, prefix: str, states: Any = None) -> list[Any]:
    """The sagas whose id starts with ``prefix`` (in ``states``), every page read: the journal's
    order is the database's collation, where ids sharing a prefix need not be contiguous."""
    found, after = [], None
    while page := journal.list(states=states, limit=1000, after=after):
        found.extend(r for r in page if r.saga_id.startswith(prefix))
        after = page[-1].saga_id
    return found


def run(backend: str, url: str, *, steps: int, workers: int, kill_after: float, tag: str,
        interval: float | None = None, lease: float | None = None) -> dict[str, Any]:  # fmt: skip
    """One kill and recovery; its figures (seconds are wall clock)."""
    journal = open_journal(url)
    with CounterService() as service:
        base = {"backend": backend, "url": url, "steps": steps, "service": service.url}
        sweeper = spawn({**base, "kind": "sweeper", "tag": f"{tag}-sweep", "interval": interval,
                         "lease": lease}, host=HOST_B)  # fmt: skip
        lines: queue.Queue[str] = queue.Queue()
        assert sweeper.stdout is not None
        settings = json.loads(sweeper.stdout.readline() or "null") or {}
        if not settings:
            raise WorkerFailed(f"the sweeper did not start: {errors(sweeper)}")
        threading.Thread(target=lambda: [lines.put(x) for x in sweeper.stdout], daemon=True).start()  # type: ignore[union-attr]
        config = {
            **base,
            "kind": "saga",
            "effect": "counter",
            "seconds": 0,
            "tag": f"{tag}-rec",
            "lease": lease,
            "latency": LATENCY,
        }
        fleet = Fleet(config, workers, host=HOST_A)
        try:
            fleet.start()
            fleet.go("saga")
            time.sleep(kill_after)
            pending: list[str] = []
            killed_at, lease_left = 0.0, 0.0
            for i in range(workers - 1):  # a victim caught between two sagas: the next one
                fleet.kill(i)
                killed_at = time.time()
                prefix = f"{tag}-rec-w{i}-"
                found = _listed(journal, prefix, ACTIVE)
                if found:
                    pending = [r.saga_id for r in found]
                    lease_left = max(r.lease_until for r in found) - killed_at
                    break
            bound = settings["lease"] + settings["interval"]
            resumed: dict[str, float] = {}
            finished: dict[str, float] = {}
            reconciled: list[str] = []
            deadline = killed_at + bound + GRACE
            while set(pending) - set(resumed) and time.time() < deadline:
                try:
                    report = json.loads(lines.get(timeout=0.5))
                except queue.Empty:
                    continue
                if "reconciled" in report:
                    reconciled.append(report["answer"])
                    continue
                for saga_id in report["recovered"]:
                    if saga_id in pending:
                        resumed[saga_id] = report["started"] - killed_at
                        finished[saga_id] = report["t"] - killed_at
            fleet.stop()
            done = fleet.collect()
            fleet.close()
        except BaseException:
            fleet.kill_all()
            raise
        finally:
            sweeper.terminate()
            sweeper.wait(timeout=120)
        sagas = _listed(journal, f"{tag}-rec-")
        states = Counter(str(r.state) for r in sagas)
        completed = states.get(str(SagaState.COMPLETED), 0)
        charges = service.counts()
    journal.close()
    waits = sorted(resumed.values())
    return {
        "workers": workers,
        "killed": len(fleet.dead),
        "sagas_of_the_dead": len(pending),
        "resumed": len(resumed),
        "wait_s": max(waits) if waits else None,
        "done_s": max(finished.values()) if finished else None,
        "lease_left_at_kill_s": lease_left,
        "lease_s": settings["lease"],
        "interval_s": settings["interval"],
        "bound_s": bound,
        "in_doubt": dict(Counter(reconciled)),
        "sagas": len(sagas),
        "states": dict(states),
        "left_behind": len(sagas) - completed,
        "load_sagas": sum(int(r["units"]) for r in done),
        "effects_expected": completed * steps,
        "effects_counted": sum(charges.values()),
        "duplicates": sum(n - 1 for n in charges.values() if n > 1),
    }
