"""The transactional outbox: a message commits with the business data, and relays deliver it.

::

    from sagaguard.idempotency.outbox import Outbox, create_tables

    outbox = Outbox()
    create_tables(engine)                                  # once (or: sagaguard db upgrade)

    @outbox.handler("email.receipt")
    def send_receipt(message): mailer.send(..., idempotency_key=message.provider_key)

    with Session(engine) as session:                       # the caller's own transaction
        session.add(order)
        outbox.enqueue(session, "email.receipt", {"order": order.id},
                       aggregate_type="order", aggregate_id=order.id)
        session.commit()

    outbox.relay(engine).run()                             # or: sagaguard relay --app app:outbox

See ``docs/outbox.md`` for the guarantees.
"""

from sagaguard.idempotency.outbox.claims import OutboxDb
from sagaguard.idempotency.outbox.control import DEFAULT_RETENTION, OutboxControl
from sagaguard.idempotency.outbox.enqueue import (
    DEFAULT_MAX_ATTEMPTS,
    MAX_PAYLOAD_BYTES,
    aenqueue,
    encode_payload,
    enqueue,
)
from sagaguard.idempotency.outbox.errors import MessageNotFound, NotDead, OutboxError
from sagaguard.idempotency.outbox.handlers import DeferredEffect, Outbox
from sagaguard.idempotency.outbox.model import (
    DEFAULT_TABLE,
    METADATA,
    SCHEMA_VERSION,
    MessageStatus,
    OutboxRow,
    check_schema,
    create_tables,
    migrate,
    outbox_model,
    schema_version,
    uuid7,
)
from sagaguard.idempotency.outbox.policy import RelaySettings, RelayStats, default_backoff
from sagaguard.idempotency.outbox.records import (
    BlockedAggregate,
    BlockedMessage,
    DeadLetter,
    Message,
    OutboxStatus,
    current_message,
)
from sagaguard.idempotency.outbox.relay import Relay

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_RETENTION",
    "DEFAULT_TABLE",
    "MAX_PAYLOAD_BYTES",
    "METADATA",
    "SCHEMA_VERSION",
    "BlockedAggregate",
    "BlockedMessage",
    "DeadLetter",
    "DeferredEffect",
    "Message",
    "MessageNotFound",
    "MessageStatus",
    "NotDead",
    "Outbox",
    "OutboxControl",
    "OutboxDb",
    "OutboxError",
    "OutboxRow",
    "OutboxStatus",
    "Relay",
    "RelaySettings",
    "RelayStats",
    "aenqueue",
    "check_schema",
    "create_tables",
    "current_message",
    "default_backoff",
    "encode_payload",
    "enqueue",
    "migrate",
    "outbox_model",
    "schema_version",
    "uuid7",
]
