"""Email: sent through the transactional outbox after the business data commits, once, with a
Message-ID derived from the effect; or inline (here to a real local SMTP server, aiosmtpd)."""

import os

import sqlalchemy as sa
from sqlalchemy.orm import Session

from sagaguard.connectors.email import Email, EmailEffects, SmtpSettings
from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency import Guard, open_store, scope
from sagaguard.idempotency.outbox import Outbox

store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///email.db"))
guard = Guard(store)
engine = sa.create_engine("sqlite:///shop.db")  # the application's own database
outbox = Outbox()
outbox.create_tables(engine)
receipt = Email(to=["ada@example.com"], subject="Your receipt", text="Thanks for order 6006.")

with SmtpSink() as smtp_server:
    mail = EmailEffects(guard, SmtpSettings(smtp_server.host, smtp_server.port), outbox=outbox,
                        sender="shop@shop.example")  # fmt: skip
    with Session(engine) as session:  # the order and its email commit together, or not at all
        mail.send(session, receipt)
        session.commit()
    outbox.relay(engine).run(until_idle=True)  # a relay delivers it after the commit

    with scope("order/6006"):  # inline: now, once per identity; a re-run replays the record
        sent = mail.send_now(Email(to=["ada@example.com"], subject="Shipped", text="On its way."))
    with scope("order/6006"):
        assert mail.send_now(Email(to=["ada@example.com"], subject="Shipped", text="On its way.")) == sent

    assert smtp_server.count() == 2
    print(f"messages at the SMTP server: {smtp_server.count()}")
    print(f"Message-ID of the inline send: {sent.message_id}")

engine.dispose()
guard.close()
store.close()
