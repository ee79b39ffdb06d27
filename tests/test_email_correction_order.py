"""A correction never reaches anyone before the email it corrects (connectors/email_correction.py).

A saga's step emails a confirmation through the transactional outbox; a later step fails and the
compensation corrects it. Counted where the mail arrives (the real SMTP sink, aiosmtpd), delivered
by real relays on a SQLite outbox: the correction arrives after the original when the original was
delivered, when a relay is delivering it at that moment, and when that relay is SIGKILLed between
the two; an original still waiting in the outbox is cancelled there and no email arrives at all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import tenacity
from _emailrelaychild import mailer as shared_mailer
from _outboxkit import BACKENDS, open_world
from conftest import FakeClock
from sqlalchemy.orm import Session

from sagaguard.connectors.email import Email, EmailEffects, SmtpSettings
from sagaguard.connectors.email_correction import OriginalUnknown
from sagaguard.connectors.errors import ProviderRejected
from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency import Guard, MemoryStore, Retry, scope
from sagaguard.idempotency.outbox import Outbox, OutboxDb
from sagaguard.saga import MemoryJournal, Saga, SagaRunner, SagaState, StepContext

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_emailrelaychild.py"
ONCE = Retry(stop=tenacity.stop_after_attempt(1))


@pytest.fixture(scope="module")
def sink() -> Iterator[SmtpSink]:
    with SmtpSink() as running:
        yield running


@pytest.fixture(autouse=True)
def fresh(sink: SmtpSink) -> None:
    sink.reset()


@dataclass(frozen=True)
class Order:
    id: str
    email: str


def _confirmed(order: Order) -> Email:
    return Email(to=[order.email], subject="Confirmed", text=f"Order {order.id} is confirmed.")


def _cancelled(order: Any, original: str) -> Email:
    to = order.email if isinstance(order, Order) else order["email"]
    return Email(to=[to], subject="Cancelled", text="Sorry: we could not ship it, and refunded you.")


@dataclass
class Shop:
    """The saga ``shop``: confirm (an email through the outbox), then ship, which fails after
    ``meanwhile`` ran (what the relays did in the meantime)."""

    mail: EmailEffects
    engine: sa.Engine
    outbox: Outbox
    meanwhile: Callable[[], None] = lambda: None
    table: str = "sagaguard_outbox"

    def run(self, order: Order, journal: Any = None) -> SagaState:
        shop = Saga("shop", input=Order)

        @shop.step(compensate=self.mail.correction(_cancelled, engine=self.engine))
        def confirm(ctx: StepContext, order: Order) -> str:
            with Session(self.engine) as session:
                message_id = self.mail.send(session, _confirmed(order))
                session.commit()
            return message_id

        @shop.step(compensate=None, retry=ONCE)
        def ship(ctx: StepContext, order: Order) -> None:
            self.meanwhile()
            raise ProviderRejected("out of stock", "warehouse", 409)

        runner = SagaRunner(journal or MemoryJournal(), self.mail.guard, sleep=lambda s: None, renewer=False)
        return runner.run(shop, f"order-{order.id}", order).state

    def rows(self) -> list[tuple[str, str, str]]:
        """(subject, status, aggregate) of every outbox row, in id order."""
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.text(f"SELECT payload, status, aggregateid FROM {self.table} ORDER BY id")
            )
            return [(json.loads(p)["message"]["subject"], s, a) for p, s, a in found]


@pytest.fixture(params=BACKENDS)
def shop(request: pytest.FixtureRequest, sink: SmtpSink, tmp_path: Path, clock: FakeClock) -> Iterator[Shop]:
    """The shop on a SQLite and on a Postgres outbox (a table of its own), its guard in memory."""
    for world in open_world(request.param, tmp_path, clock):
        guard = Guard(MemoryStore(clock=clock), sleep=lambda s: None)
        settings = SmtpSettings(sink.host, sink.port)
        mail = EmailEffects(guard, settings, outbox=world.outbox, sender="shop@shop.example")
        yield Shop(mail, world.engine, world.outbox, table=world.table)


ADA = Order("7", "ada@example.com")


def _subjects(sink: SmtpSink) -> list[str | None]:
    return [m.subject for m in sink.messages]


def test_a_correction_of_a_delivered_email_is_delivered_after_it(shop: Shop, sink: SmtpSink) -> None:
    shop.meanwhile = lambda: shop.outbox.relay(shop.engine).run(until_idle=True)  # the relay sent it
    assert shop.run(ADA) is SagaState.COMPENSATED
    assert _subjects(sink) == ["Confirmed"]
    (_, _, aggregate), (subject, status, same) = shop.rows()
    assert (subject, status, same) == ("Cancelled", "pending", aggregate)  # the original's ordering key
    shop.outbox.relay(shop.engine).run(until_idle=True)
    original, correction = sink.messages
    assert (original.subject, correction.subject) == ("Confirmed", "Cancelled")
    assert correction.in_reply_to == original.message_id


def test_a_correction_waits_behind_an_original_a_relay_is_delivering(
    shop: Shop, sink: SmtpSink, clock: FakeClock
) -> None:
    claimed: list[Any] = []
    relay_a = OutboxDb(shop.engine, shop.table, clock=clock)
    shop.meanwhile = lambda: claimed.extend(relay_a.claim("relay-a", 10, 30.0))
    assert shop.run(ADA) is SagaState.COMPENSATED
    assert len(claimed) == 1  # relay-a holds the confirmation: it may be on its way
    assert [(s, st) for s, st, _ in shop.rows()] == [("Confirmed", "pending"), ("Cancelled", "pending")]
    shop.outbox.relay(shop.engine).run(until_idle=True)
    assert sink.messages == []  # another relay does not deliver the correction ahead of it
    clock.advance(31.0)  # relay-a died holding it: its claim runs out
    shop.outbox.relay(shop.engine).run(until_idle=True)
    original, correction = sink.messages
    assert (original.subject, correction.subject) == ("Confirmed", "Cancelled")
    assert correction.in_reply_to == original.message_id


def test_an_original_never_delivered_is_cancelled_in_the_outbox_and_nothing_reaches_anyone(
    shop: Shop, sink: SmtpSink
) -> None:
    assert shop.run(ADA) is SagaState.COMPENSATED
    assert [(s, st) for s, st, _ in shop.rows()] == [("Confirmed", "discarded")]
    shop.outbox.relay(shop.engine).run(until_idle=True)
    assert sink.messages == []
    # The compensation run again (a worker after a crash) still sends and enqueues nothing.
    with shop.engine.connect() as conn:
        (raw,) = conn.execute(sa.text(f"SELECT id FROM {shop.table}")).one()
    message_id = str(uuid.UUID(hex=raw) if isinstance(raw, str) else raw)
    compensate = shop.mail.correction(_cancelled, engine=shop.engine)
    with scope("order-7/confirm/~compensate"):
        compensate(Ctx("order-7/confirm"), ADA, message_id)
    assert [(s, st) for s, st, _ in shop.rows()] == [("Confirmed", "discarded")]
    shop.outbox.relay(shop.engine).run(until_idle=True)
    assert sink.messages == []


@dataclass(frozen=True)
class Ctx:
    step_scope: str


def test_an_original_the_server_refused_is_neither_corrected_nor_replayable(
    shop: Shop, sink: SmtpSink
) -> None:
    sink.fault("reject_rcpt", times=100, code=550)
    shop.meanwhile = lambda: shop.outbox.relay(shop.engine).run(until_idle=True)  # refused: dead
    assert shop.run(ADA) is SagaState.COMPENSATED
    assert [(s, st) for s, st, _ in shop.rows()] == [("Confirmed", "discarded")]
    assert sink.messages == []


def test_the_agent_undo_corrects_by_the_tool_result_and_parks_when_it_is_unknown(
    shop: Shop, sink: SmtpSink
) -> None:
    undo = shop.mail.correction_undo(_cancelled, engine=shop.engine)
    arguments = {"email": "ada@example.com"}
    with scope("run-1/send"):
        queued = shop.mail.send_later(shop.engine, _confirmed(ADA))
    shop.outbox.relay(shop.engine).run(until_idle=True)
    with scope("run-1/~compensate"):
        undo(arguments, queued)  # send_later's id, as the tool returned it
    with scope("run-1/~compensate"):
        undo(arguments, queued)  # run again after a crash: enqueued once
    with scope("run-2/send"):
        inline = shop.mail.send_now(_confirmed(ADA))
    with scope("run-2/~compensate"):
        undo(arguments, {"message_id": inline.message_id, "accepted": inline.accepted})
    shop.outbox.relay(shop.engine).run(until_idle=True)
    assert _subjects(sink) == ["Confirmed", "Confirmed", "Cancelled", "Cancelled"]
    assert sink.messages[2].in_reply_to == sink.messages[1].message_id  # the inline one, at once
    assert sink.messages[3].in_reply_to == sink.messages[0].message_id  # queued, then relayed
    with pytest.raises(OriginalUnknown), scope("run-3/~compensate"):
        undo(arguments, None)


# ------------------------------------------------------------------ a real relay, a real SIGKILL


def _relay(
    folder: Path, sink: SmtpSink, crash: str | None = None, at: str = ""
) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(ROOT), str(CHILD.parent), os.environ.get("PYTHONPATH", "")) if p)
    config = {"dir": str(folder), "smtp": [sink.host, sink.port], "crash": crash, "at": at}
    return subprocess.run(
        [sys.executable, str(CHILD), json.dumps(config)],
        env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


@pytest.mark.parametrize("at", ["before_send", "after_send"])
def test_a_relay_killed_between_the_original_and_its_correction_delivers_each_once_in_order(
    sink: SmtpSink, tmp_path: Path, at: str
) -> None:
    guard, store, engine, outbox, mail = shared_mailer(tmp_path, [sink.host, sink.port])
    killed: list[subprocess.CompletedProcess[str]] = []
    shop = Shop(mail, engine, outbox)
    shop.meanwhile = lambda: killed.append(_relay(tmp_path, sink, crash="Confirmed", at=at))
    try:
        assert shop.run(ADA) is SagaState.COMPENSATED
        # The relay was SIGKILLed holding the confirmation (before or after sending it); the
        # compensation found it claimed (maybe on its way) and queued the correction behind it.
        assert killed[0].returncode == -signal.SIGKILL, killed[0].stderr
        assert _subjects(sink) == ([] if at == "before_send" else ["Confirmed"]), killed[0].stderr
        assert [s for s, _, _ in shop.rows()] == ["Confirmed", "Cancelled"]
        fresh = _relay(tmp_path, sink)  # takes the dead relay's claim over once its lease ran out
        assert fresh.returncode == 0, fresh.stderr
    finally:
        guard.close()
        store.close()
        engine.dispose()
    original, correction = sink.messages  # each once: the redelivery replayed the recorded send
    assert (original.subject, correction.subject) == ("Confirmed", "Cancelled")
    assert correction.in_reply_to == original.message_id
    assert [st for _, st, _ in shop.rows()] == ["delivered", "delivered"]
