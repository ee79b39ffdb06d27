"""Transactional outbox: an order and its receipt email commit together; a relay sends the email.

The receipt is a row in the same transaction as the order, so a crash can neither lose it (the
order committed, the email never left) nor send it for an order that rolled back.
"""

import os

from sqlmodel import Field, Session, SQLModel

from sagaguard.idempotency.outbox import Message, Outbox, create_tables
from sagaguard.idempotency.stores.sql import make_engine

url = os.environ.get("SAGAGUARD_STORE", "")
if not url.startswith(("sqlite", "postgresql")):
    url = "sqlite:///outbox_example.db"  # the outbox lives in your SQL database
engine = make_engine(url)


class Order(SQLModel, table=True):
    id: str = Field(primary_key=True)
    total: int


SQLModel.metadata.create_all(engine)  # the application's own tables
create_tables(engine)  # the outbox's table (or: sagaguard db upgrade)

outbox = Outbox()
sent: list[str] = []  # stands in for the mail provider


@outbox.handler("email.receipt")
def send_receipt(message: Message) -> None:
    # A provider that deduplicates gets the message's provider key: a redelivery after a crash
    # (sent, not yet acknowledged) is then absorbed instead of mailing twice.
    sent.append(f"{message.payload['to']}: order {message.payload['order']} ({message.provider_key[:12]})")


def place_order(order_id: str, total: int, *, fail: bool = False) -> None:
    with Session(engine) as session:
        if session.get(Order, order_id) is not None:
            return  # placed by an earlier run of this example
        session.add(Order(id=order_id, total=total))
        outbox.enqueue(
            session,
            "email.receipt",
            {"order": order_id, "to": "ada@example.com"},
            aggregate_type="order",
            aggregate_id=order_id,  # messages of one order are delivered in order
        )
        if fail:
            session.rollback()  # the order and its email vanish together
            return
        session.commit()


place_order("1001", 4200)
place_order("1002", 990, fail=True)

relay = outbox.relay(engine)  # in production: `sagaguard relay --app myapp:outbox`, several of them
stats = relay.run(until_idle=True)
status = outbox.control(engine).status()
print(f"receipts sent by this run: {len(sent)}; delivered {stats.delivered}; depth now {status.depth}")
for line in sent:
    print(" ", line)
assert status.depth == 0 and len(sent) <= 1
relay.close()
engine.dispose()
