"""The email connector (connectors/email.py): smtplib against a real SMTP server (aiosmtpd).

The sink (``sagaguard.connectors.testing.smtp.SmtpSink``) runs in this process and keeps every message it
accepts, so "sent once" is counted where the mail arrives. Sends go inline or through the
transactional outbox (``sagaguard.idempotency.outbox``) on a SQLite file; the SIGKILLs are in
test_connector_crash.py.
"""

from __future__ import annotations

import smtplib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
import tenacity
from _connectorutil import LEASE, after_lease, crash_before_record, crashing_guard
from conftest import FakeClock, closed_port
from sqlalchemy.orm import Session

from sagaguard.connectors.email import Email, EmailEffects, Sent, SmtpSettings, map_smtp_error, message_id_for
from sagaguard.connectors.errors import ProviderRejected, ProviderUnavailable, ProviderUnreachable, classify
from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency import (
    ConfigurationError,
    Disposition,
    Guard,
    MemoryStore,
    OutcomeUnknown,
    Policy,
    Retry,
    State,
    scope,
)
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.outbox import Outbox
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga import MemoryJournal, Saga, SagaRunner, SagaState, StepContext

DOMAIN = "shop.example"
FAST = Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())
RECEIPT = Email(to=["ada@example.com"], subject="Your receipt", text="Thanks for order 42.\n.\nBye")

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def sink() -> Iterator[SmtpSink]:
    with SmtpSink() as running:
        yield running


@pytest.fixture(autouse=True)
def fresh(sink: SmtpSink) -> None:
    sink.reset()


@pytest.fixture
def memory(clock: FakeClock) -> MemoryStore:
    return MemoryStore(clock=clock)


def mailer(
    sink: SmtpSink, store: IdempotencyStore, *, timeout: float = 5.0, **options: object
) -> EmailEffects:
    guard = options.pop("guard", None) or Guard(store, lease=LEASE, sleep=lambda s: None)
    settings = SmtpSettings(sink.host, sink.port, timeout=timeout)
    return EmailEffects(guard, settings, sender=f"shop@{DOMAIN}", **options)  # type: ignore[arg-type]


def test_send_now_sends_once_and_a_rerun_replays(sink: SmtpSink, store: IdempotencyStore) -> None:
    mail = mailer(sink, store)
    with scope("order-1"):
        sent = mail.send_now(RECEIPT)
    with scope("order-1"):
        assert mail.send_now(RECEIPT) == sent

    identity = EffectIdentity.of("default", "order-1", "email.send", 0)
    assert sent.message_id == message_id_for(mail.guard.provider_key(identity), DOMAIN)
    assert sent.accepted == ["ada@example.com"]
    assert sink.count() == 1 and sink.count(sent.message_id) == 1
    assert sink.messages[0].body.rstrip("\n") == RECEIPT.text  # dot-stuffing round-trips


def test_an_answer_lost_after_data_is_in_doubt_and_never_sent_twice(
    sink: SmtpSink, memory: MemoryStore
) -> None:
    mail = mailer(sink, memory, timeout=0.3)
    sink.fault("timeout", seconds=1.0)
    with scope("order-2"), pytest.raises(OutcomeUnknown) as doubt:
        mail.send_now(RECEIPT)
    assert isinstance(doubt.value.__cause__, ProviderUnavailable)

    with scope("order-2"), pytest.raises(OutcomeUnknown):
        mail.send_now(RECEIPT)  # at most once: still in doubt, nothing sent
    assert sink.count() == 1
    record = memory.get(EffectIdentity.of("default", "order-2", "email.send", 0).key)
    assert record is not None and record.state is State.IN_DOUBT


def test_at_least_once_resends_with_the_same_message_id(sink: SmtpSink, memory: MemoryStore) -> None:
    mail = mailer(sink, memory, timeout=0.3, policy=Policy.AT_LEAST_ONCE)
    sink.fault("timeout", seconds=1.0)
    with scope("order-3"), pytest.raises(OutcomeUnknown):
        mail.send_now(RECEIPT)
    with scope("order-3"):
        sent = mail.send_now(RECEIPT)

    assert sink.count() == 2
    assert {m.message_id for m in sink.messages} == {sent.message_id}


