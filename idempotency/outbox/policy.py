"""What a relay decides, apart from doing it: its settings, its counters, and what a failed
delivery becomes. No I/O, so the decisions are table-tested (tests/test_outbox_relay.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tenacity

from sagaguard.idempotency.checks import count, seconds
from sagaguard.idempotency.driving import Retrier
from sagaguard.idempotency.effect import Retry
from sagaguard.idempotency.errors import CodecError, ConfigurationError, NotApplied, ReplayedFailure
from sagaguard.idempotency.outbox.claims import Claimed, Settle
from sagaguard.idempotency.outbox.control import DEFAULT_RETENTION
from sagaguard.idempotency.outbox.model import MessageStatus
from sagaguard.idempotency.outbox.records import Message

__all__ = [
    "Handler",
    "PoisonPayload",
    "RelaySettings",
    "RelayStats",
    "decode",
    "default_backoff",
    "failure_outcome",
    "released",
]

Handler = Callable[[Message], Any]
"""A plain callable taking the :class:`Message`: sync, or async (returning an awaitable)."""

_ERROR_CHARS = 2000


def default_backoff() -> tenacity.wait.wait_base:
    """1 s doubling to 5 minutes, plus up to 1 s of jitter (tenacity strategies)."""
    return tenacity.wait_exponential(multiplier=1.0, max=300.0) + tenacity.wait_random(0.0, 1.0)


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """How a relay works. Every field has a default that suits a small service."""

    batch_size: int = 100
    """Messages claimed per round."""
    lease: float = 30.0
    """Seconds a claim is held before another relay may take it over (renewed while a long batch
    runs)."""
    poll_interval: float = 1.0
    """Seconds an idle relay waits before claiming again when no NOTIFY wakes it."""
    backoff: tenacity.wait.wait_base = field(default_factory=default_backoff)
    """Delay before a failed message is tried again, by attempt number (a tenacity wait)."""
    concurrency: int = 1
    """Aggregates delivered in parallel (threads; async handlers share one event loop)."""
    poison_blocks_aggregate: bool = True
    """A dead message holds back the later messages of its aggregate until an operator replays
    or discards it (order kept). False lets them through (order broken around the dead one)."""
    permanent: tuple[type[BaseException], ...] = ()
    """Exception types that dead-letter a message at once. Always included: a non-retryable
    :class:`~sagaguard.idempotency.errors.NotApplied`, :class:`~sagaguard.idempotency.errors.ReplayedFailure`,
    and a payload or argument that does not decode (:class:`~sagaguard.idempotency.errors.CodecError`)."""
    retention: float = DEFAULT_RETENTION
    """Seconds delivered and discarded messages are kept before the relay purges them."""
    purge_every: float | None = 300.0
    """Seconds between purges (one page-wise pass); None: never (purge with the CLI)."""
    status_every: float = 10.0
    """Seconds between status readings for the depth and oldest-age gauges."""
    listen: bool = True
    """Wake on Postgres NOTIFY (ignored on SQLite, which polls)."""
    synchronous_commit: bool = False
    """Postgres: wait for the WAL flush of each claim and settle. False (the default) commits the
    relay's bookkeeping with ``synchronous_commit = off``: a database crash may forget its last
    few claims and acks, so those messages are delivered again (under the same provider key);
    no message is ever lost, since the messages themselves were committed by their producers."""

    def __post_init__(self) -> None:
        # The one check of every duration and count option (finite: a NaN poll interval would
        # make an idle relay spin), naming the field.
        for name in ("lease", "poll_interval", "status_every"):
            seconds(name, getattr(self, name))
        for name in ("batch_size", "concurrency"):
            count(name, getattr(self, name))
        seconds("retention", self.retention, zero_ok=True)
        if self.purge_every is not None:
            seconds("purge_every", self.purge_every)


@dataclass(slots=True)
class RelayStats:
    """What a relay has done so far (read :meth:`Relay.stats` for a consistent copy)."""

    worker_id: str = ""
    claimed: int = 0
    delivered: int = 0
    failed: int = 0
    dead: int = 0
    released: int = 0
    lost: int = 0
    """Settlements refused because another relay took the claim over."""
    batches: int = 0
    started_at: float = 0.0
    last_error: str | None = None
    wake_mode: str = "poll"
    depth: int | None = None
    """Pending + in flight, at the last status reading."""
    oldest_age: float | None = None
    dead_total: int | None = None
    """Dead letters in the table, at the last status reading."""


class PoisonPayload(ConfigurationError):
    """A message whose payload or headers do not decode: it can never be delivered."""


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__qualname__}: {exc}"
    return text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 3] + "..."


def failure_outcome(
    claimed: Claimed,
    exc: BaseException,
    settings: RelaySettings,
) -> Settle:
    """What a failed delivery becomes: dead (permanent error, or no attempts left) or a retry
    after ``settings.backoff`` for this attempt. Pure: no I/O, so it is table-tested."""
    error = _error_text(exc)
    # The shared retrier decides, as for a guarded call, going on from the attempts already made
    # (they are counted in the message, across relays and restarts).
    pause = Retrier(_Delivery(settings, claimed.max_attempts), first=claimed.attempts).next_pause(exc)
    if pause is None:
        return Settle(claimed.ref, claimed.attempts, MessageStatus.DEAD, error=error)
    return Settle(claimed.ref, claimed.attempts, MessageStatus.PENDING, delay=max(0.0, pause), error=error)


@dataclass(frozen=True, slots=True)
class _Delivery:
    """A message's delivery as a :class:`~sagaguard.idempotency.driving.RetryPolicy`: up to its
    ``max_attempts``, waiting ``settings.backoff``, never for a permanent failure."""

    settings: RelaySettings
    max_attempts: int

    @property
    def retry(self) -> Retry:
        return Retry(stop=tenacity.stop_after_attempt(self.max_attempts), wait=self.settings.backoff)

    def retries(self, exc: BaseException) -> bool:
        permanent = (*self.settings.permanent, ReplayedFailure, PoisonPayload, CodecError)
        return not isinstance(exc, permanent) and not (isinstance(exc, NotApplied) and not exc.retryable)


def released(claimed: Claimed) -> Settle:
    """Give a claimed message back untried (its attempt is not counted)."""
    return Settle(claimed.ref, claimed.attempts, MessageStatus.PENDING, release=True)


def decode(claimed: Claimed) -> Message:
    """The handler's view of a claimed row.

    Raises:
        PoisonPayload: the payload or the headers do not decode.
    """
    try:
        payload = json.loads(claimed.payload)
        headers = json.loads(claimed.headers) if claimed.headers else {}
        if not isinstance(headers, dict):
            raise ValueError("headers are not a JSON object")
    except ValueError as exc:
        raise PoisonPayload(f"message {claimed.id} does not decode: {exc}") from exc
    return Message(
        claimed.id, claimed.type, claimed.aggregatetype, claimed.aggregateid, payload, headers,
        claimed.provider_key, claimed.attempts, claimed.max_attempts, claimed.created_at,
        claimed.traceparent, claimed.tracestate,
    )  # fmt: skip
