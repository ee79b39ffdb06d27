"""What the outbox hands out: messages for handlers, dead letters and status for operators. No I/O."""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from sagaguard.idempotency.errors import ConfigurationError

__all__ = ["BlockedMessage", "DeadLetter", "Message", "OutboxStatus", "current_message"]


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery of an outbox message, as its handler receives it."""

    id: str
    """The message id (a UUIDv7, canonical text form)."""
    type: str
    """The message type: selects the handler (Debezium ``type``)."""
    aggregatetype: str
    aggregateid: str
    payload: Any
    """The payload as JSON types (dicts, lists, strings, numbers, booleans, None)."""
    headers: Mapping[str, str]
    provider_key: str
    """Pass this to providers that deduplicate (Stripe ``idempotency_key``, an ``Idempotency-Key``
    header): a message delivered twice (a relay died after sending, before its ack) is then absorbed
    by the provider."""
    attempt: int
    """1 for the first delivery, 2 for the second, ... (a delivery cut short by a crash counts)."""
    max_attempts: int
    created_at: float
    """When it was enqueued, in seconds since the epoch (database clock)."""
    traceparent: str | None = field(default=None, repr=False)
    tracestate: str | None = field(default=None, repr=False)

    def json(self) -> str:
        """The payload as compact JSON text."""
        return json.dumps(self.payload, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that was given up on: an operator replays or discards it."""

    id: str
    type: str
    aggregatetype: str
    aggregateid: str
    attempts: int
    max_attempts: int
    last_error: str | None
    """The last failure: the exception's type and message (never its arguments)."""
    created_at: float
    died_at: float | None


@dataclass(frozen=True, slots=True)
class BlockedAggregate:
    """An aggregate whose pending messages wait behind one of its dead letters."""

    aggregatetype: str
    aggregateid: str
    blocked: int
    """Its pending messages younger than its oldest dead letter: none is delivered until an operator
    replays or discards that dead letter."""


@dataclass(frozen=True, slots=True)
class BlockedMessage:
    """A pending message that waits behind a dead letter of its aggregate: no relay delivers it
    until an operator replays or discards that dead letter."""

    id: str
    type: str
    aggregatetype: str
    aggregateid: str
    created_at: float
    blocked_by: str
    """The id of its aggregate's oldest dead letter older than it (the one to replay or discard)."""


@dataclass(frozen=True, slots=True)
class OutboxStatus:
    """How the outbox stands, for an operator or a metrics scrape."""

    pending: int
    """Waiting for a relay (includes messages backing off after a failure), not counting those
    blocked behind a dead letter."""
    in_flight: int
    """Claimed by a relay (includes claims whose lease ran out, not yet taken over). Stored as
    pending rows with a ``worker_id``."""
    dead: int
    oldest_pending_age: float | None
    """Seconds since the oldest pending (not blocked) or in-flight message was enqueued; None when
    there is none."""
    now: float
    blocked: int = 0
    """Pending messages that wait behind a dead letter of their aggregate (while dead letters block
    their aggregate, the default): they drain only once an operator replays or discards it."""
    blocked_aggregates: tuple[BlockedAggregate, ...] = ()
    """The aggregates holding the most blocked messages (at most 20), most first."""

    @property
    def depth(self) -> int:
        """Messages a relay can still deliver: pending + in flight (blocked ones apart)."""
        return self.pending + self.in_flight


_current: ContextVar[Message | None] = ContextVar("sagaguard_outbox_message", default=None)


def current_message() -> Message:
    """The message whose handler is running (for code deep inside a handler).

    Raises:
        ConfigurationError: called outside an outbox handler.
    """
    found = _current.get()
    if found is None:
        raise ConfigurationError("current_message() is only available inside an outbox handler")
    return found
