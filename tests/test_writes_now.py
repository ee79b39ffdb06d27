"""What the guard's async calls do with the SQL store's blocking writes on SQLite.

The store has no async path of its own: the guard's async calls run its blocking calls in a worker
thread, so the loop never waits for another writer's lock nor for an fsync. These tests hold the
lock with a second, raw sqlite3 connection, the way another process would.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _guardutil import fp, identity
from _sqlspy import Spy, charge_effect
from conftest import FakeClock

from sagaguard.idempotency import ClaimOutcome, Guard, State, scope

LEASE, RETENTION = 30.0, 3600.0


class WriteLock:
    """SQLite's write lock, held by another connection (as another process would), with a safety
    release after ``fallback`` seconds so that a store that waited for it fails instead of hanging."""

    def __init__(self, path: Path, fallback: float = 10.0) -> None:
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._guard = threading.Lock()
        self.released_by_fallback = False
        self._conn.execute("BEGIN IMMEDIATE")
        self._timer = threading.Timer(fallback, self._fallback)
        self._timer.start()

    def _fallback(self) -> None:
        self.released_by_fallback = True
        self.release()

    def release(self) -> None:
        self._timer.cancel()
        with self._guard:
            if self._conn.in_transaction:
                self._conn.execute("COMMIT")

    def close(self) -> None:
        self.release()
        self._conn.close()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "effects.db"


@pytest.fixture
def store(path: Path, clock: FakeClock) -> Iterator[Spy]:
    s = Spy(f"sqlite:///{path}", clock=clock)
    s.get("warm-up")  # a fresh store has no idle connection yet: its first write goes to a thread
    yield s
    s.close()


def test_a_blocking_write_waits_for_the_write_lock(store: Spy, path: Path) -> None:
    """A write while another writer holds the lock waits for it (the 30 s busy timeout), rather
    than failing at once."""
    lock = WriteLock(path)
    try:
        releaser = threading.Timer(0.2, lock.release)
        releaser.start()
        claimed = store.claim(identity("s", "b"), fp(), LEASE)  # waits for the release
        releaser.join()
    finally:
        lock.close()
    assert claimed.outcome is ClaimOutcome.CLAIMED
    assert not lock.released_by_fallback


# ------------------------------------------------------------------------- through the guard


def test_async_call_on_sqlite_makes_its_writes_in_a_thread(store: Spy) -> None:
    """An fsync on the event loop would stall every other task: the guard's async calls run the
    store's blocking calls in a worker thread, whether or not the write lock is free."""
    guard = Guard(store, lease=LEASE, retention=RETENTION)
    runs: list[int] = []
    charge = charge_effect(guard, runs)

    async def main() -> list[int]:
        with scope("s"):
            first = await charge(5)
        with scope("s"):
            again = await charge(5)
        return [first, again]

    try:
        assert asyncio.run(main()) == [5, 5]
    finally:
        guard.close()
    assert runs == [5]
    assert store.blocking == ["claim", "complete", "claim"]  # claim, record, the replay's claim


def test_async_call_on_sqlite_never_waits_for_the_write_lock_on_the_loop(store: Spy, path: Path) -> None:
    """While another writer holds the lock, the claim waits in a thread and the loop runs on."""
    guard = Guard(store, lease=LEASE, retention=RETENTION)
    runs: list[int] = []
    charge = charge_effect(guard, runs)

    async def main(lock: WriteLock) -> tuple[int, int]:
        with scope("s"):
            call = asyncio.create_task(charge(5))
        ticks = 0
        while not store.blocking:  # the loop runs while the claim waits in its thread
            await asyncio.sleep(0.005)
            ticks += 1
        for _ in range(5):
            await asyncio.sleep(0.005)
            ticks += 1
        assert not call.done()
        lock.release()
        return await call, ticks

    lock = WriteLock(path)
    try:
        result, ticks = asyncio.run(main(lock))
    finally:
        lock.close()
        guard.close()
    assert not lock.released_by_fallback
    assert (result, runs) == (5, [5])
    assert ticks >= 5
    assert store.blocking[0] == "claim"
    rec = store.get(identity("s", "pay.charge").key)
    assert rec is not None and rec.state is State.SUCCEEDED


def test_in_memory_sqlite_async_calls_wait_for_another_thread_off_the_loop(clock: FakeClock) -> None:
    """``sqlite://`` is one connection shared under the store's lock: while another thread is in
    the store, an async call's claim waits for it in its worker thread and the loop runs on."""
    store = Spy("sqlite://", clock=clock)
    guard = Guard(store, lease=LEASE, retention=RETENTION)
    runs: list[int] = []
    charge = charge_effect(guard, runs)
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with store._driver.lock:  # what a call running in another thread holds
            inside.set()
            leave.wait(10)

    async def main() -> tuple[int, int]:
        with scope("s"):
            call = asyncio.create_task(charge(5))
        ticks = 0
        while not store.blocking:  # the claim went to its thread, where it waits for the lock
            await asyncio.sleep(0.005)
        for _ in range(5):
            await asyncio.sleep(0.005)
            ticks += 1
        assert not call.done()
        leave.set()
        return await call, ticks

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(10)
        result, ticks = asyncio.run(main())
    finally:
        leave.set()
        holder.join()
        guard.close()
        store.close()
    assert (result, runs, ticks) == (5, [5], 5)
