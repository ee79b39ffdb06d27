"""Lease renewal for running sagas: one background thread per runner, shared by every saga it runs.

A runner *holds* a saga's lease while one of its steps, compensations or retry pauses runs (a dict
insert, so short steps pay nothing measurable); a hold still running after a third of the lease is
renewed by the thread with a heartbeat commit (a phase with no steps and no state) until it ends.
Each commit of the saga renews the lease too, so only long calls need the thread.

A hold may carry a deadline (journal time): renewal stops once the journal's clock passes it, so a
step that hangs past its timeout lets its lease run out and the recovery sweeper takes the saga over
and fails the step. A renewal refused with :class:`~saga.errors.LostSagaLease` is remembered: the
runner's next commit is refused too, which is what tells it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from saga.errors import JournalError, LostSagaLease
from saga.journal import SagaJournal
from saga.records import Phase

__all__ = ["LeaseRenewer"]

log = logging.getLogger("sagaguard.saga.renewer")


@dataclass(slots=True)
class _Hold:
    saga_id: str
    token: int
    until: float | None
    due: float
    lost: bool = False
    stopped: bool = False


class LeaseRenewer:
    """Renews the leases of sagas whose steps run longer than a third of the lease.

    Args:
        journal: where the leases live.
        lease: seconds each renewal extends a lease by (the runner's lease).
        monotonic: clock that schedules renewals (lease deadlines are the journal's own clock).
        thread: start the background thread on the first hold; False leaves renewals to
            :meth:`beat_due` (tests drive it by hand).
    """

    def __init__(
        self,
        journal: SagaJournal,
        lease: float,
        *,
        monotonic: Callable[[], float] | None = None,
        thread: bool = True,
    ) -> None:
        self._journal = journal
        self.lease = lease
        self._monotonic = monotonic or time.monotonic
        self._holds: dict[int, _Hold] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        """Guards the holds; the thread waits on it. Holds take :attr:`_lock` itself, whose
        ``with`` costs less than the condition's."""
        self._use_thread = thread
        self._thread: threading.Thread | None = None
        self._closed = False
        self._wakes_at = 0.0
        """When the thread's current wait ends (monotonic); 0 while it is not waiting."""

    @contextlib.contextmanager
    def hold(self, saga_id: str, token: int, *, until: float | None = None) -> Iterator[None]:
        """Keep renewing the saga's lease while the block runs (and, with ``until``, no longer than
        the journal's clock reaches it)."""
        handle = self.enter(saga_id, token, until=until)
        try:
            yield
        finally:
            self.leave(handle)

    def enter(self, saga_id: str, token: int, *, until: float | None = None) -> int:
        """Start holding the saga's lease, as :meth:`hold` does; returns the handle :meth:`leave`
        takes. For a driver that holds around every step: a ``try``/``finally`` costs it less than
        a context manager."""
        handle = next(self._ids)
        entry = _Hold(saga_id, token, until, self._monotonic() + self.lease / 3)
        with self._lock:
            self._holds[handle] = entry
            if self._use_thread and self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._loop, name="sagaguard-saga-lease", daemon=True)
                self._thread.start()
            elif entry.due < self._wakes_at:
                # Wake the thread only when it would sleep past this hold's first renewal: with
                # the usual leases it wakes (at most a second from now) long before, and a
                # wake-up per step would cost every step a thread switch.
                self._cond.notify()
        return handle

    def leave(self, handle: int) -> None:
        """Stop the hold :meth:`enter` returned ``handle`` for."""
        with self._lock:
            self._holds.pop(handle, None)

    @property
    def holding(self) -> int:
        """How many holds are open."""
        with self._cond:
            return len(self._holds)

    def beat_due(self, *, force: bool = False) -> int:
        """Renew every hold that is due (every hold with ``force``); returns how many were renewed."""
        now = self._monotonic()
        with self._cond:
            due = [h for h in self._holds.values() if (force or h.due <= now) and not (h.lost or h.stopped)]
        renewed = 0
        for entry in due:
            try:
                if entry.until is not None and self._journal.now() >= entry.until:
                    entry.stopped = True  # past its deadline: let the lease run out
                    continue
                self._journal.commit(entry.saga_id, entry.token, Phase(lease=self.lease))
                renewed += 1
            except LostSagaLease:
                entry.lost = True
            except JournalError as exc:
                # Unreachable for now: try again soon, two thirds of the lease are still left.
                log.warning("saga lease renewal failed, will retry: %s", exc)
            entry.due = self._monotonic() + self.lease / 3
        return renewed

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = self._monotonic()
                soonest = min((h.due for h in self._holds.values()), default=None)
                timeout = min(1.0, 1.0 if soonest is None else max(0.0, soonest - now))
                self._wakes_at = now + timeout
                self._cond.wait(timeout=timeout)
                self._wakes_at = 0.0  # awake: a hold made now is seen before the next wait
                if self._closed:
                    return
            self.beat_due()

    def close(self) -> None:
        """Stop the thread (holds still open are no longer renewed)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
