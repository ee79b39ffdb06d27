"""The SQL store's and journal's connections: SQLAlchemy's pool, one connection per call.

What must hold: connections the server killed cost at most one failed call (StoreUnavailable /
JournalUnavailable), never a stuck store, however many the pool held; no connection is held between
calls in a pool shared with the caller (a given engine), so a small one is never starved; in a pool
of the store's own, threads that keep their connection between calls keep no more than the pool
keeps, give back what an ended thread kept, and a kill of those too costs one call in all; a forked
child never talks on its parent's sockets.
"""

from __future__ import annotations

import os
import queue
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from _guardutil import claim_then_fork
from conftest import require_postgres

from sagaguard.idempotency.errors import StoreUnavailable
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.stores.sql import SqlStore, make_engine
from sagaguard.saga.errors import JournalUnavailable
from sagaguard.saga.journals.sql import SqlJournal
from sagaguard.saga.records import Phase, StepKind, StepRecord, StepState

FP = "f1_" + "a" * 64
LEASE = 30.0


def _ident() -> EffectIdentity:
    return EffectIdentity.of("shelf", uuid.uuid4().hex, "pay.charge", 0)


@pytest.fixture
def pg_engine() -> Iterator[sa.Engine]:
    engine = make_engine(require_postgres())
    yield engine
    engine.dispose()


@pytest.fixture
def pg_table(pg_engine: sa.Engine) -> Iterator[str]:
    name = f"sg_shelf_{uuid.uuid4().hex[:10]}"
    yield name
    with pg_engine.begin() as conn:
        for dropped in (name, f"{name}_version"):
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{dropped}"'))


