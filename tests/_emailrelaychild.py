"""A relay of email messages in its own process, for ``tests/test_email_correction_order.py``.

``python tests/_emailrelaychild.py '<json>'`` (keys: ``dir``, where the SQLite effect store and
outbox live; ``smtp``, ``[host, port]``; ``crash``, a subject, and ``at``: SIGKILL when the relay
holds the email with that subject, ``before_send`` (claimed, not sent) or ``after_send`` (the SMTP
server accepted it, the relay has not acknowledged it in the outbox)) runs a relay
until the outbox is drained (a dead relay's claim is taken over once its lease ran out) and prints
its stats as one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from sagaguard.connectors.email import EmailEffects, SmtpSettings
from sagaguard.idempotency import Guard
from sagaguard.idempotency.outbox import Message, Outbox
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.idempotency.testing import sigkill

NAMESPACE = "shop"
RELAY_LEASE = 5.0
"""Seconds a relay's claim lasts here (the default is 30): how long the killed relay's claim blocks
the next relay, longer than a fresh relay takes to start, so the fresh one finds it still held."""


def mailer(folder: Path, smtp: list[Any]) -> tuple[Guard, SqlStore, sa.Engine, Outbox, EmailEffects]:
    """The guard, store, outbox engine, outbox and email connector the test and the relay share."""
    store = SqlStore(f"sqlite:///{folder / 'effects.db'}")
    guard = Guard(store, namespace=NAMESPACE)
    engine = sa.create_engine(f"sqlite:///{folder / 'outbox.db'}")
    outbox = Outbox()
    outbox.create_tables(engine)
    mail = EmailEffects(guard, SmtpSettings(smtp[0], int(smtp[1])), outbox=outbox, sender="shop@shop.example")
    return guard, store, engine, outbox, mail


def main(config: dict[str, Any]) -> int:
    guard, store, engine, outbox, mail = mailer(Path(config["dir"]), config["smtp"])
    crash = config.get("crash")
    deliver = outbox.handlers[mail.name]

    def delivering(message: Message) -> Any:
        ours = crash is not None and message.payload["message"]["subject"] == crash
        if ours and config["at"] == "before_send":
            sigkill("before_send")  # claimed: to everyone else it may be on its way
        sent = deliver(message)
        if ours:
            sigkill("after_send")  # the email went out; the outbox never hears of it
        return sent

    outbox.handlers[mail.name] = delivering
    relay = outbox.relay(engine, lease=RELAY_LEASE, poll_interval=0.05)
    control = outbox.control(engine)
    deadline = time.monotonic() + 60
    try:
        while True:
            stats = relay.run(until_idle=True)
            status = control.status()
            if status.pending == status.in_flight == 0 or time.monotonic() > deadline:
                break
            # A dead relay's claim runs out on the wall clock: poll for it, no fixed wait.
            time.sleep(0.05)
    finally:
        relay.close()
        guard.close()
        store.close()
        engine.dispose()
    print(json.dumps({"delivered": stats.delivered}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
