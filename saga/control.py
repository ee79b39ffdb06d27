"""Steering saga instances from outside: signals, cancellation, and an operator's hand.

::

    signal(journal, "order-42", "approval", Approval(by="ana"))   # a WAITING saga becomes due
    cancel(journal, "order-43", reason="customer withdrew")       # compensates at the next boundary
    retry(journal, "order-44")                  # NEEDS_ATTENTION: try the failed part again
    resolve(journal, "order-45", "book_hotel", note="refunded by phone")  # undone by hand: go on

All only write to the journal; the saga is continued by its runner or by
:func:`sagaguard.saga.recovery.recover` (the ``sagaguard sagas worker`` command).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from sagaguard.idempotency.codec import Codec, encode_error
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.saga.checks import check_saga_id
from sagaguard.saga.decisions import failure_state, fresh_undo_signal, undo_round
from sagaguard.saga.errors import SagaCancelled, SagaError, SagaNotFound
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import (
    CancelOutcome,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    SignalOutcome,
    StepRecord,
    StepState,
)

__all__ = ["NotParked", "cancel", "resolve", "retry", "signal"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,99}")


@functools.cache
def _any() -> Codec[Any]:
    return Codec(Any)


def signal(journal: SagaJournal, saga_id: str, name: str, payload: Any = None) -> SignalOutcome:
    """Deliver the signal ``name`` with ``payload`` to the saga ``saga_id``, durably.

    A saga WAITING for it becomes due at once; one that waits for it later finds it at once. Each
    name is delivered once per saga: a second delivery is DUPLICATE and the first payload stands.

    Args:
        journal: the saga's journal.
        saga_id: the instance.
        name: the signal's name (letters, digits, ``_ . -``).
        payload: JSON-storable (plain JSON types, a dataclass, a pydantic model).

    Returns:
        DELIVERED, DUPLICATE, or TOO_LATE when the saga has ended or needs attention.

    Raises:
        SagaNotFound: no saga has this id.
        ConfigurationError: a malformed name or saga id (a NUL character); CodecError (a
            ConfigurationError): an unstorable payload or a lone surrogate in the saga id.
        JournalError: the journal failed.
    """
    check_saga_id(saga_id)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigurationError(f"signal name {name!r} must be a letter or _ then letters, digits, _ . -")
    return journal.signal(saga_id, name, _any().encode(payload))


def cancel(journal: SagaJournal, saga_id: str, *, reason: str = "cancelled") -> CancelOutcome:
    """Ask for the saga ``saga_id`` to stop and undo what it did.

    A saga that has not started its pivot compensates: its runner at its next step boundary, or,
    when it waits or nobody holds it, the recovery sweeper. Once the pivot has started the saga only
    goes forward, and cancelling is TOO_LATE; the journal decides that in the transaction that would
    record the cancel (:func:`~sagaguard.saga.decisions.cancel_outcome`).

    Returns:
        REQUESTED; ALREADY when a cancellation is pending or it is compensating anyway; TOO_LATE.

    Raises:
        SagaNotFound: no saga has this id.
        ConfigurationError: a malformed saga id, as for :func:`signal`.
        JournalError: the journal failed.
    """
    # The journal decides in the transaction that records it, so a cancel racing the pivot's
    # start is either refused or honoured, never answered REQUESTED and then ignored.
    return journal.cancel(check_saga_id(saga_id), encode_error(SagaCancelled(reason)))


class NotParked(SagaError):
    """An operator action that needs a NEEDS_ATTENTION saga (or step) found something else.

    Attributes:
        saga_id: the saga.
        state: the saga's state when it was read.
    """

    def __init__(self, saga_id: str, state: SagaState, message: str | None = None) -> None:
        self.saga_id = saga_id
        self.state = state
        super().__init__(message or f"saga {saga_id!r} is {state.value}, not needs_attention")


def _parked(journal: SagaJournal, saga_id: str) -> SagaSnapshot:
    snapshot = journal.load(check_saga_id(saga_id))
    if snapshot is None:
        raise SagaNotFound(saga_id)
    if snapshot.saga.state is not SagaState.NEEDS_ATTENTION:
        raise NotParked(saga_id, snapshot.saga.state)
    return snapshot


def _before_compensation(row: StepRecord) -> StepState:
    """The state a COMPENSATION_FAILED row had before its compensation ran."""
    if row.result is not None:
        return StepState.SUCCEEDED
    return StepState.FAILED if row.error is not None else StepState.STARTED


def _compensating(snapshot: SagaSnapshot) -> bool:
    """Whether the saga had turned to compensation before it was parked."""
    for row in snapshot.steps:
        if row.state in (StepState.COMPENSATED, StepState.COMPENSATION_FAILED):
            return True
        undo = failure_state(row.kind, row.not_applied) is SagaState.COMPENSATING
        if row.state is StepState.FAILED and undo:
            return True
    return False


def _cause(snapshot: SagaSnapshot) -> str | None:
    """The error that made the saga compensate: its failed step's, else what the saga recorded."""
    for row in snapshot.steps:
        if row.state is StepState.FAILED and row.error is not None:
            return row.error
    return snapshot.saga.error


