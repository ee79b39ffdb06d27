"""Renewing a relay's claims while its handlers run: one background thread per relay, every path.

A relay claims a batch under a lease. A handler slower than the lease would otherwise lose its
message to another relay, which delivers it again (and again, until it is dead-lettered, although
every delivery succeeded). :class:`ClaimRenewer` calls the relay's renew function every
``interval`` seconds for as long as a batch is in hand, whichever thread runs the handlers (the
relay's own thread for one aggregate, a pool for several), so a long handler keeps its claim.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

__all__ = ["ClaimRenewer"]

log = logging.getLogger("sagaguard.outbox")


class ClaimRenewer:
    """Calls a batch's renew function from a daemon thread while the batch is delivered.

    The thread starts on first use and serves one batch at a time (a relay delivers one batch at a
    time). A renew function that raises is logged and called again at the next interval: a claim
    that cannot be renewed is found lost when the batch is settled.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._job: tuple[Callable[[], None], float] | None = None
        self._generation = 0
        self._running = threading.Lock()  # held while renew runs: leaving waits for it
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextlib.contextmanager
    def renewing(self, renew: Callable[[], None], interval: float) -> Iterator[None]:
        """Within the block, ``renew()`` is called every ``interval`` seconds (first after one
        interval); leaving the block stops it and waits for a call in progress to return."""
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._job = (renew, interval)
            self._generation += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._job = None
                self._generation += 1
                self._cond.notify_all()
            with self._running:
                pass  # a renewal that started before we left has returned

    def close(self) -> None:
        """Stop the thread (a relay's close)."""
        with self._cond:
            self._closed = True
            self._job = None
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                assert self._job is not None
                renew, interval = self._job
                generation = self._generation
                # Wait one interval, unless the batch ends (or another starts) first.
                self._cond.wait_for(self._changed(generation), timeout=interval)
                if self._generation != generation or self._closed:
                    continue
                self._running.acquire()
            try:
                renew()
            except Exception as exc:  # a thread must not die of one failed renewal
                log.warning("%s: renewing the claims failed: %s", self._name, exc)
            finally:
                self._running.release()

    def _changed(self, generation: int) -> Callable[[], bool]:
        return lambda: self._generation != generation or self._closed
