"""The journal contract: the few atomic primitives a saga backend implements.

The saga rules (what runs next, when to compensate, when to park) live above the journal, in
:mod:`saga.coordinator`; a backend only has to make each primitive below atomic. The contract suite
in ``tests/test_saga_run.py`` runs every journal through the same sagas.

Times are seconds since the epoch on the *journal's* clock (the database's own time unless a clock
is injected), so runners with skewed clocks agree on lease expiry.

Every primitive raises :class:`~saga.errors.JournalUnavailable` when the backend cannot be reached
and :class:`~saga.errors.JournalError` for any other backend failure, with the driver's exception
chained as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol, runtime_checkable

from saga.records import Phase, SagaRecord, SagaSnapshot, SagaState, StartResult

__all__ = ["SagaJournal"]


@runtime_checkable
class SagaJournal(Protocol):
    """Where saga instances and their steps are recorded. Implementations: memory, SQL."""

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
    ) -> StartResult:
        """Atomically create or take over the saga ``saga_id``; one transaction.

        - No saga has this id: insert it RUNNING, token 1, lease ``now + lease``, no steps -> CREATED.
        - It is RUNNING or COMPENSATING, its lease ran out, and ``name``, ``version`` and
          ``fingerprint`` match: token + 1, lease ``now + lease`` -> TOOK_OVER.
        - Anything else -> EXISTING, unchanged (the caller replays, attaches or reports a conflict).

        Never check-then-act: of two concurrent starts, exactly one creates or takes over.
        The result carries the saga with all its step rows as they stand after the start.
        """
        ...

    def load(self, saga_id: str) -> SagaSnapshot | None:
        """The saga and its step rows (ordered by index), or None."""
        ...

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        """Write ``phase`` in one transaction: its step rows, the saga's state and error, the lease.

        This is the atomic phase: a crash leaves either all of it or none of it. Step rows replace the
        row at their index (``started_at`` is kept when the row exists and is stamped otherwise;
        ``updated_at`` is stamped). The lease becomes ``now + phase.lease``, or 0 when
        ``phase.lease`` is 0. A phase with no steps and no state is a heartbeat.

        Fenced: only when the saga's token equals ``token`` and the saga is RUNNING or COMPENSATING.

        Returns:
            The saga row after the commit.

        Raises:
            LostSagaLease: the token is stale, or the saga is unknown or no longer live.
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
