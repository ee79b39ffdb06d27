"""Connections threads keep between calls (``sagaguard.idempotency.backends.kept``): one per thread, at most
``limit`` in all, given back when their thread ends, on ``close`` and when broken, thrown away after the
server went away, forgotten in a forked child. The SQL and Redis backends' own tests run it
against real servers; these pin its rules with plain objects."""

from __future__ import annotations

import os
import threading

import pytest

from sagaguard.idempotency.backends.kept import KeptConnections


class Pool:
    """Connections handed out and given back, counted."""

    def __init__(self) -> None:
        self.made = 0
        self.back: list[tuple[str, bool]] = []

    def conn(self) -> str:
        self.made += 1
        return f"c{self.made}"

    def release(self, conn: str, broken: bool) -> None:
        self.back.append((conn, broken))


def _in_thread(fn: object) -> None:
    thread = threading.Thread(target=fn)  # type: ignore[arg-type]
    thread.start()
    thread.join()


def test_a_thread_keeps_one_and_takes_it_again() -> None:
    pool = Pool()
    kept = KeptConnections(lambda: 2, pool.release)
    assert kept.take() is None
    assert kept.keep(pool.conn())
    assert not kept.keep(pool.conn()), "a thread keeps one at most"
    entry = kept.take()
    assert entry is not None and entry.conn == "c1"
    assert kept.take() is None, "a call inside a call of the same thread gets none"
    kept.done(entry)
    again = kept.take()
    assert again is entry
    kept.done(again)
    kept.close()
    assert pool.back == [("c1", False)]
    assert kept.take() is None, "closed: not used again"


def test_no_more_are_kept_than_the_limit_and_ended_threads_give_theirs_back() -> None:
    pool = Pool()
    kept = KeptConnections(lambda: 2, pool.release)
    outcomes: list[bool] = []
    for _ in range(3):
        _in_thread(lambda: outcomes.append(kept.keep(pool.conn())))
    # Each thread had ended before the next kept one: theirs went back as the next one was kept.
    assert outcomes == [True, True, True]
    assert pool.back == [("c1", False), ("c2", False)]
    gate, release = threading.Event(), threading.Event()

    def holder() -> None:
        outcomes.append(kept.keep(pool.conn()))
        gate.set()
        release.wait(10)

    live = [threading.Thread(target=holder) for _ in range(3)]
    for thread in live:  # one at a time, each keeping its connection while the next asks
        thread.start()
        gate.wait(10)
        gate.clear()
    assert outcomes[3:] == [True, True, False], "three live threads, a limit of two: the third keeps none"
    assert pool.back[2:] == [("c3", False)], "the ended thread's went back when the next was kept"
    release.set()
    for thread in live:
        thread.join()


def test_a_discarded_connection_goes_back_broken() -> None:
    pool = Pool()
    kept = KeptConnections(lambda: 1, pool.release)
    kept.keep(pool.conn())
    entry = kept.take()
    assert entry is not None
    kept.discard(entry)
    assert pool.back == [("c1", True)]
    assert kept.take() is None
    assert kept.keep(pool.conn()), "the thread may keep another"


def test_expire_throws_idle_ones_away_now_and_busy_ones_at_their_next_take() -> None:
    pool = Pool()
    kept = KeptConnections(lambda: 4, pool.release)
    busy_taken, expired, finished = threading.Event(), threading.Event(), threading.Event()
    seen: list[object] = []

    def busy_thread() -> None:
        kept.keep(pool.conn())  # c1
        entry = kept.take()
        busy_taken.set()
        expired.wait(10)
        assert entry is not None
        kept.done(entry)
        seen.append(kept.take())  # kept before the expiry: thrown away now
        finished.set()

    thread = threading.Thread(target=busy_thread)
    thread.start()
    busy_taken.wait(10)
    kept.keep(pool.conn())  # c2, idle in this thread
    kept.expire()
    assert pool.back == [("c2", True)], "the idle one at once"
    expired.set()
    finished.wait(10)
    thread.join()
    assert seen == [None]
    assert pool.back == [("c2", True), ("c1", True)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_neither_uses_nor_gives_back_its_parents() -> None:
    pool = Pool()
    kept = KeptConnections(lambda: 2, pool.release)
    kept.keep(pool.conn())
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        ok = kept.take() is None
        kept.close()
        ok = ok and pool.back == [] and kept.keep("child")
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    entry = kept.take()
    assert entry is not None and entry.conn == "c1", "the parent's is still its own"
