"""What the throughput yardstick loads: a guarded new call and its floor, per backend.

The floor is what the same number of clients pay without sagaguard for the same durable work:

- Postgres: an INSERT commit then an UPDATE commit of a two-column row, psycopg 3 in autocommit
  (one round trip and one commit per statement);
- SQLite: the same two commits on sqlite3 with the store's settings (WAL, ``synchronous=FULL``,
  ``BEGIN IMMEDIATE``);
- Redis: SET NX then SET of one key, redis-py.

SQL clients share at most :data:`SQL_CONNECTIONS` connections, as many as the store's engine keeps
by default (SQLAlchemy's ``QueuePool``: 5 + 10 overflow), so the floor and the guard hold the same
number of sessions (and the shared Postgres server's ``max_connections`` is not exceeded).
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from _common import RETENTION, anoop, noop

from sagaguard.idempotency import Guard, scope

SQL_CONNECTIONS = 15
"""Connections the SQL floors share: SQLAlchemy's default pool (5, overflow 10), the store's."""

_FLOOR_TABLE = "CREATE TABLE IF NOT EXISTS bench_tp_floor (k TEXT PRIMARY KEY, v TEXT NOT NULL)"


@dataclass
class Subject:
    """A sync and an async operation of one series; the async one is built on the running loop."""

    sync: Callable[[int], object]
    make_async: Callable[[], Awaitable[tuple[Callable[[int], Awaitable[object]], Callable[[], Any]]]]
    close: Callable[[], None] = lambda: None
    extras: dict[str, Any] = field(default_factory=dict)


def guard_subject(guard: Guard, tag: str) -> Subject:
    """Guarded new calls (no-op body) under a fresh scope each, sync and async, on ``guard``."""
    sync_fn = guard.effect("bench.noop")(noop)
    async_fn = guard.effect("bench.anoop")(anoop)

    def sync(i: int) -> object:
        with scope(f"{tag}-s{i}"):
            return sync_fn(i)

    async def make_async() -> tuple[Callable[[int], Awaitable[object]], Callable[[], Any]]:
        async def call(i: int) -> object:
            with scope(f"{tag}-a{i}"):
                return await async_fn(i)

        return call, lambda: None

    return Subject(sync, make_async)


class _Shared:
    """At most ``size`` connections made by ``connect``, lent one call at a time (thread-safe)."""

    def __init__(self, connect: Callable[[], Any], size: int) -> None:
        self._connect, self._free, self._all = connect, queue.LifoQueue[Any](), []
        self._lock, self._size = threading.Lock(), size

    def take(self) -> Any:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if len(self._all) < self._size:
                conn = self._connect()
                self._all.append(conn)
                return conn
        return self._free.get()

    def give(self, conn: Any) -> None:
        self._free.put(conn)

    def close(self) -> None:
        for conn in self._all:
            conn.close()


def sqlite_floor(path: str, tag: str, trace: Callable[[], Callable[[str], None]] | None = None) -> Subject:
    """Two commits (INSERT, then UPDATE) of a two-column row on sqlite3, the store's settings."""

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        for pragma in ("journal_mode = WAL", "synchronous = FULL"):
            conn.execute(f"PRAGMA {pragma}")
        if trace is not None:
            conn.set_trace_callback(trace())  # one callback per connection
        return conn

    with connect() as conn:
        conn.execute(_FLOOR_TABLE)
    shared = _Shared(connect, SQL_CONNECTIONS)

    def sync(i: int) -> object:
        conn = shared.take()
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO bench_tp_floor (k, v) VALUES (?, 'pending')", (f"{tag}-{i}",))
            conn.execute("COMMIT")
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("UPDATE bench_tp_floor SET v = 'done' WHERE k = ?", (f"{tag}-{i}",))
            conn.execute("COMMIT")
        finally:
            shared.give(conn)
        return i

    async def make_async() -> tuple[Callable[[int], Awaitable[object]], Callable[[], Any]]:
        # sqlite3 has no async interface: the two commits go to a worker thread, as an async
        # application would send them.
        async def call(i: int) -> object:
            return await asyncio.to_thread(sync, i)

        return call, lambda: None

    return Subject(sync, make_async, shared.close, {"shared": shared})


