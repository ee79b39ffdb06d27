"""An in-process store: a real backend for one process (tests, notebooks, single-shot scripts).

It keeps every promise of the contract within its process; it cannot survive that process, so it is
no protection against crashes. Use :class:`~sagaguard.idempotency.stores.sql.SqlStore` (SQLite) for that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

from sagaguard.idempotency import holder as _holder
from sagaguard.idempotency.checks import storable_text
from sagaguard.idempotency.errors import LostOwnership
from sagaguard.idempotency.keys import EffectIdentity, check_ledger_id, new_ledger_id
from sagaguard.idempotency.records import ClaimOutcome, ClaimResult, Disposition, Record, State
from sagaguard.idempotency.store import first_token

__all__ = ["MemoryStore"]

_LIVE = (State.IN_PROGRESS, State.IN_DOUBT)
_FINISHED = (State.SUCCEEDED, State.FAILED)


class MemoryStore:
    """A dict under a lock.

    Args:
        clock: seconds since the epoch; inject one to test lease expiry without sleeping.
        ledger_id: the ledger's id (see :meth:`ledger_id`); by default a fresh one, drawn here.

    Raises:
        ConfigurationError: ``ledger_id`` is not a ledger id
            (:func:`~sagaguard.idempotency.keys.check_ledger_id`).
    """

    offload_async = False
    """Whether the guard runs this store's calls in a worker thread for async effects."""

    def __init__(self, clock: Callable[[], float] | None = None, *, ledger_id: str | None = None) -> None:
        self._clock = clock or time.time
        self._records: dict[str, Record] = {}
        self._lock = threading.Lock()
        self._ledger = new_ledger_id() if ledger_id is None else check_ledger_id(ledger_id)

    def ledger_id(self) -> str:
        """This ledger's id: drawn at construction (or given), for the life of the store."""
        return self._ledger

    def now(self) -> float:
        return self._clock()

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        now = self._clock()
        with self._lock:
            old = self._records.get(identity.key)
            if old is None or (
                old.state in _FINISHED and old.expires_at is not None and old.expires_at <= now
            ):
                # A replaced record's zombies hold tokens up to old.token; a deleted one left none
                # to count on from, so a random start keeps its zombies fenced.
                token = (old.token + 1) if old else first_token()
                rec = Record(
                    identity.key, identity.namespace, identity.scope, identity.name, identity.ordinal,
                    fingerprint, State.IN_PROGRESS, token, now + lease, 1, now, now,
                    holder=_holder.current(), result_type=identity.result_type,
                )  # fmt: skip
                self._records[identity.key] = rec
                return ClaimResult(ClaimOutcome.CLAIMED, rec)
            if old.state in _LIVE and old.lease_until <= now and old.fingerprint == fingerprint:
                rec = old.evolve(
                    state=State.IN_DOUBT,
                    token=old.token + 1,
                    attempts=old.attempts + 1,
                    lease_until=now + lease,
                    updated_at=now,
                    holder=_holder.current(),
                    # The taking-over code's declaration is the one its replays decode with.
                    result_type=identity.result_type or old.result_type,
                )
                self._records[identity.key] = rec
                return ClaimResult(ClaimOutcome.TOOK_OVER, rec)
            return ClaimResult(ClaimOutcome.EXISTING, old)

    def take_over(self, key: str, token: int, lease: float) -> Record | None:
        now = self._clock()
        with self._lock:
            old = self._records.get(key)
            if old is None or old.token != token or old.state not in _LIVE:
                return None
            rec = old.evolve(
                state=State.IN_DOUBT,
                token=token + 1,
                attempts=old.attempts + 1,
                lease_until=now + lease,
                updated_at=now,
                holder=_holder.current(),
            )
            self._records[key] = rec
            return rec

    def get(self, key: str) -> Record | None:
        storable_text("key", key, empty_ok=True)  # refused as every other store refuses it
        with self._lock:
            return self._records.get(key)

    def _owned(self, key: str, token: int) -> Record:
        rec = self._records.get(key)
        if rec is None:
            raise LostOwnership(key, token, "record is gone")
        if rec.token != token:
            raise LostOwnership(key, token, f"token is now {rec.token}")
        if rec.state not in _LIVE:
            raise LostOwnership(key, token, f"record is already {rec.state}")
        return rec

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        now = self._clock()
        with self._lock:
            old = self._owned(key, token)
            # Positional: what ``old.evolve(state=SUCCEEDED, ...)`` builds, without replace()'s
            # walk over the fields (the memory store is the guard's own cost in benchmarks).
            rec = Record(
                key, old.namespace, old.scope, old.name, old.ordinal, old.fingerprint, State.SUCCEEDED,
                token, old.lease_until, old.attempts, old.created_at, now, now + retention, result, None,
                old.holder, old.result_type,
            )  # fmt: skip
            self._records[key] = rec
            return rec

    def fail(
        self, key: str, token: int, disposition: Disposition, error: str, retention: float
    ) -> Record | None:
        now = self._clock()
        with self._lock:
            rec = self._owned(key, token)
            if disposition is Disposition.RETRYABLE:
                del self._records[key]
                return None
            if disposition is Disposition.PERMANENT:
                rec = rec.evolve(state=State.FAILED, error=error, expires_at=now + retention, updated_at=now)
            else:
                rec = rec.evolve(state=State.IN_DOUBT, error=error, lease_until=0.0, updated_at=now)
            self._records[key] = rec
            return rec

    def heartbeat(self, key: str, token: int, lease: float) -> float:
        now = self._clock()
        with self._lock:
            rec = self._owned(key, token).evolve(lease_until=now + lease, updated_at=now)
            self._records[key] = rec
            return rec.lease_until

    def list(
        self,
        *,
        states: Collection[State] | None = None,
        namespace: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[Record]:
        with self._lock:
            found = sorted(
                (
                    r
                    for r in self._records.values()
                    if (states is None or r.state in states)
                    and (namespace is None or r.namespace == namespace)
                    and (after is None or r.key > after)
                ),
                key=lambda r: r.key,
            )
        return found[:limit]

    def purge(self, *, limit: int = 1000) -> int:
        now = self._clock()
        with self._lock:
            doomed = [
                k
                for k, r in self._records.items()
                if r.state in _FINISHED and r.expires_at is not None and r.expires_at <= now
            ][:limit]
            for k in doomed:
                del self._records[k]
        return len(doomed)

    def close(self) -> None:
        pass
