"""The child of ``tests/test_outbox_dedup_crash.py``: a saga step that enqueues an email, once.

``python tests/_outboxdedupchild.py '<json>'``. The saga ``receipt`` has one step, ``email``: it
enqueues the confirmation email through :meth:`EmailEffects.send` in its own transaction, commits,
prints ``{"event": "enqueued", "message_id": ...}``, passes the crash point
``after_enqueue_commit`` (SIGKILL there when ``$SAGAGUARD_CRASH_AT`` names it: the message is
committed, the step's record is not) and returns the message id. The JSON holds ``outbox`` (URL),
``table``, ``store`` and ``journal`` (URLs), ``smtp_host``/``smtp_port``, ``saga_id`` and ``mode``:

- ``run``: run the saga;
- ``recover``: sweep until the dead worker's saga is recovered (its step runs again), then run the
  outbox relay until it is idle, and print ``{"event": "done", "state": ..., "delivered": n}``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from sqlalchemy.orm import Session

from sagaguard.connectors.email import Email, EmailEffects, SmtpSettings
from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.outbox import Outbox
from sagaguard.idempotency.testing import crash_point
from sagaguard.saga import Saga, SagaRunner, StepContext, recover
from sagaguard.saga.journals import open_journal

LEASE = 0.5
CRASH = "after_enqueue_commit"


@dataclass
class Order:
    id: str
    to: str


def _emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def main(config: dict[str, Any]) -> int:
    guard = Guard(open_store(config["store"]), lease=LEASE, wait=20 * LEASE)
    journal = open_journal(config["journal"])
    engine = sa.create_engine(config["outbox"])
    outbox = Outbox(config["table"])
    smtp = SmtpSettings(config["smtp_host"], int(config["smtp_port"]))
    mail = EmailEffects(guard, smtp, outbox=outbox, sender="shop@shop.example")
    receipt: Saga[Order] = Saga("receipt", input=Order)

    @receipt.step(compensate=None)
    def email(ctx: StepContext, order: Order) -> str:
        with Session(engine) as session:
            message_id = mail.send(session, Email(to=[order.to], subject=f"Order {order.id}", text="Thanks"))
            session.commit()
        _emit("enqueued", message_id=message_id)
        crash_point(CRASH)
        return message_id

    runner = SagaRunner(journal, guard, lease=LEASE, wait=20 * LEASE)
    order = Order(config["saga_id"], "ada@example.com")
    try:
        if config["mode"] == "recover":
            deadline = time.monotonic() + 40 * LEASE
            while config["saga_id"] not in recover(journal, guard, receipt, runner=runner).outcomes:
                if time.monotonic() > deadline:
                    raise TimeoutError("the dead worker's saga was never recovered")
                time.sleep(0.05)  # the dead worker's lease runs on the journal's real clock
        outcome = runner.run(receipt, config["saga_id"], order)  # a finished saga replays
        stats = outbox.relay(engine, listen=False, purge_every=None).run(until_idle=True)
        _emit("done", state=outcome.state.value, delivered=stats.delivered)
    finally:
        runner.close()
        engine.dispose()
        journal.close()
        guard.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