def _reopen(
    journal: SagaJournal, snapshot: SagaSnapshot, state: SagaState, rows: list[StepRecord]
) -> SagaRecord:
    error = _cause(snapshot) if state is SagaState.COMPENSATING else None
    if state is SagaState.RUNNING and snapshot.saga.cancel_requested:
        error = snapshot.saga.error  # the pending cancellation's cause, still honoured before the pivot
    record = journal.reopen(snapshot.saga.saga_id, snapshot.saga.token, state, tuple(rows), error)
    if record is None:
        # Another operator (or a second click) acted on the same read first.
        saga_id = snapshot.saga.saga_id
        found = journal.load(saga_id)
        raise NotParked(saga_id, SagaState.NEEDS_ATTENTION if found is None else found.saga.state)
    return record


def retry(journal: SagaJournal, saga_id: str, *, fresh: bool = False) -> SagaRecord:
    """Put a NEEDS_ATTENTION saga back to work, to try again what made it stop.

    - A compensation exhausted its retries: the step's compensation is due again and the saga
      COMPENSATING (the compensation runs through the guard under the same key, so it is at least
      once and must be idempotent, as always). Its guarded effects replay what they recorded, a
      refusal (*not applied*, permanent: an HTTP 4xx) included. With ``fresh=True`` (the
      operator's choice, once the fault is fixed) it runs under a new attempt key instead, so
      every effect inside it is sent again under a new key: the refused one gets a new chance,
      and one that had succeeded is sent again too (safe only when the provider deduplicates it
      by a key of its own, such as a refund keyed on the payment it refunds).
    - A step after the pivot ran out of forward retries, or the pivot failed in a way that may have
      applied it: that step runs again (its effects replay through the guard) and the saga RUNNING.
    - It was taken over too often: it continues where its journal stands, with its recovery count
      reset.

    The saga is due at once: the recovery sweeper (``sagaguard sagas worker``, :func:`saga.recover`)
    takes it, or a ``runner.run`` of the same id does.

    Returns:
        The saga row after the write.

    Raises:
        SagaNotFound: no saga has this id.
        NotParked: it does not need attention (or another operator acted on it first).
        JournalError: the journal failed.
    """
    snapshot = _parked(journal, saga_id)
    rows: list[StepRecord] = []
    for row in snapshot.steps:
        if row.state is StepState.COMPENSATION_FAILED:
            rows.append(row.evolve(state=_before_compensation(row)))
    if rows or _compensating(snapshot):
        record = _reopen(journal, snapshot, SagaState.COMPENSATING, rows)
        if fresh:
            # After the reopen (a saga needing attention takes no signal). A worker that takes it
            # in between runs the old round once more: the refusal is replayed, the saga needs
            # attention again, and the next fresh retry counts on from there.
            for row in rows:
                nth = undo_round(snapshot.signals, row.index) + 1
                journal.signal(saga_id, fresh_undo_signal(row.index, nth), "null")
        return record
    for row in snapshot.steps:
        if row.state is StepState.FAILED:
            rows.append(row.evolve(state=StepState.STARTED))
    return _reopen(journal, snapshot, SagaState.RUNNING, rows)


def resolve(
    journal: SagaJournal, saga_id: str, step: str, *, note: str = "resolved by an operator"
) -> SagaRecord:
    """Mark the failed compensation of ``step`` as done by hand, then go on compensating.

    The step becomes COMPENSATED with ``note`` as its ``resolution``; the saga COMPENSATING and due
    at once, so the compensations of the steps before it run (in reverse order), and it ends
    COMPENSATED when they succeed.

    Returns:
        The saga row after the write.

    Raises:
        SagaNotFound: no saga has this id.
        NotParked: it does not need attention, or ``step`` is not a step whose compensation failed.
        JournalError: the journal failed.
    """
    snapshot = _parked(journal, saga_id)
    found = [row for row in snapshot.steps if row.name == step]
    if not found or found[0].state is not StepState.COMPENSATION_FAILED:
        failed = [row.name for row in snapshot.steps if row.state is StepState.COMPENSATION_FAILED]
        message = f"saga {saga_id!r}: step {step!r} has no failed compensation (failed: {failed or 'none'})"
        raise NotParked(saga_id, snapshot.saga.state, message)
    done = found[0].evolve(state=StepState.COMPENSATED, resolution=note or "resolved by an operator")
    return _reopen(journal, snapshot, SagaState.COMPENSATING, [done])
