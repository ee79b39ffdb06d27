"""Errors of the outbox. They join the package's tree (see :mod:`sagaguard.idempotency.errors`)::

IdempotencyError
├── ConfigurationError        bad argument, unknown type, missing or outdated outbox table
│   └── CodecError            a payload that is not JSON, or too large
├── LostOwnership
│   └── LeaseLost             a relay's claim was taken over: its ack (or retry) was refused
├── OutboxError
│   ├── MessageNotFound       an operator named a message that is not there (also a LookupError)
│   └── NotDead               replay/discard of a message that is not a dead letter
└── StoreError / StoreUnavailable   the database failed / cannot be reached
"""

from __future__ import annotations

from sagaguard.idempotency.errors import IdempotencyError

__all__ = ["MessageNotFound", "NotDead", "OutboxError"]


class OutboxError(IdempotencyError):
    """Root of the outbox's own errors."""


class MessageNotFound(OutboxError, LookupError):
    """No outbox message has this id."""

    def __init__(self, message_id: str) -> None:
        super().__init__(f"no outbox message with id {message_id}")
        self.message_id = message_id


class NotDead(OutboxError):
    """Replay and discard move dead letters only; this message is in another state."""

    def __init__(self, message_id: str, status: str) -> None:
        super().__init__(f"outbox message {message_id} is {status}, not dead")
        self.message_id = message_id
        self.status = status
