"""The backend contract: the few atomic primitives an idempotency store implements.

The state rules (what a claim outcome means, when to replay, wait, resolve) live in the guard, above
the store; a backend only has to make each primitive below atomic. The contract suite in
``tests/test_store_contract.py`` runs every backend against the same assertions.

Times are seconds since the epoch on the *store's* clock (the database's or Redis's own time unless a
clock is injected), so workers with skewed clocks agree on lease expiry.

Every primitive raises :class:`~idempotency.errors.StoreUnavailable` when the backend cannot be
reached and :class:`~idempotency.errors.StoreError` for any other backend failure; the driver's own
exception is chained as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol, runtime_checkable

from idempotency.keys import EffectIdentity
from idempotency.records import ClaimResult, Disposition, Record, State

__all__ = ["IdempotencyStore"]


@runtime_checkable
class IdempotencyStore(Protocol):
    """An effect ledger. Implementations: memory, SQL (SQLite and Postgres), Redis."""

    def now(self) -> float:
        """The store's clock, in seconds since the epoch."""
        ...

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        """Atomically claim the record for ``identity.key``. One round trip where the backend allows.

        - No record, or a SUCCEEDED/FAILED one past ``expires_at``: write a fresh IN_PROGRESS record
          (token one above any token the key had, attempts 1, lease ``now + lease``) -> CLAIMED.
        - IN_PROGRESS or IN_DOUBT whose lease ran out, *with the same fingerprint*: set IN_DOUBT,
          token + 1, attempts + 1, lease ``now + lease`` -> TOOK_OVER. The caller must resolve it.
        - Anything else (a live lease, a finished record, another fingerprint) -> EXISTING, unchanged.

        Never check-then-act: two concurrent claims of one key yield exactly one CLAIMED/TOOK_OVER.
        """
        ...

    def get(self, key: str) -> Record | None:
        """The record under ``key``, or None (expired records may still be returned until purged)."""
        ...

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        """Record success: state SUCCEEDED, ``result`` stored, ``expires_at = now + retention``.

        Fenced: only when the record is IN_PROGRESS or IN_DOUBT and its token equals ``token``.

        Raises:
            LostOwnership: the token is stale or the record is gone or finished.
        """
        ...

    def fail(
        self, key: str, token: int, disposition: Disposition, error: str, retention: float
    ) -> Record | None:
        """Record a failed attempt. Fenced like :meth:`complete`.

        - PERMANENT: state FAILED, ``error`` stored, ``expires_at = now + retention``; returns it.
        - RETRYABLE: the record is deleted, so the next attempt claims afresh; returns None.
        - AMBIGUOUS: state IN_DOUBT, ``error`` stored, lease released (``lease_until = 0``) so the next
          attempt takes it over at once and resolves it; returns it.

        Raises:
            LostOwnership: the token is stale or the record is gone or finished.
        """
        ...

    def heartbeat(self, key: str, token: int, lease: float) -> float:
        """Extend the holder's lease to ``now + lease`` and return the new deadline. Fenced.

        Raises:
            LostOwnership: the token is stale or the record is gone or finished.
        """
        ...

    def list(
        self,
        *,
        states: Collection[State] | None = None,
        namespace: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[Record]:
        """Records ordered by key, optionally filtered, starting after key ``after`` (paging)."""
        ...

    def purge(self, *, limit: int = 1000) -> int:
        """Delete up to ``limit`` SUCCEEDED/FAILED records whose ``expires_at`` has passed.

        Never deletes IN_PROGRESS or IN_DOUBT records. Returns how many were deleted; call again
        until it returns less than ``limit`` to purge everything.
        """
        ...

    def close(self) -> None:
        """Release connections. The store is unusable afterwards."""
        ...
