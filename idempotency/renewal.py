"""Lease renewal while long calls run: one background thread per renewer, a callback per hold.

Whatever holds a lease (a guarded call's claim, a running saga, a relay's batch of outbox claims)
*holds* it here for as long as its call runs: :meth:`Renewer.hold` takes a function that renews
the lease and the interval to call it at, and :meth:`Renewer.release` ends the hold. A hold is a
dict insert under a lock, so a short call pays next to nothing; one still running after an
interval is renewed by the thread, every interval, until it is released.

The renew function answers whether to go on: False ends the renewals of its hold (the lease was
lost to another worker, or a deadline has passed), and the hold stays until released. An exception
is logged and the renewal tried again after an interval: a lease cannot be renewed while its store
is unreachable, and a call that outlives it finds it lost when it writes.

The guard's heartbeat (:mod:`sagaguard.idempotency.heartbeat`), the saga runner's lease renewer
(:mod:`sagaguard.saga.renewer`) and the outbox relay's claim renewer
(:mod:`sagaguard.idempotency.outbox.renewal`) are each a thin adapter over one :class:`Renewer`.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Renewer"]

log = logging.getLogger("sagaguard.renewal")


@dataclass(slots=True)
class _Hold:
    renew: Callable[[], bool]
    every: float
    due: float
    active: bool = True


class Renewer:
    """Calls each hold's renew function every interval while it is held, from a daemon thread.

    Args:
        name: the thread's name, and the prefix of what it logs.
        monotonic: the clock that schedules renewals (lease deadlines are the store's own clock).
        thread: start the thread on the first hold; False leaves renewals to :meth:`renew_due`
            (tests drive it by hand).
    """

    def __init__(
        self, name: str, *, monotonic: Callable[[], float] | None = None, thread: bool = True
    ) -> None:
        self.name = name
        self._monotonic = monotonic or time.monotonic
        self._holds: dict[int, _Hold] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._renewing: int | None = None
        """The hold whose renew function runs now (:meth:`release` with ``wait`` waits for it)."""
        self._use_thread = thread
        self._thread: threading.Thread | None = None
        self._closed = False
        self._wakes_at = 0.0
        """When the thread's current wait ends (monotonic); 0 while it is not waiting."""
        self._woken_for = 0.0
        """The first renewal of the last hold that woke the thread (monotonic): the thread waits
        until then even if that hold is released first."""

    def hold(self, renew: Callable[[], bool], every: float) -> int:
        """Call ``renew()`` every ``every`` seconds, the first time one interval from now, until
        :meth:`release` or until it answers False; returns the handle :meth:`release` takes."""
        handle = next(self._ids)
        entry = _Hold(renew, every, self._monotonic() + every)
        with self._cond:
            self._holds[handle] = entry
            if self._use_thread and self._thread is None and not self._closed:
                self._woken_for = entry.due
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            elif entry.due < self._wakes_at:
                # Wake the thread only when it would sleep past this hold's first renewal: a
                # wake-up per hold would cost every short call a thread switch. The thread then
                # waits until that time even when the hold is gone by then, so the holds of the
                # calls that follow (due no sooner) do not wake it again.
                self._woken_for = entry.due
                self._cond.notify_all()
        return handle

    def release(self, handle: int, *, wait: bool = False) -> None:
        """End the hold :meth:`hold` returned ``handle`` for; with ``wait``, also wait for a renewal
        of it in progress to return."""
        with self._cond:
            self._holds.pop(handle, None)
            while wait and self._renewing == handle:
                self._cond.wait()

    @property
    def holding(self) -> int:
        """How many holds are open."""
        with self._cond:
            return len(self._holds)

    def renew_due(self, *, force: bool = False) -> int:
        """Renew every hold that is due (every open hold with ``force``); returns how many renew
        functions answered True."""
        now = self._monotonic()
        with self._cond:
            due = [(h, e) for h, e in self._holds.items() if e.active and (force or e.due <= now)]
        renewed = 0
        for handle, entry in due:
            with self._cond:
                if handle not in self._holds:
                    continue  # released meanwhile
                self._renewing = handle
            try:
                entry.active = entry.renew()
                renewed += entry.active
            except Exception as exc:  # the thread must not die of one failed renewal
                log.warning("%s: renewal failed, will retry: %s", self.name, exc)
            finally:
                with self._cond:
                    self._renewing = None
                    self._cond.notify_all()
            entry.due = self._monotonic() + entry.every
        return renewed

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = self._monotonic()
                soonest = min((e.due for e in self._holds.values() if e.active), default=math.inf)
                if soonest == math.inf and self._woken_for > now:
                    soonest = self._woken_for  # see hold(): one wake-up per interval, not per hold
                timeout = None if soonest == math.inf else max(0.0, soonest - now)
                self._wakes_at = soonest if timeout is None else now + timeout
                self._cond.wait(timeout)
                self._wakes_at = 0.0  # awake: a hold made now is seen before the next wait
                if self._closed:
                    return
            self.renew_due()

    def close(self) -> None:
        """Stop the thread (holds still open are no longer renewed)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
