"""Lease renewal for long effects: one background thread per guard, shared by every running call.

Registering a call is a dict insert, so short calls (the common case) pay nothing measurable; a call
still running after a third of its lease is renewed by the thread until it ends. A renewal refused
with :class:`~idempotency.errors.LostOwnership` is remembered: the call's own ``complete`` will be
refused too, which is what tells the caller.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from idempotency.errors import IdempotencyError, LostOwnership
from idempotency.store import IdempotencyStore

__all__ = ["Heartbeater"]

log = logging.getLogger("sagaguard.heartbeat")


@dataclass(slots=True)
class _Entry:
    key: str
    token: int
    lease: float
    due: float
    lost: bool = False


class Heartbeater:
    """Renews the leases of calls that run longer than a third of their lease.

    Args:
        store: where leases live.
        monotonic: clock for scheduling renewals (not for lease deadlines, which are the store's).
    """

    def __init__(self, store: IdempotencyStore, monotonic: Callable[[], float] | None = None) -> None:
        self._store = store
        self._monotonic = monotonic or time.monotonic
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def register(self, key: str, token: int, lease: float) -> int:
        """Start watching a call; returns a handle for :meth:`unregister`."""
        handle = next(self._ids)
        due = lease / 3
        # A dict insert is atomic, and the thread reads the entries as a copy taken in one step,
        # so the common call (thread running, lease of 3 s or more) takes no lock.
        self._entries[handle] = _Entry(key, token, lease, self._monotonic() + due)
        if self._thread is None or due < 1.0:
            with self._cond:
                if self._thread is None and not self._closed:
                    self._thread = threading.Thread(
                        target=self._loop, name="sagaguard-heartbeat", daemon=True
                    )
                    self._thread.start()
                elif due < 1.0:
                    # The thread sleeps up to a second; wake it so a short lease is renewed in time.
                    self._cond.notify()
        return handle

    def unregister(self, handle: int) -> None:
        """Stop watching a call (it finished)."""
        self._entries.pop(handle, None)  # atomic, like the insert

    def beat(self, key: str, token: int, lease: float) -> float:
        """Renew one lease now; returns the new deadline.

        Raises:
            LostOwnership: another worker took the record over.
        """
        return self._store.heartbeat(key, token, lease)

    def beat_due(self) -> int:
        """Renew every lease that is due now; returns how many were renewed. Used by the thread."""
        now = self._monotonic()
        due = [e for e in list(self._entries.values()) if e.due <= now and not e.lost]
        renewed = 0
        for entry in due:
            try:
                self._store.heartbeat(entry.key, entry.token, entry.lease)
                renewed += 1
            except LostOwnership:
                entry.lost = True
            except IdempotencyError as exc:
                # The store is unreachable for now: try again soon, the lease still has 2/3 left.
                log.warning("heartbeat failed, will retry: %s", exc)
            entry.due = self._monotonic() + entry.lease / 3
        return renewed

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                soonest = min((e.due for e in list(self._entries.values())), default=None)
                timeout = 1.0 if soonest is None else max(0.0, soonest - self._monotonic())
                self._cond.wait(timeout=min(timeout, 1.0))
                if self._closed:
                    return
            self.beat_due()

    def close(self) -> None:
        """Stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
