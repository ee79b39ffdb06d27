"""Lease renewal for running sagas: one :class:`~sagaguard.idempotency.renewal.Renewer` per runner, shared
by every saga it runs.

A runner *holds* a saga's lease while one of its steps, compensations or retry pauses runs; a hold
still running after a third of the lease is renewed by the renewer's thread with a heartbeat
commit (a phase with no steps and no state) until it ends. Each commit of the saga renews the
lease too, so only long calls need the thread.

A hold may carry a deadline (journal time): renewal stops once the journal's clock passes it, so a
step that hangs past its timeout lets its lease run out and the recovery sweeper takes the saga over
and fails the step. A renewal refused with :class:`~sagaguard.saga.errors.LostSagaLease` ends that hold's
renewals: the runner's next commit is refused too, which is what tells it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from sagaguard.idempotency.checks import seconds
from sagaguard.idempotency.renewal import Renewer
from sagaguard.saga.errors import LostSagaLease
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import Phase

__all__ = ["LeaseRenewer"]


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
        self.lease = seconds("lease", lease)
        self._renewer = Renewer("sagaguard-saga-lease", monotonic=monotonic, thread=thread)

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
        takes."""
        return self._renewer.hold(lambda: self._renew(saga_id, token, until), self.lease / 3)

    def _renew(self, saga_id: str, token: int, until: float | None) -> bool:
        if until is not None and self._journal.now() >= until:
            return False  # past its deadline: let the lease run out
        try:
            self._journal.commit(saga_id, token, Phase(lease=self.lease))
        except LostSagaLease:
            return False
        return True

    def leave(self, handle: int) -> None:
        """Stop the hold :meth:`enter` returned ``handle`` for."""
        self._renewer.release(handle)

    @property
    def holding(self) -> int:
        """How many holds are open."""
        return self._renewer.holding

    def beat_due(self, *, force: bool = False) -> int:
        """Renew every hold that is due (every hold with ``force``); returns how many were renewed."""
        return self._renewer.renew_due(force=force)

    def close(self) -> None:
        """Stop the thread (holds still open are no longer renewed)."""
        self._renewer.close()
