"""The crashing wrappers: a journal and a store that count their calls on a :class:`Tripwire` and
die at its kill point.
"""

from __future__ import annotations

import builtins
from collections.abc import Collection
from typing import Any

from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import ClaimOutcome, ClaimResult, Disposition, Record, State
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import (
    Phase,
    SagaRecord,
    SagaSnapshot,
    StartOutcome,
    StartResult,
)
from sagaguard.saga.testing.points import Tripwire


def describe_phase(phase: Phase) -> str:
    """A phase in words: ``charge_card succeeded, reserve_seat started, saga compensating``."""
    parts = [f"{row.name} {row.state.value}" for row in phase.steps]
    if phase.state is not None:
        parts.append(f"saga {phase.state.value}")
    return ", ".join(parts) or "lease renewal"


class CrashingJournal:
    """Wraps any :class:`~sagaguard.saga.journal.SagaJournal` and dies at a journal kill point.

    ``start``, ``claim`` and ``commit`` are counted (the calls that write), except the commits that
    only renew the lease, which come from the runner's renewer thread whenever a step runs long;
    every other method is passed through untouched.

    Args:
        inner: the journal to wrap.
        tripwire: counts the calls and holds the point.
    """

    def __init__(self, inner: SagaJournal, tripwire: Tripwire) -> None:
        self.inner = inner
        self.tripwire = tripwire

    def start(self, saga_id: str, **options: Any) -> StartResult:
        nth = self.tripwire.before("journal", "start", saga_id)
        result = self.inner.start(saga_id, **options)
        won = result.outcome is not StartOutcome.EXISTING
        self.tripwire.after("journal", "start", nth, result.outcome.value, won=won)
        return result

    def claim(self, saga_id: str, **options: Any) -> SagaSnapshot | None:
        nth = self.tripwire.before("journal", "claim", saga_id)
        result = self.inner.claim(saga_id, **options)
        won = result is not None
        self.tripwire.after("journal", "claim", nth, "took over" if won else "not due", won=won)
        return result

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        if not phase.steps and phase.state is None:
            # A lease renewal (the runner's renewer thread, timing-dependent): never a point.
            return self.inner.commit(saga_id, token, phase)
        nth = self.tripwire.before("journal", "commit")
        record = self.inner.commit(saga_id, token, phase)
        self.tripwire.after("journal", "commit", nth, describe_phase(phase))
        return record

    def __getattr__(self, name: str) -> Any:
        # Everything that writes nothing a point could name (load, list, now, signal, close, ...).
        return getattr(self.inner, name)


class CrashingSagaStore:
    """Wraps any :class:`~sagaguard.idempotency.store.IdempotencyStore` and dies at a store kill point.

    Unlike :class:`sagaguard.idempotency.testing.CrashingStore` (first call at a named point) it counts calls,
    so ``store.complete#3:before`` is "the third guarded effect ran; its record is not written".

    Args:
        inner: the store to wrap.
        tripwire: counts the calls and holds the point.
    """

    def __init__(self, inner: IdempotencyStore, tripwire: Tripwire) -> None:
        self.inner = inner
        self.tripwire = tripwire
        self._names: dict[str, str] = {}

    def now(self) -> float:
        return self.inner.now()

    def ledger_id(self) -> str:
        # Forwarded: the wrapped ledger's provider keys must be the ones its guard derives unwrapped.
        return self.inner.ledger_id()

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        detail = f"{identity.scope}|{identity.name}"
        self._names[identity.key] = detail
        nth = self.tripwire.before("store", "claim", identity.key)
        result = self.inner.claim(identity, fingerprint, lease)
        won = result.outcome is not ClaimOutcome.EXISTING
        self.tripwire.after("store", "claim", nth, detail, won=won)
        return result

    def get(self, key: str) -> Record | None:
        return self.inner.get(key)

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        detail = self._names.get(key, "")
        nth = self.tripwire.before("store", "complete")
        record = self.inner.complete(key, token, result, retention)
        self.tripwire.after("store", "complete", nth, detail)
        return record

    def fail(
        self, key: str, token: int, disposition: Disposition, error: str, retention: float
    ) -> Record | None:
        detail = self._names.get(key, "")
        nth = self.tripwire.before("store", "fail")
        record = self.inner.fail(key, token, disposition, error, retention)
        self.tripwire.after("store", "fail", nth, detail)
        return record

    def heartbeat(self, key: str, token: int, lease: float) -> float:
        return self.inner.heartbeat(key, token, lease)

    def take_over(self, key: str, token: int, lease: float) -> Record | None:
        return self.inner.take_over(key, token, lease)

    def purge(self, *, limit: int = 1000) -> int:
        return self.inner.purge(limit=limit)

    def close(self) -> None:
        self.inner.close()

    def list(
        self,
        *,
        states: Collection[State] | None = None,
        namespace: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> builtins.list[Record]:
        return self.inner.list(states=states, namespace=namespace, limit=limit, after=after)
