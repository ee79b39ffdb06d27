"""Connections that threads keep checked out of a pool between their calls: one per thread, a few in all.

A store call of one round trip spends about as much client CPU checking a connection out of its
driver's pool and back (and, on Postgres, resetting it) as on the round trip itself. With 4 worker
processes, the libraries' public paths, a connection from the pool per call, ran 0.82x the agent
sagas per second on Postgres and 0.73x on one Redis server (medians of alternated rounds: more than
the 10% that would have retired this module; docs/benchmarks.md, "The fast paths, decided at 4
processes"). So a backend with a pool of its own lets each thread keep the connection its call used,
for that thread's next calls, while fewer than ``limit()`` are kept: the pool keeps the rest for the
other threads, which check one out per call, and is never emptied by idle keepers.

A kept connection is used by its own thread only, one call at a time (a call made inside a call of
the same thread checks one out of the pool). It goes back to the pool (``release(conn, broken)``)
when its owner closes (:meth:`KeptConnections.close`), when its thread has ended (the next thread
to keep one notices), or when a call on it failed in a way that may have broken it
(:meth:`KeptConnections.discard`). After the server went away, :meth:`KeptConnections.expire`
throws every kept connection away before its next use, so a restart costs one call, not one per
kept connection. In a forked child the parent's kept connections are forgotten, neither used nor
closed (closing one would end the parent's session on the shared socket).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Kept", "KeptConnections"]

C = TypeVar("C")

_all: weakref.WeakSet[KeptConnections[object]] = weakref.WeakSet()
_all_lock = threading.Lock()


class Kept(Generic[C]):
    """One connection a thread keeps (``conn``: whatever the backend keeps for it)."""

    __slots__ = ("busy", "conn", "generation", "gone", "pid", "thread")

    def __init__(self, conn: C, generation: int) -> None:
        self.conn = conn
        self.generation = generation
        self.pid = os.getpid()
        self.thread = weakref.ref(threading.current_thread())
        self.busy = False
        self.gone = False
        """No longer kept (given back by another thread, or expired)."""


class KeptConnections(Generic[C]):
    """The connections kept by the threads of one backend (see the module).

    Args:
        limit: how many may be kept at once (asked whenever one more would be kept).
        release: gives a connection back to the pool; ``broken`` when it may be unusable (thrown
            away, not reused).

    Thread-safe.
    """

    def __init__(self, limit: Callable[[], int], release: Callable[[C, bool], None]) -> None:
        self._limit = limit
        self._release = release
        self._local = threading.local()
        self._kept: list[Kept[C]] = []
        self._lock = threading.Lock()
        self._generation = 0
        """Bumped by :meth:`expire`: a connection kept before is not used again."""
        with _all_lock:
            _all.add(self)  # type: ignore[arg-type]  # any connection type, for the fork hook

    def take(self) -> Kept[C] | None:
        """This thread's kept connection, marked busy until :meth:`done` or :meth:`discard`; None
        when the thread keeps none fit to use (none, in use by a call that made this one, given
        back meanwhile, a forked child's copy of its parent's, or kept before :meth:`expire`)."""
        kept: Kept[C] | None = getattr(self._local, "kept", None)
        if kept is None or kept.busy:
            return None
        with self._lock:  # against a sweep by another thread (expire, close)
            usable = not kept.gone and kept.pid == os.getpid() and kept.generation == self._generation
            stale = not kept.gone and kept.generation != self._generation
            kept.busy = usable
        if not usable:
            self._local.kept = None
            if stale and kept.pid == os.getpid():
                self._drop(kept, broken=True)
            return None
        return kept

    def done(self, kept: Kept[C]) -> None:
        """The call on ``kept`` is over; the thread keeps it."""
        kept.busy = False

    def discard(self, kept: Kept[C]) -> None:
        """Stop keeping ``kept``; it goes back to the pool as broken."""
        kept.busy = False
        self._local.kept = None
        self._drop(kept, broken=True)

    def keep(self, conn: C) -> bool:
        """Keep ``conn`` (one checked out for a call of this thread, which went well) for the
        thread's next calls, if the thread keeps none and fewer than ``limit()`` are kept; whether
        it was kept (if not, the caller gives it back)."""
        if getattr(self._local, "kept", None) is not None:
            return False
        ended: list[Kept[C]] = []
        with self._lock:
            for kept in list(self._kept):  # those of threads that have ended go back first
                thread = kept.thread()
                if thread is None or not thread.is_alive():
                    self._kept.remove(kept)
                    kept.gone = True
                    ended.append(kept)
            room = len(self._kept) < self._limit()
            if room:
                entry = Kept(conn, self._generation)
                self._kept.append(entry)
        for kept in ended:
            self._release(kept.conn, False)
        if room:
            self._local.kept = entry
        return room

    def expire(self) -> None:
        """The server went away: throw away every kept connection no call is using now; one in use
        is thrown away when its thread next takes it."""
        with self._lock:
            self._generation += 1
            idle = [kept for kept in self._kept if not kept.busy]
            for kept in idle:
                kept.gone = True
                self._kept.remove(kept)
        for kept in idle:
            self._release(kept.conn, True)

    def close(self) -> None:
        """Give back every kept connection (call when no call runs). Connections may be kept again
        afterwards."""
        with self._lock:
            kept, self._kept = self._kept, []
            for entry in kept:
                entry.gone = True  # a thread's own reference to it is not used again
        for entry in kept:
            if entry.pid == os.getpid():
                self._release(entry.conn, False)

    def _drop(self, kept: Kept[C], *, broken: bool) -> None:
        with self._lock:
            if kept.gone:
                return
            kept.gone = True
            if kept in self._kept:
                self._kept.remove(kept)
        self._release(kept.conn, broken)

    def _forget(self) -> None:
        """In a forked child: drop the parent's kept connections without touching them."""
        self._kept = []
        self._lock = threading.Lock()
        self._local = threading.local()


def _after_fork_in_child() -> None:
    global _all_lock  # noqa: PLW0603  # a lock held at the fork by another thread stays held in the child
    _all_lock = threading.Lock()
    for kept in list(_all):
        kept._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
