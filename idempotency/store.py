"""The backend contract: the few atomic primitives an idempotency store implements.

The state rules (what a claim outcome means, when to replay, wait, resolve) live in the guard, above
the store; a backend only has to make each primitive below atomic. The contract suite in
``tests/test_store_contract.py`` runs every backend against the same assertions.

Times are seconds since the epoch on the *store's* clock (the database's or Redis's own time unless a
clock is injected), so workers with skewed clocks agree on lease expiry.

Every primitive raises :class:`~sagaguard.idempotency.errors.StoreUnavailable` when the backend cannot be
reached and :class:`~sagaguard.idempotency.errors.StoreError` for any other backend failure; the driver's own
exception is chained as ``__cause__``.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection
from typing import Final, Protocol, runtime_checkable

from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import ClaimResult, Disposition, Record, State

__all__ = ["FIRST_TOKEN_BITS", "IdempotencyStore", "first_token"]

FIRST_TOKEN_BITS: Final = 48
"""Random bits in the first token of a key's record: ``1 <= token <= 2**48``, far below ``2**53``, so
take-overs can add one for ever and the token stays an exact double (Lua numbers, JSON)."""


def first_token() -> int:
    """The fencing token of a fresh claim of an absent key: ``secrets.randbits(48) + 1``.

    A deleted record (a RETRYABLE failure, a purge, Redis's TTL, an operator's ``effects resolve
    --not-applied``) leaves no trace of the tokens it had, so a counter that restarted at 1 would
    hand the new holder the very token a zombie of the deleted generation may still hold, and the
    zombie's writes would pass the fence. A random start makes such a reuse vanishingly unlikely
    (about one chance in 2**48 per earlier generation a zombie survives from). Backends draw it
    here, from :mod:`secrets`, and pass it in (a bound SQL parameter, a script argument), so every
    backend gets the same range and the same randomness, not the database's or Lua's own.
    """
    return secrets.randbits(FIRST_TOKEN_BITS) + 1


@runtime_checkable
class IdempotencyStore(Protocol):
    """An effect ledger. Implementations: memory, SQL (SQLite and Postgres), Redis."""

    def now(self) -> float:
        """The store's clock, in seconds since the epoch."""
        ...

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        """Atomically claim the record for ``identity.key``. One round trip where the backend allows.

        Every record a claim writes (CLAIMED or TOOK_OVER) stores this process's holder identity
        (:func:`sagaguard.idempotency.holder.current`) as ``holder``; an EXISTING record is returned with the
        holder it has.

        - No record: write a fresh IN_PROGRESS record (attempts 1, lease ``now + lease``) under a
          random starting token, never 1 by design (:func:`first_token`, drawn in Python and passed
          to the backend) -> CLAIMED. Why: a deleted record leaves no token to count on from, and a
          restart at 1 would let a zombie of the deleted generation, still holding token 1, pass
          the fence of the new holder's writes.
        - A SUCCEEDED/FAILED record past ``expires_at``: replace it the same way, but under the token
          one above any token the key had (the old record's + 1), so its zombies stay fenced too
          -> CLAIMED.
        - IN_PROGRESS or IN_DOUBT whose lease ran out, *with the same fingerprint*: set IN_DOUBT,
          token + 1, attempts + 1, lease ``now + lease`` -> TOOK_OVER. The caller must resolve it.
        - Anything else (a live lease, a finished record, another fingerprint) -> EXISTING, unchanged.

        Never check-then-act: two concurrent claims of one key yield exactly one CLAIMED/TOOK_OVER.
        """
        ...

    def take_over(self, key: str, token: int, lease: float) -> Record | None:
        """Atomically take over a live-leased record whose holder the caller found dead.

        Compare-and-set on ``token``: only when the record is IN_PROGRESS or IN_DOUBT and its token
        still equals ``token`` (the one the caller saw with the dead holder), set it IN_DOUBT,
        token + 1, attempts + 1, lease ``now + lease``, ``updated_at = now`` and ``holder`` to this
        process's identity, and return it: the caller now owns it, exactly as after a claim that
        answered TOOK_OVER, and must resolve it before running anything. The lease is not checked:
        the caller proved the holder dead (:func:`sagaguard.idempotency.holder.is_dead_on_this_host`), which
        is why it need not wait for the lease.

        Returns None, writing nothing, when the record changed since (another claimant took it
        over first, the holder finished, it is gone): two racing callers get exactly one record.
        """
        ...

    def get(self, key: str) -> Record | None:
        """The record under ``key``, or None (expired records may still be returned until purged).

        Raises:
            ConfigurationError: ``key`` holds a NUL character (CodecError: a lone surrogate), on
                every store alike, before the backend is asked.
        """
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

    def ledger_id(self) -> str:
        """The id of this ledger, part of every provider key derived for its records
        (:func:`~sagaguard.idempotency.keys.provider_key`), so two ledgers sharing a provider
        account never send each other's keys.

        Drawn once when the ledger is created and kept in it (memory: at construction; SQL: a row
        of the ``{table}_ledger`` table; Redis: the key ``{prefix}:{ledger}``), read once when the
        store opens; concurrent first opens agree on one id (insert if absent, read back). A ledger
        that already held records when it got its id has the empty id
        (:data:`~sagaguard.idempotency.keys.LEGACY_LEDGER`), which derives the keys of versions
        before ledger ids, so nothing recorded changes meaning. A store may be given its id
        (``ledger_id=``), which then wins over the kept one. A store without this method is
        treated as having the empty id.
        """
        ...

    def close(self) -> None:
        """Release connections. The store is unusable afterwards."""
        ...
