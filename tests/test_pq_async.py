"""Async guarded calls on Postgres: the claim and the record awaited on the event loop.

The two writes of a new call go to libpq's non-blocking interface (``idempotency.stores.pq_async``)
on a connection the store keeps, and the loop waits for the server's reply as it waits for any
socket. What must hold: the same records as the blocking path, the loop free while the server makes
a claim wait (another transaction holds the row), a claim made for a cancelled caller given back, a
killed connection costing one call, and the server's own errors mapped like every other.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from _guardutil import fp, identity
from _sqlspy import Spy, charge_effect
from conftest import FakeClock, require_postgres

from idempotency import Guard, State, StoreError, StoreUnavailable, scope
from idempotency.stores.sql import SqlStore

LEASE, RETENTION = 30.0, 3600.0


@pytest.fixture
def url() -> str:
    return require_postgres()


@pytest.fixture
def table() -> str:
    return f"sg_test_pq_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def store(url: str, table: str, clock: FakeClock) -> Iterator[Spy]:
    s = Spy(url, clock=clock, table_name=table)
    s.get("warm-up")  # keeps a connection: a fresh store's first write goes to a thread
    yield s
    s.close()
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'DROP TABLE IF EXISTS "{table}"')


class RowHolder:
    """Another session's uncommitted insert of one key: a claim of that key waits for it."""

    def __init__(self, url: str, table: str, key: str) -> None:
        self.conn = psycopg.connect(url)
        self.conn.execute(
            f'INSERT INTO "{table}" (key, namespace, scope, name, ordinal, fingerprint, state, token, '
            "lease_until, attempts, created_at, updated_at) "
            "VALUES (%s, 'x', 'x', 'x', 0, 'x', 'in_progress', 1, 0, 1, 0, 0)",
            (key,),
        )

    def waiting(self) -> int:
        """How many other sessions wait for this one's locks."""
        with psycopg.connect(self.conn.info.dsn, autocommit=True) as probe:
            row = probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND %s = ANY(pg_blocking_pids(pid))",
                (self.conn.info.backend_pid,),
            ).fetchone()
        return int(row[0]) if row else 0

    def rollback(self) -> None:
        self.conn.rollback()
        self.conn.close()


async def until(predicate: Any) -> None:
    """Let the loop run until ``predicate()`` holds (a bound of 10 s turns a hang into a failure)."""
    for _ in range(2000):
        if await asyncio.to_thread(predicate):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


def test_async_calls_on_postgres_await_the_server_on_the_loop(store: Spy) -> None:
    guard = Guard(store, lease=LEASE, retention=RETENTION)
    runs: list[int] = []
    charge = charge_effect(guard, runs)

    async def main() -> list[int]:
        results = []
        for _ in range(2):
            with scope("s"):
                results.append(await charge(5))
        return results

    try:
        assert asyncio.run(main()) == [5, 5]
    finally:
        guard.close()
    assert runs == [5]
    assert store.blocking == []  # claim, record and the replay's claim: none in a thread
    rec = store.get(identity("s", "pay.charge").key)
    assert rec is not None and (rec.state, rec.result) == (State.SUCCEEDED, "5")
    # The same record the blocking path writes, field by field (but the key's own values).
    blocking = store.claim(identity("t", "pay.charge"), fp(amount=5), LEASE)
    done = store.complete(blocking.record.key, blocking.record.token, "5", RETENTION)
    assert (rec.state, rec.attempts, rec.lease_until - rec.created_at, rec.expires_at - rec.updated_at) == (
        done.state,
        done.attempts,
        done.lease_until - done.created_at,
        done.expires_at - done.updated_at,  # type: ignore[operator]
    )


def test_the_loop_runs_on_while_the_server_makes_a_claim_wait(store: Spy, url: str, table: str) -> None:
    guard = Guard(store, lease=LEASE, retention=RETENTION)
    runs: list[int] = []
    charge = charge_effect(guard, runs)
    holder = RowHolder(url, table, identity("s", "pay.charge").key)

    async def main() -> int:
        with scope("s"):
            call = asyncio.create_task(charge(5))
        await until(lambda: holder.waiting() == 1)  # the claim waits in the server, the loop runs
        assert not call.done()
        holder.rollback()
        return await call

    try:
        assert asyncio.run(main()) == 5
    finally:
        guard.close()
    assert runs == [5]
    assert store.blocking == []