def test_refused_recipients_are_not_applied_recorded_and_replayed(
    sink: SmtpSink, memory: MemoryStore
) -> None:
    mail = mailer(sink, memory)
    sink.fault("reject_rcpt", code=550)
    with scope("order-4"), pytest.raises(ProviderRejected) as refused:
        mail.send_now(RECEIPT)
    assert refused.value.status == 550 and not refused.value.retryable
    with scope("order-4"), pytest.raises(ProviderRejected):
        mail.send_now(RECEIPT)
    assert sink.count() == 0 and sink.sessions == 1


def test_a_temporary_refusal_is_retried_then_released(sink: SmtpSink, memory: MemoryStore) -> None:
    guard = Guard(memory, lease=LEASE, sleep=lambda s: None)
    mail = EmailEffects(guard, SmtpSettings(sink.host, sink.port), sender=f"shop@{DOMAIN}")
    sink.fault("reject_data", code=451, times=3)  # the default budget is 3 tries
    with scope("order-5"), pytest.raises(ProviderRejected) as later:
        mail.send_now(RECEIPT)
    assert later.value.status == 451 and later.value.retryable
    assert memory.get(EffectIdentity.of("default", "order-5", "email.send", 0).key) is None
    with scope("order-5"):
        mail.send_now(RECEIPT)
    assert sink.count() == 1


def test_some_recipients_refused_is_recorded_in_the_result(sink: SmtpSink, memory: MemoryStore) -> None:
    mail = mailer(sink, memory)
    sink.fault("reject_rcpt", code=550)
    message = Email(to=["gone@example.com", "ada@example.com"], subject="s", text="t")
    with scope("order-6"):
        sent = mail.send_now(message)
    assert sent.accepted == ["ada@example.com"]
    assert list(sent.refused) == ["gone@example.com"] and sent.refused["gone@example.com"].startswith("550")
    assert sink.messages[0].recipients == ("ada@example.com",)


def test_an_unreachable_server_is_not_applied(memory: MemoryStore) -> None:
    guard = Guard(memory, lease=LEASE, sleep=lambda s: None)
    mail = EmailEffects(guard, SmtpSettings("127.0.0.1", closed_port(), timeout=1.0), sender=f"shop@{DOMAIN}")
    with scope("order-7"), pytest.raises(ProviderUnreachable):
        mail.send_now(RECEIPT)
    assert memory.get(EffectIdentity.of("default", "order-7", "email.send", 0).key) is None


@pytest.mark.parametrize(
    ("exc", "phase", "expected", "disposition"),
    [
        (ConnectionRefusedError(111, "refused"), "connect", ProviderUnreachable, Disposition.RETRYABLE),
        (smtplib.SMTPHeloError(501, b"no"), "session", ProviderRejected, Disposition.PERMANENT),
        (smtplib.SMTPAuthenticationError(535, b"bad"), "session", ProviderRejected, Disposition.RETRYABLE),
        (
            smtplib.SMTPResponseException(550, b"no such user"),
            "envelope",
            ProviderRejected,
            Disposition.PERMANENT,
        ),
        (smtplib.SMTPResponseException(452, b"full"), "envelope", ProviderRejected, Disposition.RETRYABLE),
        (smtplib.SMTPResponseException(554, b"spam"), "reply", ProviderRejected, Disposition.PERMANENT),
        (smtplib.SMTPServerDisconnected("closed"), "data", ProviderUnreachable, Disposition.RETRYABLE),
        (smtplib.SMTPServerDisconnected("closed"), "reply", ProviderUnavailable, Disposition.AMBIGUOUS),
        (TimeoutError("timed out"), "reply", ProviderUnavailable, Disposition.AMBIGUOUS),
    ],
)
def test_error_mapping_by_phase(
    exc: BaseException, phase: str, expected: type[Exception], disposition: Disposition
) -> None:
    mapped = map_smtp_error(exc, phase)
    assert type(mapped) is expected and classify(mapped) is disposition
    assert type(mapped)(*mapped.args).args == mapped.args


# ---------------------------------------------------------------------------------- the outbox


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    made = sa.create_engine(f"sqlite:///{tmp_path / 'shop.db'}")
    yield made
    made.dispose()


