"""A saga in another process: the child side of the multi-process saga tests.

Run as ``python tests/_sagachild.py '<json>'``. The JSON holds the journal ``spec`` (see
``JournalFactory.spec``), the fake clock's reading ``now`` (the child's clock stands still there),
the ``log`` file every step and effect appends a line to, a ``command`` and its arguments:

- ``run``: run the travel saga ``saga_id`` with ``order`` and report its outcome;
- ``recover``: one :func:`sagaguard.saga.recovery.recover` sweep; report what it did.

With ``gate`` set the child says ``ready`` once warmed up (imports done, journal open) and goes on only
when a line arrives on its stdin, so that two children start their sweep at the same moment.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _sagajournals import open_journal_backend, open_store_backend

from sagaguard.idempotency import Guard
from sagaguard.saga import Saga, SagaRunner, StepContext, recover

DAY = 86_400.0


@dataclass
class Order:
    id: str
    amount: int


@dataclass
class Approval:
    by: str


def file_log(path: str) -> Callable[[str], None]:
    """Append one line per event to ``path`` (O_APPEND: lines from several processes never mix)."""

    def log(event: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {event}\n".encode())
        finally:
            os.close(fd)

    return log


def read_log(path: str) -> list[str]:
    """The events in the log, without the pids."""
    try:
        with open(path, encoding="utf-8") as fh:
            return [line.split(" ", 1)[1].strip() for line in fh if line.strip()]
    except FileNotFoundError:
        return []


def build_travel(guard: Guard, log: Callable[[str], None]) -> Saga[Order]:
    """charge (compensatable, a guarded card charge) -> approval (a wait, 3 days) -> book (pivot)."""
    travel: Saga[Order] = Saga("travel", version=1, input=Order)

    @guard.effect("psp.charge")
    def charge_card(order_id: str, amount: int) -> int:
        log("psp.charge")
        return amount

    def refund(ctx: StepContext, order: Order, charged: int | None) -> None:
        log(f"refund {charged}")

    @travel.step(compensate=refund)
    def charge(ctx: StepContext, order: Order) -> int:
        log("charge")
        return charge_card(order.id, order.amount)

    approval = travel.wait("approval", timeout=3 * DAY, payload=Approval)

    @travel.pivot
    def book(ctx: StepContext, order: Order) -> str:
        log(f"book for {ctx.result(approval).by}")
        return "booked"

    return travel


def main(config: dict[str, Any]) -> int:
    spec = config["spec"]
    now = float(config["now"])
    journal = open_journal_backend(spec["backend"], spec["url"], clock=lambda: now, prefix=spec["prefix"])
    store = open_store_backend(spec["backend"], spec["url"], clock=lambda: now, prefix=spec["prefix"])
    guard = Guard(store, sleep=lambda _s: None)
    travel = build_travel(guard, file_log(config["log"]))
    journal.load("warm-up")  # connect before the gate, so the race is about the claim
    if config.get("gate"):
        print("ready", flush=True)
        sys.stdin.readline()
    if config["command"] == "run":
        runner = SagaRunner(journal, guard, lease=30, wait=0, sleep=lambda _s: None)
        outcome = runner.run(travel, config["saga_id"], Order(**config["order"]))
        runner.close()
        print(
            json.dumps({"pid": os.getpid(), "state": outcome.state.value, "waiting_for": outcome.waiting_for})
        )
    else:
        report = recover(journal, guard, [travel], lease=30, sleep=lambda _s: None)
        print(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "found": report.found,
                    "outcomes": {k: v.state.value for k, v in report.outcomes.items()},
                    "lost": list(report.lost),
                    "errors": dict(report.errors),
                }
            )
        )
    journal.close()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