def test_a_claim_made_for_a_cancelled_call_is_given_back(store: Spy, url: str, table: str) -> None:
    guard = Guard(store, lease=LEASE, retention=RETENTION)
    runs: list[int] = []
    charge = charge_effect(guard, runs)
    key = identity("s", "pay.charge").key
    holder = RowHolder(url, table, key)

    async def main() -> None:
        with scope("s"):
            call = asyncio.create_task(charge(5))
        await until(lambda: holder.waiting() == 1)
        call.cancel()  # the claim was sent: its reply is still read, and it is given back
        await asyncio.sleep(0.05)
        assert not call.done()
        holder.rollback()  # now the server makes the claim
        with pytest.raises(asyncio.CancelledError):
            await call

    try:
        asyncio.run(main())
    finally:
        guard.close()
    assert runs == []
    assert store.get(key) is None  # claimed, then given back: not an orphan claim
    assert asyncio.run(_call_again(store)) == 5  # and the next call simply runs
    assert store.blocking == []  # every claim was awaited on the loop


def test_cancelled_twice_the_connection_is_closed_and_the_store_serves_on(
    store: Spy, url: str, table: str
) -> None:
    """A second cancellation gives up the reply: the connection is closed, not kept with a reply
    unread. Whether the server then made that claim is unknown, as after a crash."""
    guard = Guard(store, lease=LEASE, retention=RETENTION)
    runs: list[int] = []
    charge = charge_effect(guard, runs)
    holder = RowHolder(url, table, identity("s", "pay.charge").key)
    kept = len(store._shelf._idle)

    async def main() -> None:
        with scope("s"):
            call = asyncio.create_task(charge(5))
        await until(lambda: holder.waiting() == 1)
        call.cancel()
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert len(store._shelf._idle) == kept - 1
        holder.rollback()
        with scope("t"):
            assert await charge(7) == 7

    try:
        asyncio.run(main())
    finally:
        guard.close()
    assert runs == [7]


async def _call_again(store: Spy) -> int:
    guard = Guard(store, lease=LEASE, retention=RETENTION)
    try:
        with scope("s"):
            return int(await charge_effect(guard, [])(5))
    finally:
        guard.close()


def test_a_killed_connection_costs_one_call(store: Spy, url: str) -> None:
    guard = Guard(store, lease=LEASE, retention=RETENTION)
    runs: list[int] = []
    charge = charge_effect(guard, runs)
    pids = [held.conn.pgconn.backend_pid for held in store._shelf._idle]
    assert pids
    with psycopg.connect(url, autocommit=True) as admin:
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    async def call(scope_id: str) -> int:
        with scope(scope_id):
            return int(await charge(5))

    try:
        with pytest.raises(StoreUnavailable):
            asyncio.run(call("a"))
        assert asyncio.run(call("b")) == 5  # a fresh connection (in a thread first, then kept)
        assert asyncio.run(call("c")) == 5
    finally:
        guard.close()
    assert runs == [5, 5]
    assert store.get(identity("a", "pay.charge").key) is None  # never claimed, never run


def test_a_server_error_is_a_store_error_and_the_connection_serves_on(
    store: Spy, url: str, table: str
) -> None:
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'DROP TABLE "{table}"')
    assert store._shelf._idle  # a kept connection will send the claim

    async def claim(name: str) -> Any:
        return await store.aclaim(identity("s", name), fp(), LEASE)

    with pytest.raises(StoreError) as raised:
        asyncio.run(claim("a"))
    assert not isinstance(raised.value, StoreUnavailable)
    assert "does not exist" in str(raised.value)
    assert store._shelf._idle  # the server answered: the connection was kept
    store.create_tables()
    claimed = asyncio.run(claim("b"))
    assert claimed is not None and claimed.record.state is State.IN_PROGRESS


