"""Lease renewal for long effects: the guard's heartbeat, one :class:`~sagaguard.idempotency.renewal.Renewer`
per guard, shared by every running call.

A call is held while its body (or a reconciler) runs and renewed every third of its lease, so a
long call keeps its claim through two missed renewals. A renewal refused with
:class:`~sagaguard.idempotency.errors.LostOwnership` ends that call's renewals: the call's own ``complete``
will be refused too, which is what tells the caller.
"""

from __future__ import annotations

from collections.abc import Callable

from sagaguard.idempotency.errors import LostOwnership
from sagaguard.idempotency.renewal import Renewer
from sagaguard.idempotency.store import IdempotencyStore

__all__ = ["Heartbeater"]


class Heartbeater:
    """Renews the leases of calls that run longer than a third of their lease.

    Args:
        store: where leases live.
        monotonic: clock for scheduling renewals (not for lease deadlines, which are the store's).
    """

    def __init__(self, store: IdempotencyStore, monotonic: Callable[[], float] | None = None) -> None:
        self._store = store
        self._renewer = Renewer("sagaguard-heartbeat", monotonic=monotonic)

    def register(self, key: str, token: int, lease: float) -> int:
        """Start watching a call; returns a handle for :meth:`unregister`."""
        return self._renewer.hold(lambda: self._renew(key, token, lease), lease / 3)

    def _renew(self, key: str, token: int, lease: float) -> bool:
        try:
            self._store.heartbeat(key, token, lease)
        except LostOwnership:
            return False  # another worker took the record over: renewing it is over
        return True

    def unregister(self, handle: int) -> None:
        """Stop watching a call (it finished)."""
        self._renewer.release(handle)

    def beat(self, key: str, token: int, lease: float) -> float:
        """Renew one lease now; returns the new deadline.

        Raises:
            LostOwnership: another worker took the record over.
        """
        return self._store.heartbeat(key, token, lease)

    def beat_due(self) -> int:
        """Renew every lease that is due now; returns how many were renewed. Used by the thread."""
        return self._renewer.renew_due()

    def close(self) -> None:
        """Stop the thread."""
        self._renewer.close()
