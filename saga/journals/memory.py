"""An in-process journal: a real backend for one process (tests, notebooks, scripts).

It keeps every promise of the contract within its process and none across a crash of it; use
:class:`~sagaguard.saga.journals.sql.SqlJournal` (SQLite) for that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

from sagaguard.saga import lease as _lease
from sagaguard.saga.checks import check_saga_id
from sagaguard.saga.decisions import cancel_outcome
from sagaguard.saga.errors import LostSagaLease, SagaNotFound
from sagaguard.saga.records import (
    LIVE_STATES,
    RESUMABLE_STATES,
    CancelOutcome,
    Phase,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    SignalOutcome,
    StartOutcome,
    StartResult,
    StepRecord,
)

__all__ = ["MemoryJournal"]


class MemoryJournal:
    """Dicts under a lock. A :class:`~sagaguard.saga.journal.SagaJournal`.

    Args:
        clock: seconds since the epoch; inject one to test lease expiry without sleeping.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.time
        self._sagas: dict[str, SagaRecord] = {}
        self._steps: dict[str, dict[int, StepRecord]] = {}
        self._signals: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def now(self) -> float:
        """See :meth:`SagaJournal.now`."""
        return self._clock()

    def _snapshot(self, saga_id: str) -> SagaSnapshot:
        steps = self._steps.get(saga_id, {})
        return SagaSnapshot(
            self._sagas[saga_id],
            tuple(steps[i] for i in sorted(steps)),
            dict(self._signals.get(saga_id, {})),
        )

    def _take_over(self, old: SagaRecord, now: float, lease: float, holder: str | None) -> SagaRecord:
        waking = old.state is SagaState.WAITING
        taken = old.evolve(
            token=old.token + 1,
            lease_until=now + lease,
            updated_at=now,
            state=SagaState.RUNNING if waking else old.state,
            recoveries=old.recoveries + (0 if waking else 1),
            holder=_lease.current(holder),
        )
        self._sagas[old.saga_id] = taken
        return taken

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
        """See :meth:`SagaJournal.start`."""
        check_saga_id(saga_id)
        result = self._start(saga_id, name, version, input, fingerprint, lease, timeout, first, holder)
        return _lease.after_start(
            self, result, name=name, version=version, fingerprint=fingerprint, lease=lease, holder=holder
        )

    def _start(  # noqa: PLR0917 - start's own arguments, passed on
        self, saga_id: str, name: str, version: int, input: str, fingerprint: str, lease: float,
        timeout: float, first: StepRecord | None, holder: str | None,
    ) -> StartResult:  # fmt: skip
        now = self._clock()
        with self._lock:
            old = self._sagas.get(saga_id)
            if old is None:
                self._sagas[saga_id] = SagaRecord(
                    saga_id,
                    name,
                    version,
                    fingerprint,
                    input,
                    SagaState.RUNNING,
                    1,
                    now + lease,
                    now,
                    now,
                    deadline=now + timeout if timeout > 0 else 0.0,
                    holder=_lease.current(holder),
                )
                rows = {} if first is None else {first.index: first.evolve(started_at=now, updated_at=now)}
                self._steps[saga_id] = rows
                return StartResult(StartOutcome.CREATED, self._snapshot(saga_id))
            if (
                old.state in RESUMABLE_STATES
                and old.lease_until <= now
                and (old.name, old.version, old.fingerprint) == (name, version, fingerprint)
            ):
                self._take_over(old, now, lease, holder)
                return StartResult(StartOutcome.TOOK_OVER, self._snapshot(saga_id))
            return StartResult(StartOutcome.EXISTING, self._snapshot(saga_id))

    def claim(self, saga_id: str, *, lease: float, holder: str | None = None) -> SagaSnapshot | None:
        """See :meth:`SagaJournal.claim`."""
        check_saga_id(saga_id)
        now = self._clock()
        with self._lock:
            old = self._sagas.get(saga_id)
            if old is not None and old.state in RESUMABLE_STATES and old.lease_until <= now:
                self._take_over(old, now, lease, holder)
                return self._snapshot(saga_id)
        return _lease.after_claim(self, saga_id, lease=lease, holder=holder)

    def take_over(
        self, saga_id: str, token: int, *, lease: float, holder: str | None = None
    ) -> SagaSnapshot | None:
        """See :meth:`SagaJournal.take_over`."""
        check_saga_id(saga_id)
        now = self._clock()
        with self._lock:
            old = self._sagas.get(saga_id)
            if old is None or old.token != token or old.state not in LIVE_STATES:
                return None
            self._take_over(old, now, lease, holder)
            return self._snapshot(saga_id)

    def due(self, *, limit: int = 100) -> list[SagaRecord]:
        """See :meth:`SagaJournal.due`."""
        now = self._clock()
        with self._lock:
            rows = [r for r in self._sagas.values() if r.state in RESUMABLE_STATES and r.lease_until <= now]
            live = [r for r in self._sagas.values() if r.state in LIVE_STATES and r.lease_until > now]
        rows.sort(key=lambda r: (r.lease_until, r.saga_id))
        dead = sorted(_lease.dead_held(live), key=lambda r: (r.lease_until, r.saga_id))
        return (rows + dead)[: max(0, limit)]

    def load(self, saga_id: str) -> SagaSnapshot | None:
        """See :meth:`SagaJournal.load`."""
        check_saga_id(saga_id)
        with self._lock:
            return self._snapshot(saga_id) if saga_id in self._sagas else None

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        """See :meth:`SagaJournal.commit`."""
        check_saga_id(saga_id)
        now = self._clock()
        with self._lock:
            old = self._sagas.get(saga_id)
            if old is None:
                raise LostSagaLease(saga_id, token, "saga is unknown")
            if old.token != token:
                raise LostSagaLease(saga_id, token, f"token is now {old.token}")
            if old.state not in LIVE_STATES:
                raise LostSagaLease(saga_id, token, f"saga is already {old.state}")
            changes: dict[str, object] = {
                "lease_until": _lease.renewed(old.lease_until, now, phase.lease),
                "updated_at": now,
            }
            if phase.unless_cancelled and not old.cancel_requested:
                changes["lease_until"] = 0.0  # it completes: a cancellation pending keeps it RUNNING
            if phase.state is not None and not (phase.unless_cancelled and old.cancel_requested):
                changes["state"] = phase.state
                changes["error"] = phase.error
            if phase.state is SagaState.WAITING:
                signalled = phase.waiting_for in self._signals.get(saga_id, {})
                changes["waiting_for"] = phase.waiting_for
                changes["wait_until"] = phase.wait_until
                cancelled = old.cancel_requested and phase.wake_on_cancel
                changes["lease_until"] = now if signalled or cancelled else phase.wake_at
            new = old.evolve(**changes)
            steps = self._steps.setdefault(saga_id, {})
            for row in phase.steps:
                previous = steps.get(row.index)
                started = previous.started_at if previous is not None else now
                steps[row.index] = row.evolve(started_at=started, updated_at=now)
            self._sagas[saga_id] = new
            return new

    def reopen(
        self, saga_id: str, token: int, state: SagaState, steps: Sequence[StepRecord], error: str | None
    ) -> SagaRecord | None:
        """See :meth:`SagaJournal.reopen`."""
        check_saga_id(saga_id)
        now = self._clock()
        with self._lock:
            old = self._sagas.get(saga_id)
            if old is None or old.token != token or old.state is not SagaState.NEEDS_ATTENTION:
                return None
            new = old.evolve(
                state=SagaState(state), error=error, token=token + 1, lease_until=now, updated_at=now,
                recoveries=0,
            )  # fmt: skip
            rows = self._steps.setdefault(saga_id, {})
            for row in steps:
                previous = rows.get(row.index)
                started = previous.started_at if previous is not None else now
                rows[row.index] = row.evolve(started_at=started, updated_at=now)
            self._sagas[saga_id] = new
            return new

    def signal(self, saga_id: str, name: str, payload: str) -> SignalOutcome:
        """See :meth:`SagaJournal.signal`."""
        check_saga_id(saga_id)
        now = self._clock()
        with self._lock:
            old = self._sagas.get(saga_id)
            if old is None:
                raise SagaNotFound(saga_id)
            if old.state not in RESUMABLE_STATES:
                return SignalOutcome.TOO_LATE
            signals = self._signals.setdefault(saga_id, {})
            if name in signals:
                return SignalOutcome.DUPLICATE
            signals[name] = payload
            if old.state is SagaState.WAITING and old.waiting_for == name:
                self._sagas[saga_id] = old.evolve(lease_until=now, updated_at=now)
            return SignalOutcome.DELIVERED

    def cancel(self, saga_id: str, cause: str) -> CancelOutcome:
        """See :meth:`SagaJournal.cancel`."""
        check_saga_id(saga_id)
        now = self._clock()
        with self._lock:
            old = self._sagas.get(saga_id)
            if old is None:
                raise SagaNotFound(saga_id)
            outcome = cancel_outcome(self._snapshot(saga_id))
            if outcome is not CancelOutcome.REQUESTED:
                return outcome
            changes: dict[str, object] = {"cancel_requested": True, "error": cause, "updated_at": now}
            if old.state is SagaState.WAITING:
                changes["lease_until"] = now
            self._sagas[saga_id] = old.evolve(**changes)
            return CancelOutcome.REQUESTED

    def list(
        self,
        *,
        states: Collection[SagaState] | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[SagaRecord]:
        """See :meth:`SagaJournal.list`."""
        with self._lock:
            rows = sorted(self._sagas.values(), key=lambda r: r.saga_id)
        if states is not None:
            wanted = {SagaState(s) for s in states}
            rows = [r for r in rows if r.state in wanted]
        if after is not None:
            rows = [r for r in rows if r.saga_id > after]
        return rows[: max(0, limit)]

    def close(self) -> None:
        """Nothing to release."""