def test_two_stores_of_one_engine_prepare_their_own_statements(url: str, clock: FakeClock) -> None:
    from idempotency.stores.sql import make_engine

    engine = make_engine(url)
    tables = [f"sg_test_pq_{uuid.uuid4().hex[:10]}" for _ in range(2)]
    stores = [SqlStore(engine, clock=clock, table_name=t) for t in tables]
    try:
        for s in stores:
            s.get("warm-up")

        async def main() -> None:
            for i in range(6):  # the shelves lend the engine's connections to both stores
                s = stores[i % 2]
                claimed = await s.aclaim(identity("s", f"e{i}"), fp(), LEASE)
                assert claimed is not None
                await s.acomplete(claimed.record.key, claimed.record.token, str(i), RETENTION)

        asyncio.run(main())
        for n, s in enumerate(stores):
            assert sorted(r.result or "" for r in s.list()) == [str(i) for i in range(6) if i % 2 == n]
    finally:
        for s in stores:
            s.close()
        with psycopg.connect(url, autocommit=True) as admin:
            for t in tables:
                admin.execute(f'DROP TABLE IF EXISTS "{t}"')
        engine.dispose()


def test_statements_deallocated_under_it_are_prepared_again(store: Spy) -> None:
    """psycopg sends DEALLOCATE ALL on a connection after a ROLLBACK or a DROP it ran there."""

    async def claim(name: str) -> Any:
        return await store.aclaim(identity("s", name), fp(), LEASE)

    assert asyncio.run(claim("a")) is not None  # prepared on a kept connection
    for held in store._shelf._idle:
        held.conn.execute("DEALLOCATE ALL")
    claimed = asyncio.run(claim("b"))
    assert claimed is not None and claimed.record.state is State.IN_PROGRESS
    assert store.blocking == []


def test_a_statement_already_prepared_in_the_session_is_used(store: Spy) -> None:
    """A call cancelled while its statement was being prepared leaves it prepared, unknown here."""
    from idempotency.stores import pq_async

    async def claim(name: str) -> Any:
        return await store.aclaim(identity("s", name), fp(), LEASE)

    assert asyncio.run(claim("a")) is not None
    for held in store._shelf._idle:
        pq_async._prepared.pop(held.conn, None)  # forgotten here, still in the session
    claimed = asyncio.run(claim("b"))
    assert claimed is not None and claimed.record.state is State.IN_PROGRESS


def test_connections_without_prepared_statements_make_async_writes_in_a_thread(
    url: str, table: str, clock: FakeClock
) -> None:
    """``prepare_threshold=None`` (what PgBouncer in transaction mode needs before 1.21): the writes
    are not prepared on the loop's path either; they go to a thread."""
    import sqlalchemy as sa

    engine = sa.create_engine(
        url.replace("postgresql://", "postgresql+psycopg://"), connect_args={"prepare_threshold": None}
    )
    store = Spy(engine, clock=clock, table_name=table)
    guard = Guard(store, lease=LEASE, retention=RETENTION)
    try:
        store.get("warm-up")
        assert asyncio.run(store.aclaim(identity("s", "a"), fp(), LEASE)) is None
        with scope("s"):
            assert asyncio.run(charge_effect(guard, [])(5)) == 5
        assert store.blocking == ["claim", "complete"]
    finally:
        guard.close()
        store.close()
        engine.dispose()



# ----------------------------------------------------------------- the blocking path, same statements


def _prepared_here(store: SqlStore) -> set[str]:
    """The statements prepared in the sessions of the store's kept connections."""
    names: set[str] = set()
    for held in store._shelf._idle:
        rows = held.conn.execute("SELECT name FROM pg_prepared_statements").fetchall()
        names.update(str(row[0]) for row in rows)
    return names


def test_sync_claims_and_records_go_straight_to_libpq(store: Spy) -> None:
    """The blocking claim and record are the statements the async path prepares (psycopg's
    ``cursor.execute`` would have prepared them under its own ``_pg3_`` names), and write the same
    record as every other path."""
    claimed = store.claim(identity("s", "pay.charge"), fp(amount=5), LEASE)
    done = store.complete(claimed.record.key, claimed.record.token, "5", RETENTION)
    ours = {store._pq[name].name.decode() for name in ("claim", "complete_held")}
    assert ours <= _prepared_here(store)
    assert (done.state, done.result, done.attempts) == (State.SUCCEEDED, "5", 1)
    assert done.token == claimed.record.token
    assert store.get(done.key) == done
    again = store.claim(identity("s", "pay.charge"), fp(amount=5), LEASE)
    assert again.record == done  # a replay: the finished record, as stored


