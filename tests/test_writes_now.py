"""The SQL store's writes tried "now", and what the guard's async calls do on SQLite.

The store's ``claim_now``/``complete_now`` answer only when they can start at once (an idle kept
connection, the write lock free). The guard calls none of them: its async calls run the store's
blocking calls in a worker thread, so the loop never waits for another writer's lock nor for an
fsync. These tests hold the lock with a second, raw sqlite3 connection, the way another process
would.
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
from conftest import FakeClock, require_postgres

import idempotency.stores.sql as sql_module
from idempotency import ClaimOutcome, Guard, State, scope
from idempotency.records import Record
from idempotency.stores.sql import SqlStore

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


def test_a_fresh_store_writes_now_only_once_a_connection_is_kept(path: Path, clock: FakeClock) -> None:
    """Opening a connection may wait (the pool, WAL recovery): the first write goes to a thread."""
    fresh = SqlStore(f"sqlite:///{path}", clock=clock)
    try:
        assert fresh.claim_now(identity("s", "a"), fp(), LEASE) is None
        fresh.claim(identity("s", "a"), fp(), LEASE)
        assert fresh.claim_now(identity("s", "b"), fp(), LEASE) is not None
    finally:
        fresh.close()


def test_claim_now_and_complete_now_write_what_claim_and_complete_write(store: Spy) -> None:
    ident = identity("s", "pay.charge")
    claimed = store.claim_now(ident, fp(), LEASE)
    assert claimed is not None and claimed.outcome is ClaimOutcome.CLAIMED
    assert store.get(ident.key) == claimed.record
    again = store.claim_now(ident, fp(), LEASE)  # a live claim: returned as it is
    assert again is not None and again.outcome is ClaimOutcome.EXISTING
    assert again.record == claimed.record
    done = store.complete_now(ident.key, claimed.record.token, '"ok"', RETENTION)
    assert done is not None and done == store.get(ident.key)
    assert (done.state, done.result, done.token) == (State.SUCCEEDED, '"ok"', claimed.record.token)
    assert store.blocking == []


def test_writes_now_answer_none_and_write_nothing_while_another_writer_holds_the_lock(
    store: Spy, path: Path
) -> None:
    ident = identity("s", "pay.charge")
    claimed = store.claim_now(identity("s", "other"), fp(), LEASE)  # ours, to complete below
    assert claimed is not None
    lock = WriteLock(path)
    try:
        assert store.claim_now(ident, fp(), LEASE) is None
        assert store.complete_now(claimed.record.key, claimed.record.token, "1", RETENTION) is None
    finally:
        lock.close()
    assert not lock.released_by_fallback  # it answered at once, it did not wait for the lock
    assert store.get(ident.key) is None
    rec = store.get(claimed.record.key)
    assert rec is not None and rec.state is State.IN_PROGRESS
    # The blocking form completes it afterwards, from the claim's record as usual.
    done = store.complete(claimed.record.key, claimed.record.token, "1", RETENTION)
    assert done == store.get(claimed.record.key)
    assert (done.state, done.result) == (State.SUCCEEDED, "1")


def test_the_busy_timeout_is_restored_after_a_write_now(store: Spy, path: Path) -> None:
    """A blocking write after a write now still waits for the lock (the 30 s busy timeout), rather
    than failing at once as the zero timeout of the attempt would make it."""
    assert store.claim_now(identity("s", "a"), fp(), LEASE) is not None
    lock = WriteLock(path)
    try:
        assert store.claim_now(identity("s", "b"), fp(), LEASE) is None
        releaser = threading.Timer(0.2, lock.release)
        releaser.start()
        claimed = store.claim(identity("s", "b"), fp(), LEASE)  # waits for the release
        releaser.join()
    finally:
        lock.close()
    assert claimed.outcome is ClaimOutcome.CLAIMED
    assert not lock.released_by_fallback


def test_while_writes_are_slow_none_is_made_on_the_loop(store: Spy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sql_module, "_SLOW_WRITE", 0.0)  # every write is slower than this
    assert store.claim_now(identity("s", "a"), fp(), LEASE) is not None  # the average was 0
    assert store.claim_now(identity("s", "b"), fp(), LEASE) is None  # now it is over the bound
    assert store.get(identity("s", "b").key) is None
    monkeypatch.setattr(sql_module, "_SLOW_WRITE", 3600.0)
    assert store.claim_now(identity("s", "b"), fp(), LEASE) is not None


def test_fast_writes_in_threads_bring_the_writes_back_to_the_loop(store: Spy) -> None:
    """The average is of every write of the store: the blocking writes (made in threads while the
    loop's would be too slow) tell when the disk is fast again. One slow write among fast ones
    moves it by an eighth of its time only."""
    store._write_time = 1.0  # as after writes of a second each
    assert store.claim_now(identity("s", "a"), fp(), LEASE) is None
    writes = 0
    while store.claim_now(identity("s", "a"), fp(), LEASE) is None:
        store.claim(identity("t", f"w{writes}"), fp(), LEASE)  # a fast write, as in a thread
        writes += 1
        assert writes < 200
    assert writes >= 20  # from 1 s to under 2 ms takes many fast writes, not one


def test_postgres_has_no_sync_write_now(clock: FakeClock) -> None:
    """A Postgres write is a network round trip: never made blocking on the loop (it is awaited
    there instead, through ``aclaim``: tests/test_pq_async.py)."""
    url = require_postgres()
    store = SqlStore(url, clock=clock, table_name="sg_test_writes_now")
    try:
        ident = identity("s", "pay.charge")
        assert store.claim_now(ident, fp(), LEASE) is None
        assert store.get(ident.key) is None
        claimed = store.claim(ident, fp(), LEASE)
        assert store.complete_now(ident.key, claimed.record.token, "1", RETENTION) is None
        rec = store.get(ident.key)
        assert rec is not None and rec.state is State.IN_PROGRESS
        done: Record = store.complete(ident.key, claimed.record.token, "1", RETENTION)
        assert done.state is State.SUCCEEDED  # the claim's record was kept for the blocking form
    finally:
        with store._engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE IF EXISTS sg_test_writes_now")
        store.close()


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


def test_in_memory_sqlite_writes_now_unless_another_thread_is_in_the_store(clock: FakeClock) -> None:
    """``sqlite://`` is one connection shared under the store's lock: the loop never waits for it."""
    store = SqlStore("sqlite://", clock=clock)
    try:
        store.get("warm-up")
        assert store.claim_now(identity("s", "a"), fp(), LEASE) is not None
        inside, leave = threading.Event(), threading.Event()

        def hold() -> None:
            with store._lock:  # what a call running in another thread holds
                inside.set()
                leave.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert inside.wait(10)
            assert store.claim_now(identity("s", "b"), fp(), LEASE) is None
        finally:
            leave.set()
            holder.join()
        assert store.get(identity("s", "b").key) is None
        assert store.claim_now(identity("s", "b"), fp(), LEASE) is not None
    finally:
        store.close()
