"""Steering saga instances from outside: deliver a signal, ask for a cancellation.

::

    signal(journal, "order-42", "approval", Approval(by="ana"))   # a WAITING saga becomes due
    cancel(journal, "order-43", reason="customer withdrew")       # compensates at the next boundary

Both only write to the journal; the saga is continued by its runner or by
:func:`saga.recovery.recover` (the ``sagaguard sagas worker`` command).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from idempotency.codec import Codec, encode_error
from idempotency.errors import ConfigurationError
from saga.decisions import pivot_started
from saga.errors import SagaCancelled, SagaNotFound
from saga.journal import SagaJournal
from saga.records import RESUMABLE_STATES, CancelOutcome, SignalOutcome

__all__ = ["cancel", "signal"]

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
        ConfigurationError: a malformed name; CodecError (a ConfigurationError): an unstorable
            payload.
        JournalError: the journal failed.
    """
    if not _NAME.fullmatch(name):
        raise ConfigurationError(f"signal name {name!r} must be a letter or _ then letters, digits, _ . -")
    return journal.signal(saga_id, name, _any().encode(payload))


def cancel(journal: SagaJournal, saga_id: str, *, reason: str = "cancelled") -> CancelOutcome:
    """Ask for the saga ``saga_id`` to stop and undo what it did.

    A saga that has not started its pivot compensates: its runner at its next step boundary, or,
    when it waits or nobody holds it, the recovery sweeper. Once the pivot has started the saga only
    goes forward, and cancelling is TOO_LATE.

    Returns:
        REQUESTED; ALREADY when a cancellation is pending or it is compensating anyway; TOO_LATE.

    Raises:
        SagaNotFound: no saga has this id.
        JournalError: the journal failed.
    """
    snapshot = journal.load(saga_id)
    if snapshot is None:
        raise SagaNotFound(saga_id)
    if snapshot.saga.state not in RESUMABLE_STATES or pivot_started(snapshot):
        return CancelOutcome.TOO_LATE
    return journal.cancel(saga_id, encode_error(SagaCancelled(reason)))