def postgres_floor(url: str, tag: str) -> Subject:
    """Two commits (INSERT, then UPDATE) of a two-column row, psycopg 3 in autocommit."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(_FLOOR_TABLE)
    shared = _Shared(lambda: psycopg.connect(url, autocommit=True), SQL_CONNECTIONS)

    def sync(i: int) -> object:
        conn = shared.take()
        try:
            conn.execute("INSERT INTO bench_tp_floor (k, v) VALUES (%s, 'pending')", (f"{tag}-{i}",))
            conn.execute("UPDATE bench_tp_floor SET v = 'done' WHERE k = %s", (f"{tag}-{i}",))
        finally:
            shared.give(conn)
        return i

    async def make_async() -> tuple[Callable[[int], Awaitable[object]], Callable[[], Any]]:
        free: asyncio.Queue[Any] = asyncio.Queue()
        made = [await psycopg.AsyncConnection.connect(url, autocommit=True) for _ in range(SQL_CONNECTIONS)]
        for conn in made:
            free.put_nowait(conn)

        async def call(i: int) -> object:
            conn = await free.get()
            try:
                await conn.execute(
                    "INSERT INTO bench_tp_floor (k, v) VALUES (%s, 'pending')", (f"{tag}-a{i}",)
                )
                await conn.execute("UPDATE bench_tp_floor SET v = 'done' WHERE k = %s", (f"{tag}-a{i}",))
            finally:
                free.put_nowait(conn)
            return i

        async def close() -> None:
            for conn in made:
                await conn.close()

        return call, close

    return Subject(sync, make_async, shared.close, {"shared": shared})


def redis_floor(url: str, prefix: str, connections: int, client: Any = None) -> Subject:
    """SET NX then SET of one key (with the records' retention as TTL), redis-py sync and asyncio.

    ``client``: the sync side's client (a ``redis.cluster.RedisCluster`` for a cluster), closed
    with the subject; by default one made from ``url``. The sync client is ``extras["client"]``.
    """
    import redis
    import redis.asyncio as aredis

    if client is None:
        client = redis.Redis.from_url(url, decode_responses=True, max_connections=connections)
    ttl = int(RETENTION * 1000)

    def sync(i: int) -> object:
        client.set(f"{prefix}:floor:{i}", "pending", nx=True, px=ttl)
        client.set(f"{prefix}:floor:{i}", "done", px=ttl)
        return i

    async def make_async() -> tuple[Callable[[int], Awaitable[object]], Callable[[], Any]]:
        aclient = aredis.Redis.from_url(url, decode_responses=True, max_connections=connections)

        async def call(i: int) -> object:
            await aclient.set(f"{prefix}:afloor:{i}", "pending", nx=True, px=ttl)
            await aclient.set(f"{prefix}:afloor:{i}", "done", px=ttl)
            return i

        return call, aclient.aclose

    return Subject(sync, make_async, client.close, {"client": client})


def sql_commits_floor(kind: str, url: str, tag: str, commits: int) -> Subject:
    """``commits`` one-row commits in a row (an INSERT, then UPDATEs), the saga series' floor.

    A saga step is one commit, so the floor of a saga of ``commits`` steps is as many commits by
    the same client; sync only (the saga series has no async levels).
    """
    if kind == "sqlite":
        base = sqlite_floor(url.removeprefix("sqlite:///"), tag)
        begin, mark = "BEGIN IMMEDIATE", "?"
    else:
        base = postgres_floor(url, tag)
        begin, mark = "", "%s"
    shared: _Shared = base.extras["shared"]

    def sync(i: int) -> object:
        conn = shared.take()
        try:
            for n in range(commits):
                if begin:
                    conn.execute(begin)
                if n == 0:
                    conn.execute(
                        f"INSERT INTO bench_tp_floor (k, v) VALUES ({mark}, 'pending')", (f"{tag}-{i}",)
                    )
                else:
                    conn.execute(f"UPDATE bench_tp_floor SET v = 'done' WHERE k = {mark}", (f"{tag}-{i}",))
                if begin:
                    conn.execute("COMMIT")
        finally:
            shared.give(conn)
        return i

    return Subject(sync, base.make_async, base.close)


def outbox_floor(kind: str, url: str, tag: str) -> Subject:
    """The outbox series' floor: one business transaction that INSERTs an order row and a
    two-column message row, committed together, then that message marked delivered in a second
    commit (its delivery, one message at a time); on the bare driver, sync only."""
    if kind == "sqlite":
        base = sqlite_floor(url.removeprefix("sqlite:///"), tag)
        begin, mark = "BEGIN IMMEDIATE", "?"
    else:
        base = postgres_floor(url, tag)
        begin, mark = "BEGIN", "%s"
    shared: _Shared = base.extras["shared"]
    conn = shared.take()
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_tp_floor_orders (id TEXT PRIMARY KEY, total INTEGER)")
    finally:
        shared.give(conn)

    def sync(i: int) -> object:
        conn = shared.take()
        key = f"{tag}-{i}"
        try:
            conn.execute(begin)
            conn.execute(f"INSERT INTO bench_tp_floor_orders (id, total) VALUES ({mark}, {mark})", (key, i))
            conn.execute(f"INSERT INTO bench_tp_floor (k, v) VALUES ({mark}, 'pending')", (key,))
            conn.execute("COMMIT")
            if kind == "sqlite":
                conn.execute(begin)
            conn.execute(f"UPDATE bench_tp_floor SET v = 'delivered' WHERE k = {mark}", (key,))
            if kind == "sqlite":
                conn.execute("COMMIT")
        finally:
            shared.give(conn)
        return i

    return Subject(sync, base.make_async, base.close)


def _noop_step(ctx: Any, value: int) -> int:
    """A saga step that does nothing (its context is a ``saga.StepContext``)."""
    return value


def noop_sagas(journal: Any, steps: int, tag: str) -> Callable[[int], object]:
    """A call that runs one saga of ``steps`` no-op steps on ``journal`` (a fresh saga id each call,
    a guard on a memory store) and raises unless it completed: the saga series' subject.
    """
    from sagaguard.idempotency.stores.memory import MemoryStore
    from sagaguard.saga import Saga, SagaRunner, SagaState

    noops: Any = Saga("bench_noops", input=int)
    for k in range(steps):
        noops.step(name=f"s{k}", compensate=None)(_noop_step)
    runner = SagaRunner(journal, Guard(MemoryStore()), wait=0)

    def run(i: int) -> object:
        outcome = runner.run(noops, f"{tag}-saga{i}", i)
        if outcome.state is not SagaState.COMPLETED:
            raise RuntimeError(f"bench saga ended {outcome.state}")
        return outcome

    return run
