"""The journal contract: the few atomic primitives a saga backend implements.

The saga rules (what runs next, when to compensate, when to park) live above the journal, in
:mod:`sagaguard.saga.decisions` and :mod:`sagaguard.saga.coordinator`; a backend only has to make each
primitive below atomic. ``tests/test_journal_contract.py`` holds every backend to this contract, and
``tests/test_saga_run.py`` runs every journal through the same sagas.

Times are seconds since the epoch on the *journal's* clock (the database's own time unless a clock
is injected), so runners with skewed clocks agree on lease expiry.

Every primitive raises :class:`~sagaguard.saga.errors.JournalUnavailable` when the backend cannot be reached
and :class:`~sagaguard.saga.errors.JournalError` for any other backend failure, with the driver's exception
chained as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

from sagaguard.saga.records import (
    CancelOutcome,
    Phase,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    SignalOutcome,
    StartResult,
    StepRecord,
)

__all__ = ["SagaJournal"]


@runtime_checkable
class SagaJournal(Protocol):
    """Where saga instances, their steps and their signals are recorded.

    Implementations: :class:`~sagaguard.saga.journals.memory.MemoryJournal`,
    :class:`~sagaguard.saga.journals.sql.SqlJournal` (SQLite, Postgres),
    :class:`~sagaguard.saga.journals.redis.RedisJournal`.

    Every method that takes a ``saga_id`` checks it first, on every journal alike
    (:func:`~sagaguard.saga.checks.check_saga_id`: ConfigurationError for an empty id, one not a
    str or holding a NUL, CodecError for a lone surrogate), before anything is read or written: on
    Postgres ``"X\\x00a"`` would otherwise reach the saga ``"X"``.
    """

    def now(self) -> float:
        """The journal's clock, in seconds since the epoch."""
        ...

    def start(
        self,
        saga_id: str,
        *,
        name: str,
        version: int,
        input: str,
        fingerprint: str,
        lease: float,
        timeout: float = 0.0,
        first: StepRecord | None = None,
        holder: str | None = None,
    ) -> StartResult:
        """Atomically create or take over the saga ``saga_id``; one transaction.

        - No saga has this id: insert it RUNNING, token 1, lease ``now + lease``, deadline
          ``now + timeout`` (0 when ``timeout`` is 0), with no step rows but ``first`` (written as
          by :meth:`commit`, stamped with the saga's creation time) -> CREATED. Creating the saga
          and registering its first step (STARTED, compensation registered) is thus one commit:
          the saga's first atomic phase.
        - It is RUNNING, COMPENSATING or WAITING, its ``lease_until`` has passed, and ``name``,
          ``version`` and ``fingerprint`` match: taken over as by :meth:`claim` -> TOOK_OVER.
        - It is RUNNING or COMPENSATING under a live lease whose holder is provably dead on this
          host, and the three match: taken over with :meth:`take_over` (a second, fenced
          transaction) -> TOOK_OVER; of racing starts exactly one takes it (see :mod:`sagaguard.saga.lease`).
        - Anything else -> EXISTING, unchanged (the caller replays, attaches or reports a conflict).

        ``first`` is written only when the saga is created; a take-over or an existing saga keeps
        its own rows. Creating or taking over records ``holder`` (None: this process,
        :func:`sagaguard.idempotency.holder.current`) as the saga's
        :attr:`~sagaguard.saga.records.SagaRecord.holder`.

        Never check-then-act: of two concurrent starts, exactly one creates or takes over.
        The result carries the saga with all its step rows and signals as they stand after the start.

        Raises:
            ConfigurationError: ``saga_id`` is not storable text on every backend
                (:func:`~sagaguard.saga.checks.check_saga_id`), before anything is written.
        """
        ...

    def claim(self, saga_id: str, *, lease: float, holder: str | None = None) -> SagaSnapshot | None:
        """Atomically take over the saga if it is due; one transaction.

        Due means RUNNING, COMPENSATING or WAITING with ``lease_until <= now``. Taking over sets
        token + 1, lease ``now + lease`` and the holder ``holder`` (None: this process); a WAITING
        saga becomes RUNNING, any other adds one to ``recoveries``. Of two concurrent claims
        exactly one succeeds: that is the fence that lets any number of recovery workers race for
        the same sagas. A RUNNING or COMPENSATING saga under a live lease whose holder is provably
        dead on this host is taken over with :meth:`take_over` (a second, fenced transaction).

        Returns:
            The saga with its steps and signals after the take-over, or None when it is not due
            (someone else took it, it ended, it is unknown).
        """
        ...

    def take_over(
        self, saga_id: str, token: int, *, lease: float, holder: str | None = None
    ) -> SagaSnapshot | None:
        """Take over the saga held under ``token`` whatever its lease; one transaction.

        For a caller that proved the holder dead (:mod:`sagaguard.saga.lease`). Only when the saga is
        RUNNING or COMPENSATING and its token equals ``token``: token + 1, lease ``now + lease``,
        holder ``holder`` (None: this process), ``recoveries`` + 1. The bumped token refuses the
        dead holder's late commits (:class:`~sagaguard.saga.errors.LostSagaLease`); of racing take-overs with
        the same ``token`` exactly one succeeds.

        Returns:
            The saga with its steps and signals after the take-over, or None (the token moved on,
            the saga ended, waits, or is unknown).
        """
        ...

    def due(self, *, limit: int = 100) -> list[SagaRecord]:
        """Up to ``limit`` sagas that :meth:`claim` would take now, longest overdue first; then
        the live sagas whose holder is provably dead on this host (:meth:`claim` takes them too).

        A hint, not a promise: each must still be claimed (another worker may be faster).
        """
        ...

    def load(self, saga_id: str) -> SagaSnapshot | None:
        """The saga and its step rows (ordered by index), or None.

        Raises:
            ConfigurationError: ``saga_id`` is not storable text
                (:func:`~sagaguard.saga.checks.check_saga_id`), on every journal alike: on Postgres
                ``"X\x00a"`` would find ``"X"``.
        """
        ...

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        """Write ``phase`` in one transaction: its step rows, the saga's state and error, the lease.

        This is the atomic phase: a crash leaves either all of it or none of it. Step rows replace the
        row at their index (``started_at`` is kept when the row exists and is stamped otherwise;
        ``updated_at`` is stamped). The lease becomes ``now + phase.lease``, or 0 when
        ``phase.lease`` is 0. A phase with no steps and no state is a heartbeat.

        A phase with ``state=WAITING`` parks the saga: ``waiting_for`` and ``wait_until`` are written
        and ``lease_until`` becomes ``phase.wake_at``, or *now* when a signal named ``waiting_for``
        is already recorded or (if ``phase.wake_on_cancel``) a cancellation is pending, checked in
        the same transaction, so a signal racing the parking is never lost. Any other phase leaves
        those fields alone.

        A phase with ``unless_cancelled`` (and ``state=COMPLETED``) completes the saga only when no
        cancellation is pending, checked in the same transaction: with one pending its step rows
        are written, but the saga stays RUNNING with its error, and its lease becomes
        ``now + phase.lease``, so a cancellation racing the last step is never lost; without one
        the saga completes with ``phase.error`` and ``lease_until`` 0.
        ``cancel_requested`` is never changed by a commit.

        Fenced: only when the saga's token equals ``token`` and the saga is RUNNING or COMPENSATING.

        Returns:
            The saga row after the commit.

        Raises:
            LostSagaLease: the token is stale, or the saga is unknown or no longer live.
        """
        ...

    def signal(self, saga_id: str, name: str, payload: str) -> SignalOutcome:
        """Record the signal ``name`` with ``payload`` (JSON) for the saga; one transaction.

        The first signal of a name is kept (DUPLICATE for later ones). A saga that has ended or
        needs attention takes no signals (TOO_LATE, nothing recorded). A signal may arrive before
        the saga waits for it; a saga WAITING for this very name becomes due at once
        (``lease_until = now``).

        Raises:
            SagaNotFound: no saga has this id.
        """
        ...

    def cancel(self, saga_id: str, cause: str) -> CancelOutcome:
        """Ask for the saga to be undone; one transaction.

        - RUNNING or WAITING with no cancellation pending: set ``cancel_requested`` and record
          ``cause`` (JSON) as the saga's ``error``; a WAITING saga becomes due at once -> REQUESTED.
        - A cancellation is pending, or the saga is COMPENSATING: unchanged -> ALREADY.
        - It has ended or needs attention, or its pivot has started (a row of the pivot or of a
          later step, not marked not applied): unchanged -> TOO_LATE.

        The rule is :func:`~sagaguard.saga.decisions.cancel_outcome`, applied to the saga and its
        steps as this transaction reads them: a runner's phase commit (its pivot's row, its
        completion) is either read by it or sees the cancellation, so what answers REQUESTED is
        honoured (before the pivot, by the runner's next decision).

        Raises:
            SagaNotFound: no saga has this id.
        """
        ...

    def reopen(
        self, saga_id: str, token: int, state: SagaState, steps: Sequence[StepRecord], error: str | None
    ) -> SagaRecord | None:
        """An operator puts a saga that needs attention back to work; one transaction.

        Only when the saga is NEEDS_ATTENTION and its token equals ``token`` (the one the operator
        read, so two operators never act on the same read twice): its state becomes ``state``
        (RUNNING or COMPENSATING), its error ``error``, token + 1, ``recoveries`` 0 and
        ``lease_until`` *now*, so the next :meth:`due`/:meth:`claim` takes it; ``steps`` are written
        as by :meth:`commit`.

        Returns:
            The saga row after the write, or None when the saga is not (or no longer) in that state
            with that token.
        """
        ...

    def list(
        self,
        *,
        states: Collection[SagaState] | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[SagaRecord]:
        """Sagas ordered by id, optionally filtered by state, starting after id ``after`` (paging)."""
        ...

    def close(self) -> None:
        """Release connections. The journal is unusable afterwards."""
        ...