def test_send_through_the_outbox_is_delivered_after_commit_once(
    sink: SmtpSink, memory: MemoryStore, engine: sa.Engine
) -> None:
    outbox = Outbox()
    outbox.create_tables(engine)
    mail = mailer(sink, memory, outbox=outbox)
    with Session(engine) as session:
        mail.send(session, RECEIPT)
        session.rollback()  # the business transaction failed: no email
    with Session(engine) as session:
        message_id = mail.send(session, RECEIPT)
        assert sink.count() == 0, "nothing is sent before the commit"
        session.commit()

    relay = outbox.relay(engine)
    assert relay.run_once() == 1
    assert relay.run_once() == 0
    provider_key = mail.guard.provider_key(
        EffectIdentity.of("default", f"outbox/{message_id}", "email.send", 0)
    )
    assert [m.message_id for m in sink.messages] == [message_id_for(provider_key, DOMAIN)]


def test_a_redelivered_outbox_message_replays_the_send(
    sink: SmtpSink, memory: MemoryStore, engine: sa.Engine
) -> None:
    """The relay died after the SMTP server took the message, before its ack: the handler runs
    again with the same message and the guard replays the recorded send."""
    outbox = Outbox()
    outbox.create_tables(engine)
    mail = mailer(sink, memory, outbox=outbox)
    with Session(engine) as session:
        mail.send(session, RECEIPT)
        session.commit()
    delivered: list[object] = []
    handler = outbox.handlers["email.send"]
    outbox.handlers["email.send"] = lambda m: delivered.append(m) or handler(m)
    outbox.relay(engine).run_once()

    again = mail.deliver(delivered[0])
    assert isinstance(again, Sent)
    assert sink.count() == 1 and sink.messages[0].message_id == again.message_id


def test_send_without_an_outbox_is_a_configuration_error(sink: SmtpSink, memory: MemoryStore) -> None:
    with pytest.raises(ConfigurationError, match="send_now"):
        mailer(sink, memory).send(object(), RECEIPT)


# ------------------------------------------------------------------------------ the correction


@dataclass(frozen=True)
class Order:
    id: str
    email: str


def _correction(order: Order, original: str) -> Email:
    return Email(
        to=[order.email], subject=f"Correction: order {order.id}", text="Please disregard our last email."
    )


def test_a_correction_answers_the_sent_email_when_the_saga_compensates(
    sink: SmtpSink, memory: MemoryStore
) -> None:
    mail = mailer(sink, memory)
    shop = Saga("shop", input=Order)

    @shop.step(compensate=mail.correction(_correction))
    def confirm(ctx: StepContext, order: Order) -> Sent:
        return mail.send_now(Email(to=[order.email], subject="Confirmed", text=f"order {order.id}"))

    @shop.step(compensate=None, retry=Retry(stop=tenacity.stop_after_attempt(1)))
    def ship(ctx: StepContext, order: Order) -> None:
        raise ProviderRejected("out of stock", "warehouse", 409)

    runner = SagaRunner(MemoryJournal(), mail.guard, sleep=lambda s: None, renewer=False)
    outcome = runner.run(shop, "order-8", Order("8", "ada@example.com"))

    assert outcome.state is SagaState.COMPENSATED, outcome
    first, correction = sink.messages
    assert correction.in_reply_to == first.message_id
    assert correction.subject == "Correction: order 8"


def test_a_correction_is_sent_for_an_in_doubt_email_and_not_for_one_never_sent(
    sink: SmtpSink, memory: MemoryStore, clock: FakeClock
) -> None:
    crashing = mailer(sink, memory, guard=crashing_guard(memory))
    with scope("order-9/confirm"):
        crash_before_record(lambda: crashing.send_now(RECEIPT))
    after_lease(clock)
    mail = mailer(sink, memory)
    compensate = mail.correction(_correction)

    @dataclass(frozen=True)
    class Ctx:
        step_scope: str

    with scope("order-9/confirm/~compensate"):
        compensate(Ctx("order-9/confirm"), Order("9", "ada@example.com"), None)
    with scope("order-10/confirm/~compensate"):
        compensate(Ctx("order-10/confirm"), Order("10", "ada@example.com"), None)

    original, correction = sink.messages
    assert correction.in_reply_to == original.message_id
    assert sink.count() == 2
