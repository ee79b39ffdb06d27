"""The SQL store's and journal's connections kept checked out between calls (``Shelf``).

What must hold: a connection the server killed costs at most one failed call (StoreUnavailable /
JournalUnavailable), never a stuck store; a small pool shared with the caller is never starved; a
forked child never talks on its parent's sockets; ``close()`` gives every connection back; and the
finished record a store builds from its own claim is the one it stored.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import FakeClock, StoreFactory, require_postgres

from idempotency.errors import LostOwnership, StoreUnavailable
from idempotency.keys import EffectIdentity
from idempotency.store import IdempotencyStore
from idempotency.stores.shelf import KEEP, Shelf, shelf_size
from idempotency.stores.sql import SqlStore, make_engine
from saga.errors import JournalUnavailable
from saga.journals.sql import SqlJournal
from saga.records import Phase, StepKind, StepRecord, StepState

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
        conn.execute(sa.text(f'DROP TABLE IF EXISTS "{name}"'))


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


def _tagged_engine(url: str) -> sa.Engine:
    """An engine whose sessions carry an application name, so a test kills only its own."""
    sep = "&" if "?" in url else "?"
    return make_engine(f"{url}{sep}application_name=sg-shelf-test")


# ------------------------------------------------------------------------------ held records


@pytest.mark.parametrize("heartbeat", [False, True], ids=["plain", "after-heartbeat"])
def test_complete_returns_what_was_stored(store: IdempotencyStore, clock: FakeClock, heartbeat: bool) -> None:
    identity = _ident()
    claimed = store.claim(identity, FP, LEASE).record
    if heartbeat:
        clock.advance(3)
        store.heartbeat(identity.key, claimed.token, LEASE * 2)
    clock.advance(2)
    done = store.complete(identity.key, claimed.token, '{"ok":true}', 3600.0)
    assert store.get(identity.key) == done


def test_complete_after_a_take_over_returns_what_was_stored(
    shared_store_factory: StoreFactory, clock: FakeClock
) -> None:
    first, second = shared_store_factory.open(), shared_store_factory.open()
    identity = _ident()
    zombie = first.claim(identity, FP, LEASE).record
    clock.advance(LEASE + 1)
    took = second.claim(identity, FP, LEASE).record
    assert took.token == zombie.token + 1
    done = second.complete(identity.key, took.token, "1", 3600.0)
    assert second.get(identity.key) == done
    assert done.attempts == 2 and done.token == took.token
    with pytest.raises(LostOwnership):
        first.complete(identity.key, zombie.token, "2", 3600.0)
    assert second.get(identity.key) == done


# ------------------------------------------------------------------------------ killed sessions


def test_store_recovers_after_the_server_killed_its_connections(pg_table: str) -> None:
    url = require_postgres()
    engine = _tagged_engine(url)
    store = SqlStore(engine, table_name=pg_table)
    try:
        for _ in range(3):
            identity = _ident()
            store.complete(identity.key, store.claim(identity, FP, LEASE).record.token, "1", 60.0)
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
        assert engine.pool.checkedout() <= KEEP
    finally:
        store.close()
        assert engine.pool.checkedout() == 0, "close() gives every connection back"
        engine.dispose()


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
            for table in ("sagas", "saga_steps", "saga_signals"):
                conn.execute(sa.text(f'DROP TABLE IF EXISTS "{prefix}{table}"'))


# ------------------------------------------------------------------------------ pool sizes


def test_a_pool_of_one_is_never_held_between_calls(pg_table: str) -> None:
    url = require_postgres()
    engine = sa.create_engine(
        url.replace("postgresql://", "postgresql+psycopg://"), pool_size=1, max_overflow=0, pool_timeout=2
    )
    store = SqlStore(engine, table_name=pg_table)
    try:
        assert shelf_size(engine) == 0
        identity = _ident()
        store.complete(identity.key, store.claim(identity, FP, LEASE).record.token, "1", 60.0)
        with engine.connect() as conn:  # would time out if the store held the only connection
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        store.close()
        engine.dispose()


def test_shelf_sizes() -> None:
    assert shelf_size(sa.create_engine("sqlite://", poolclass=sa.pool.NullPool)) == 0
    assert shelf_size(sa.create_engine("sqlite:///x.db", poolclass=sa.pool.QueuePool, pool_size=2)) == 1
    assert shelf_size(sa.create_engine("sqlite:///x.db", poolclass=sa.pool.QueuePool, pool_size=5)) == KEEP
    assert shelf_size(make_engine("sqlite://")) == KEEP  # one shared connection anyway


def test_shelf_keeps_at_most_keep_and_discards_broken(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/s.db")
    shelf = Shelf(engine, keep=1)
    a, b = shelf.take(), shelf.take()
    assert a is not b
    shelf.give(a)
    shelf.give(b)  # over the limit: back to the pool
    assert engine.pool.checkedout() == 1
    again = shelf.take()
    assert again is a  # the shelved one is reused
    shelf.discard(again, KeyboardInterrupt(), disconnect=False)  # interrupted mid-call: not reused
    assert engine.pool.checkedout() == 0
    assert shelf.take() is not a
    shelf.close()
    engine.dispose()


# ------------------------------------------------------------------------------ fork


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_uses_its_parents_connections(pg_table: str) -> None:
    url = require_postgres()
    store = SqlStore(url, table_name=pg_table)
    parent_ident, child_ident = _ident(), _ident()
    claimed = store.claim(parent_ident, FP, LEASE).record  # the parent's connection is on the shelf
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            got = store.claim(child_ident, FP, LEASE).record
            store.complete(child_ident.key, got.token, "2", 60.0)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's session is intact: its claim completes on the connection it had shelved.
    store.complete(parent_ident.key, claimed.token, "1", 60.0)
    assert store.get(child_ident.key) is not None and store.get(child_ident.key).result == "2"  # type: ignore[union-attr]
    store.close()


def test_settle_rolls_back_and_keeps_or_discards(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/s.db")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (n INTEGER)"))
    shelf = Shelf(engine)
    held = shelf.take()
    held.cursor.execute("BEGIN IMMEDIATE")
    held.cursor.execute("INSERT INTO t VALUES (1)")
    shelf.settle(held, ValueError("the block failed"), disconnect=False)  # rolled back, kept
    again = shelf.take()
    assert again is held
    assert again.cursor.execute("SELECT count(*) FROM t").fetchall() == [(0,)]
    shelf.settle(again, KeyboardInterrupt(), disconnect=False)  # interrupted: never reused
    other = shelf.take()
    assert other is not held
    shelf.give(other)
    shelf.close()
    engine.dispose()
