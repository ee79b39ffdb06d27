"""A relay in its own process, for the outbox crash and multi-process tests.

``python tests/_outboxchild.py '<json spec>'`` runs a relay until the outbox is drained (depth 0),
then prints its stats as one JSON line. The spec:

- ``url``, ``table``: the outbox.
- ``batch``, ``lease``, ``concurrency``: relay settings (the lease in real seconds).
- ``service``: the counter service URL; the ``charge`` handler charges ``payload["order"]`` there
  under the message's provider key as ``Idempotency-Key`` (the service dedups, as Stripe does).
- ``attempts_log``: every handler call appends the message id here first (the delivery attempts,
  counted outside the process under test, so a SIGKILL loses none of them).
- ``record``: the ``noop`` handler appends ``id aggregate seq start_ns end_ns`` per delivery.
- ``crash``: die with SIGKILL ``after_claim`` (a batch is claimed, nothing delivered),
  ``before_ack`` (the batch was delivered, its settle not written) or ``mid_batch`` (after half the
  batch's deliveries); the crash points live in this file, not in the relay.
- ``gate``: wait for a line on stdin before starting (so several children start together).
- ``deadline``: give up (exit 3) after this many seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sagaguard.idempotency.outbox import Message, Outbox, OutboxControl, OutboxDb, Relay, RelaySettings
from sagaguard.idempotency.outbox.claims import Claimed, Settle
from sagaguard.idempotency.stores.sql import make_engine
from sagaguard.idempotency.testing import CounterClient, sigkill

EXIT_DEADLINE = 3


class CrashingDb(OutboxDb):
    """The outbox database with a SIGKILL after the claim or before the settle."""

    crash: str | None = None

    def claim(self, worker: str, limit: int, lease: float) -> list[Claimed]:
        claimed = super().claim(worker, limit, lease)
        if claimed and self.crash == "after_claim":
            sigkill("after_claim")
        return claimed

    def settle(self, worker: str, outcomes: Any) -> list[Any]:
        if self.crash == "before_ack" and any(
            isinstance(o, Settle) and o.status == "delivered" for o in outcomes
        ):
            sigkill("before_ack")
        return super().settle(worker, outcomes)


def _append(path: str | None, line: str) -> None:
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def main(spec: dict[str, Any]) -> int:
    engine = make_engine(spec["url"])
    outbox = Outbox(spec["table"])
    crash = spec.get("crash")
    client = CounterClient(spec["service"]) if spec.get("service") else None
    delivered = {"n": 0}
    half = max(1, int(spec.get("batch", 10)) // 2)

    @outbox.handler("charge")
    def charge(message: Message) -> None:
        _append(spec.get("attempts_log"), message.id + "\n")
        assert client is not None
        client.charge(message.payload["order"], message.payload["seq"], idempotency_key=message.provider_key)
        delivered["n"] += 1
        if crash == "mid_batch" and delivered["n"] == half:
            sigkill("mid_batch")

    record = spec.get("record")
    lines: list[str] = []

    @outbox.handler("noop")
    def noop(message: Message) -> None:
        start = time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for every process on the machine
        lines.append(f"{message.id} {message.aggregateid} {message.payload['seq']} {start} ")
        lines[-1] += f"{time.monotonic_ns()}\n"

    db = CrashingDb(engine, spec["table"])
    db.crash = crash
    settings = RelaySettings(
        batch_size=int(spec.get("batch", 10)),
        lease=float(spec.get("lease", 2.0)),
        concurrency=int(spec.get("concurrency", 1)),
        purge_every=None,
        listen=False,
    )
    relay = Relay(outbox, db, settings)
    control = OutboxControl(db)
    if spec.get("gate"):
        print("ready", flush=True)
        sys.stdin.readline()
    deadline = time.monotonic() + float(spec.get("deadline", 60))
    code = 0
    while True:
        if relay.run_once():
            continue
        if control.status().depth == 0:
            break
        if time.monotonic() > deadline:
            code = EXIT_DEADLINE
            break
        time.sleep(0.05)  # claims of another (dead or live) relay are still in flight
    if record and lines:
        Path(record).write_text("".join(lines))
    stats = relay.stats()
    print(
        json.dumps({"delivered": stats.delivered, "claimed": stats.claimed, "lost": stats.lost, "code": code})
    )
    relay.close()
    engine.dispose()
    return code


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
