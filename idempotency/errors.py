"""Errors raised by the idempotency layer.

Every error derives from one root, so callers can catch the whole package at once::

    IdempotencyError
    ├── ConfigurationError        bad input found before anything ran (definition time or call time)
    │   ├── CodecError            a value cannot be stored as JSON or read back as its type
    │   ├── NoScope               a guarded call has neither a scope nor an explicit key
    │   └── SchemaVersionMismatch a SQL table set is missing, older or newer than this code
    ├── NotApplied                raised by an effect: refused before it changed anything
    ├── KeyConflict               same key, other arguments (Stripe: 400, IETF draft: 422)
    ├── AlreadyInProgress         a live duplicate holds the claim past the wait bound (IETF: 409)
    ├── OutcomeUnknown            a crash left the effect in doubt and policy forbids a re-run
    │   └── OutcomeNotRecorded    the effect ran, then the store failed while recording its outcome
    ├── LostOwnership             a fenced write carried a stale token: another worker took over
    ├── RecordNotFound            an operator named a key that the store does not hold (also a LookupError)
    ├── ReplayedFailure           replay of a recorded failure whose type is not registered
    └── StoreError                the backend failed before the effect ran: it was not run
        └── StoreUnavailable      the backend cannot be reached; transient, the effect was not run

Which side of the effect an error stands on: a ``StoreError`` (or ``StoreUnavailable``) from a
guarded call means the effect was **not** run (the claim, or the take-over of a dead holder's claim,
failed; no body was called). A store that fails *after* the body ran, while recording what it did,
raises :class:`OutcomeNotRecorded` instead, chained ``from`` the store's error: the effect ran (or
may have), its outcome is in doubt, as after a crash.

Errors carry their data as attributes (``key``, ``record``), never only in the message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sagaguard.idempotency.records import Record

__all__ = [
    "AlreadyInProgress",
    "CodecError",
    "ConfigurationError",
    "IdempotencyError",
    "KeyConflict",
    "LostOwnership",
    "NoScope",
    "NotApplied",
    "OutcomeNotRecorded",
    "OutcomeUnknown",
    "RecordNotFound",
    "ReplayedFailure",
    "SchemaVersionMismatch",
    "StoreError",
    "StoreUnavailable",
]


class IdempotencyError(Exception):
    """Root of every error this package raises."""


class ConfigurationError(IdempotencyError, ValueError):
    """A definition or call is malformed; found before any effect ran."""


class CodecError(ConfigurationError):
    """A value cannot be encoded to JSON, or decoded back to its declared type."""


class NoScope(ConfigurationError):
    """A guarded call has no scope to derive its key from and no explicit ``key=``.

    Silently running such a call unguarded is the failure this library exists to end, so it is an
    error (compare Powertools, which skips idempotency when the key is missing).
    """


class SchemaVersionMismatch(ConfigurationError):
    """A SQL table set (effects, journal, outbox, ...) is not at the schema revision this code uses.

    Raised when a store, journal or outbox opens (without ``create``) on tables that are missing
    (``state`` ``"empty"``), older or unversioned (``"behind"``), or written by a newer sagaguard
    (``"ahead"``). The message names what to run: ``sagaguard db upgrade --store URL`` (password
    masked) for the first two, a newer sagaguard for the last.

    Args:
        message: what is wrong and what to run.
        table_set: the table set's name (``effects``).
        name: its configured table name or prefix.
        current: the revision the database records, or None (none recorded).
        head: the revision this code uses.
        state: ``"empty"``, ``"behind"`` or ``"ahead"``.
        command: the command that fixes it, or None when only a newer sagaguard does.
    """

    def __init__(
        self,
        message: str,
        *,
        table_set: str,
        name: str,
        current: str | None,
        head: str,
        state: str,
        command: str | None,
    ) -> None:
        super().__init__(message)
        self.table_set = table_set
        self.name = name
        self.current = current
        self.head = head
        self.state = state
        self.command = command


class NotApplied(IdempotencyError):
    """Raise from an effect to say the call was refused before it changed anything.

    Args:
        message: what happened.
        retryable: True if trying again later may succeed (rate limited, service paused); False if it
            never will (card declined, invalid request), which records the effect as FAILED.
    """

    def __init__(self, message: str = "not applied", *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class KeyConflict(IdempotencyError):
    """The key is already recorded with a different argument fingerprint.

    Attributes:
        key: the effect key.
        recorded_fingerprint: the fingerprint stored with the record.
        fingerprint: the fingerprint of this call's arguments.
    """

    def __init__(self, key: str, recorded_fingerprint: str, fingerprint: str) -> None:
        super().__init__(
            f"effect key {key[:16]}... was recorded with other arguments "
            f"(fingerprint {recorded_fingerprint[:12]} != {fingerprint[:12]})"
        )
        self.key = key
        self.recorded_fingerprint = recorded_fingerprint
        self.fingerprint = fingerprint


class AlreadyInProgress(IdempotencyError):
    """Another live worker holds the claim and did not finish within the wait bound.

    Safe to retry later: nothing was recorded for this attempt.
    """

    def __init__(self, record: Record) -> None:
        super().__init__(
            f"effect {record.name!r} (key {record.key[:16]}...) is in progress elsewhere "
            f"(token {record.token})"
        )
        self.record = record
        self.key = record.key


class OutcomeUnknown(IdempotencyError):
    """The effect may or may not have happened, and the effect's policy forbids running it again.

    The record stays IN_DOUBT for an operator (``sagaguard effects resolve``) or a later reconciler.
    """

    def __init__(self, record: Record, reason: str = "") -> None:
        text = f"effect {record.name!r} (key {record.key[:16]}...) is in doubt"
        super().__init__(f"{text}: {reason}" if reason else text)
        self.record = record
        self.key = record.key


class OutcomeNotRecorded(OutcomeUnknown):
    """The effect's body ran, then the store failed while recording its outcome.

    The effect may have changed the world (the body returned, or raised after sending): tell the
    user "in doubt", never "not run". The record stays as the store last held it (IN_PROGRESS under
    this call's token, or IN_DOUBT) until its lease runs out; the next attempt then takes it over in
    doubt and resolves it (reconciler, provider key, policy), as after a crash. The store's error
    (a :class:`StoreError`, often :class:`StoreUnavailable`) is chained as ``__cause__``.

    Attributes:
        record: the record as this call held it.
        has_result: whether the body returned (``result`` is then what it returned, None included).
        result: the body's return value (or the reconciler's answer), when ``has_result``.
        error: the exception the body raised, when it raised; None otherwise.
    """

    def __init__(
        self,
        record: Record,
        reason: str = "",
        *,
        has_result: bool = False,
        result: object = None,
        error: BaseException | None = None,
    ) -> None:
        super().__init__(record, reason or "the store failed while recording its outcome")
        self.has_result = has_result
        self.result = result
        self.error = error


class LostOwnership(IdempotencyError):
    """A fenced write was refused: the caller's token is stale or the record changed state.

    A worker whose lease lapsed gets this instead of overwriting the worker that took over.
    """

    def __init__(self, key: str, token: int, detail: str = "") -> None:
        super().__init__(
            f"lost ownership of effect key {key[:16]}... (token {token})" + (f": {detail}" if detail else "")
        )
        self.key = key
        self.token = token


class RecordNotFound(IdempotencyError, LookupError):
    """No record is stored under the given key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no effect record under key {key}")
        self.key = key


class ReplayedFailure(IdempotencyError):
    """Replay of a recorded permanent failure whose exception type cannot be rebuilt.

    Exception types named in the effect's ``permanent=`` list are rebuilt and re-raised as themselves;
    any other recorded failure is raised as this error, carrying the original type name and message.
    """

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


class StoreError(IdempotencyError):
    """The backing store failed. ``transient`` says whether retrying may help.

    Raised by a guarded call only before its body ran (the effect was not run); a failure while
    recording after the body ran is :class:`OutcomeNotRecorded`.
    """

    transient: bool = False


class StoreUnavailable(StoreError):
    """The store cannot be reached. Transient. Fails closed: no effect runs unclaimed."""

    transient = True