def test_a_sync_claim_on_a_killed_connection_is_store_unavailable_and_the_next_one_works(
    store: Spy, url: str
) -> None:
    pids = [held.conn.pgconn.backend_pid for held in store._shelf._idle]
    assert pids
    with psycopg.connect(url, autocommit=True) as admin:
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(StoreUnavailable):
        store.claim(identity("a", "pay.charge"), fp(), LEASE)
    claimed = store.claim(identity("b", "pay.charge"), fp(), LEASE)
    assert claimed.record.state is State.IN_PROGRESS
    assert store.get(identity("a", "pay.charge").key) is None  # the failed claim wrote nothing


def test_a_sync_server_error_is_a_store_error_and_the_connection_serves_on(
    store: Spy, url: str, table: str
) -> None:
    kept = [held.conn for held in store._shelf._idle]
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'DROP TABLE "{table}"')
    with pytest.raises(StoreError) as raised:
        store.claim(identity("s", "a"), fp(), LEASE)
    assert not isinstance(raised.value, StoreUnavailable)
    assert "does not exist" in str(raised.value)
    assert [held.conn for held in store._shelf._idle] == kept  # the server answered: kept
    store.create_tables()
    assert store.claim(identity("s", "b"), fp(), LEASE).record.state is State.IN_PROGRESS


def test_sync_statements_deallocated_or_forgotten_are_prepared_again_or_used(store: Spy) -> None:
    from idempotency.stores import pq_async

    store.claim(identity("s", "a"), fp(), LEASE)
    for held in store._shelf._idle:
        held.conn.execute("DEALLOCATE ALL")  # gone from the session, still listed here
    assert store.claim(identity("s", "b"), fp(), LEASE).record.state is State.IN_PROGRESS
    for held in store._shelf._idle:
        pq_async._prepared.pop(held.conn, None)  # forgotten here, still in the session
    assert store.claim(identity("s", "c"), fp(), LEASE).record.state is State.IN_PROGRESS


def test_sync_writes_without_prepared_statements_prepare_nothing(
    url: str, table: str, clock: FakeClock
) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(
        url.replace("postgresql://", "postgresql+psycopg://"), connect_args={"prepare_threshold": None}
    )
    store = SqlStore(engine, clock=clock, table_name=table)
    try:
        for i in range(8):  # past psycopg's own threshold (5), were it on
            claimed = store.claim(identity("s", f"e{i}"), fp(), LEASE)
            store.complete(claimed.record.key, claimed.record.token, "1", RETENTION)
        assert _prepared_here(store) == set()
    finally:
        store.close()
        engine.dispose()


class _Interrupted(BaseException):
    """What a signal handler raises in the middle of a blocking wait (as Ctrl-C does)."""


def test_an_interrupted_sync_claim_throws_its_connection_away(store: Spy, url: str, table: str) -> None:
    """The wait for the reply is a Python ``poll``: a signal interrupts it, and the connection, its
    reply unread, is not used again."""
    import os
    import signal
    import threading

    holder = RowHolder(url, table, identity("s", "pay.charge").key)
    kept = len(store._shelf._idle)

    def interrupt(*_: object) -> None:
        raise _Interrupted

    def signal_when_waiting() -> None:
        for _ in range(2000):
            if holder.waiting() == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            threading.Event().wait(0.005)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    sender = threading.Thread(target=signal_when_waiting)
    sender.start()
    try:
        with pytest.raises(_Interrupted):
            store.claim(identity("s", "pay.charge"), fp(), LEASE)
    finally:
        sender.join()
        signal.signal(signal.SIGUSR1, previous)
        holder.rollback()
    assert len(store._shelf._idle) == kept - 1
    assert store.claim(identity("t", "pay.charge"), fp(), LEASE).record.state is State.IN_PROGRESS