def _terminate_others(url: str) -> int:
    """Kill every other session of this database user on the server; how many were killed."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND datname = current_database() "
            "AND usename = current_user AND backend_type = 'client backend' "
            "AND application_name = 'sg-shelf-test'"
        ).fetchall()
    return len(rows)


def _call(store: SqlStore) -> None:
    identity = _ident()
    store.complete(identity.key, store.claim(identity, FP, LEASE).record.token, "1", 60.0)


def _tagged_engine(url: str) -> sa.Engine:
    """An engine whose sessions carry an application name, so a test kills only its own."""
    sep = "&" if "?" in url else "?"
    return make_engine(f"{url}{sep}application_name=sg-shelf-test")


# ------------------------------------------------------------------------------ killed sessions


def test_store_recovers_after_the_server_killed_its_connections(pg_table: str) -> None:
    url = require_postgres()
    engine = _tagged_engine(url)
    store = SqlStore(engine, table_name=pg_table)
    try:
        with ThreadPoolExecutor(4) as pool:  # several connections in the pool, all to be killed
            list(pool.map(lambda _: _call(store), range(16)))
        assert _terminate_others(url) >= 1
        failures = 0
        for _ in range(3):
            identity = _ident()
            try:
                claimed = store.claim(identity, FP, LEASE).record
            except StoreUnavailable:
                failures += 1
                continue
            store.complete(identity.key, claimed.token, "1", 60.0)
        assert failures <= 1, "one dead connection must cost at most one call"
        assert engine.pool.checkedout() == 0, "no connection is held between calls"
    finally:
        store.close()
        assert engine.pool.checkedout() == 0, "close() gives every connection back"
        engine.dispose()


def test_connections_kept_by_live_threads_cost_one_call_when_the_server_kills_them(
    pg_table: str,
) -> None:
    url = require_postgres()
    sep = "&" if "?" in url else "?"
    store = SqlStore(f"{url}{sep}application_name=sg-shelf-test", table_name=pg_table)
    engine: sa.Engine = store._engine
    jobs: list[queue.Queue[bool]] = [queue.Queue() for _ in range(3)]
    done: queue.Queue[BaseException | None] = queue.Queue()

    def worker(inbox: queue.Queue[bool]) -> None:
        while inbox.get():
            try:
                _call(store)
                done.put(None)
            except BaseException as exc:  # reported to the test's thread
                done.put(exc)

    threads = [threading.Thread(target=worker, args=(inbox,), daemon=True) for inbox in jobs]
    for thread in threads:
        thread.start()

    def one_round() -> list[BaseException]:
        failed = []
        for inbox in jobs:  # one thread at a time: the first to find its session dead
            inbox.put(True)
            if (outcome := done.get(timeout=60)) is not None:
                failed.append(outcome)
        return failed

    try:
        assert one_round() == []
        assert engine.pool.checkedout() == 3, "each live thread keeps its connection between calls"
        assert _terminate_others(url) >= 3
        failed = one_round() + one_round()
        assert all(isinstance(exc, StoreUnavailable) for exc in failed), failed
        assert len(failed) <= 1, "dead kept connections must cost at most one call in all"
    finally:
        for inbox in jobs:
            inbox.put(False)
        for thread in threads:
            thread.join(timeout=60)
        store.close()
        assert engine.pool.checkedout() == 0, "close() gives every kept connection back"


def test_a_thread_that_ended_gives_its_kept_connection_back(pg_table: str) -> None:
    store = SqlStore(require_postgres(), table_name=pg_table)
    engine: sa.Engine = store._engine
    try:
        size = engine.pool.size()  # type: ignore[attr-defined]
        with ThreadPoolExecutor(size) as pool:
            list(pool.map(lambda _: _call(store), range(4 * size)))
        assert engine.pool.checkedout() <= size, "no more threads keep one than the pool keeps"
        # Those threads have ended: the next thread to keep a connection gives theirs back.
        _call(store)
        assert engine.pool.checkedout() == 1
    finally:
        store.close()
    assert engine.pool.checkedout() == 0


def test_a_sqlite_store_keeps_a_connection_per_thread_and_holds_no_lock_between_calls(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kept.db"
    store = SqlStore(f"sqlite:///{path}")
    engine: sa.Engine = store._engine
    try:
        size = engine.pool.size()  # type: ignore[attr-defined]
        with ThreadPoolExecutor(size) as pool:
            list(pool.map(lambda _: _call(store), range(4 * size)))
        assert 1 <= engine.pool.checkedout() <= size, "threads keep their connections, no more than the pool"
        # Another writer gets the write lock at once, and a checkpoint finds no reader in its way:
        # a kept connection holds no transaction between calls.
        other = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("COMMIT")
            busy, _, _ = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            assert busy == 0
        finally:
            other.close()
        _call(store)  # the threads that kept connections have ended: theirs go back
        assert engine.pool.checkedout() == 1
    finally:
        store.close()
    assert engine.pool.checkedout() == 0, "close() gives every kept connection back"


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_journal_of_its_own_keeps_connections_and_close_gives_them_back(
    backend: str, tmp_path: Path
) -> None:
    prefix = f"sgsh{uuid.uuid4().hex[:8]}_"
    url = f"sqlite:///{tmp_path / 'j.db'}" if backend == "sqlite" else require_postgres()
    journal = SqlJournal(url, table_prefix=prefix)
    engine: sa.Engine = journal._engine
    first = StepRecord(0, "s0", StepKind.COMPENSATABLE, StepState.STARTED)
    try:
        journal.start("saga-1", name="n", version=1, input="1", fingerprint="f", lease=60, first=first)
        assert journal.load("saga-1") is not None
        assert engine.pool.checkedout() == 1, "the thread keeps its connection between calls"
    finally:
        if backend == "postgres":
            with engine.begin() as conn:
                for table in ("sagas", "saga_steps", "saga_signals", "journal_version"):
                    conn.execute(sa.text(f'DROP TABLE IF EXISTS "{prefix}{table}"'))
        pool = engine.pool
        journal.close()
    assert pool.checkedout() == 0, "close() gives every kept connection back"


def test_journal_recovers_after_the_server_killed_its_connections(pg_engine: sa.Engine) -> None:
    url = require_postgres()
    prefix = f"sgsh{uuid.uuid4().hex[:8]}_"
    engine = _tagged_engine(url)
    journal = SqlJournal(engine, table_prefix=prefix)
    first = StepRecord(0, "s0", StepKind.COMPENSATABLE, StepState.STARTED)
    try:
        started = journal.start(
            "saga-1", name="n", version=1, input="1", fingerprint="f", lease=60, first=first
        )
        token = started.snapshot.saga.token
        assert _terminate_others(url) >= 1
        failures = 0
        for k in range(1, 4):
            done = StepRecord(k - 1, f"s{k - 1}", StepKind.COMPENSATABLE, StepState.SUCCEEDED, result="1")
            nxt = StepRecord(k, f"s{k}", StepKind.COMPENSATABLE, StepState.STARTED)
            try:
                journal.commit("saga-1", token, Phase(steps=(done, nxt), lease=60))
            except JournalUnavailable:
                failures += 1
        assert failures <= 1
        snapshot = journal.load("saga-1")
        assert snapshot is not None and [s.state for s in snapshot.steps][-1] is StepState.STARTED
    finally:
        journal.close()
        assert engine.pool.checkedout() == 0
        engine.dispose()
        with pg_engine.begin() as conn:
            for table in ("sagas", "saga_steps", "saga_signals", "journal_version"):
                conn.execute(sa.text(f'DROP TABLE IF EXISTS "{prefix}{table}"'))


# ------------------------------------------------------------------------------ pool sizes


def test_a_pool_of_one_is_never_held_between_calls(pg_table: str) -> None:
    url = require_postgres()
    engine = sa.create_engine(
        url.replace("postgresql://", "postgresql+psycopg://"), pool_size=1, max_overflow=0, pool_timeout=2
    )
    store = SqlStore(engine, table_name=pg_table)
    try:
        identity = _ident()
        store.complete(identity.key, store.claim(identity, FP, LEASE).record.token, "1", 60.0)
        with engine.connect() as conn:  # would time out if the store held the only connection
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        store.close()
        engine.dispose()


# ------------------------------------------------------------------------------ fork


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_uses_its_parents_connections(pg_table: str) -> None:
    url = require_postgres()
    store = SqlStore(url, table_name=pg_table)
    parent_ident, child_ident = _ident(), _ident()
    token = claim_then_fork(store, parent_ident, child_ident, FP, LEASE)  # the parent's is pooled
    # The parent's session is intact: its claim completes on the connection it had pooled.
    store.complete(parent_ident.key, token, "1", 60.0)
    assert store.get(child_ident.key) is not None and store.get(child_ident.key).result == "2"  # type: ignore[union-attr]
    store.close()
