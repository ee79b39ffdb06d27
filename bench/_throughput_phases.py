"""The phases of the throughput yardstick, each run in a process of its own by bench/throughput.py.

A phase loads one backend: the guarded new call and its floor at every concurrency level,
alternating which goes first from one round to the next, then counts what one call costs the
database (statements, commits, WAL) with one client, where counting is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from _common import RETENTION, run_tag
from _load import Window, run_tasks, run_threads
from _subjects import Subject, guard_subject, postgres_floor, redis_floor, sqlite_floor

from sagaguard.idempotency import Guard, MemoryStore

THREADS = (1, 8, 32, 128)
TASKS = (64, 256)
REDIS_CONNECTIONS = 512
"""The Redis clients' pool bound (redis-py's default, 100, is below the 128-thread level)."""
SAGA_STEPS = 5
"""No-op steps per saga in the saga series (its rate is given in steps per second)."""


@dataclass(frozen=True)
class Settings:
    """One run's settings, passed to each phase process as JSON."""

    quick: bool = False
    seconds: float = 1.5
    """Length of one measured window; a series is ``rounds`` windows."""
    rounds: int = 2
    redis_url: str = "redis://127.0.0.1:6379/0"
    pg_url: str = "postgresql://postgres@127.0.0.1:5432/test"

    @property
    def window(self) -> float:
        return 0.1 if self.quick else self.seconds

    @property
    def repeats(self) -> int:
        return 1 if self.quick else self.rounds

    @property
    def counted(self) -> int:
        """Calls in a counting session (Postgres: two sessions, this many and five times more)."""
        return 10 if self.quick else 60


@dataclass
class Result:
    """What a phase reports: ``rows[series][level][who]`` summaries, and counts per call."""

    rows: dict[str, dict[str, dict[str, dict[str, float]]]] = field(default_factory=dict)
    counts: dict[str, dict[str, float]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class _Starts:
    """Disjoint index ranges, one per window, so no two windows ever share a key."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self) -> int:
        self._next += 10_000_000
        return self._next


def _levels(
    subjects: dict[str, Subject],
    cfg: Settings,
    *,
    tasks: bool = True,
    threads: tuple[int, ...] = THREADS,
    starts: _Starts | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """Every subject at every level, ``cfg.repeats`` windows each, in alternating order (``starts``:
    the key ranges, shared by calls that load the same subjects again)."""
    starts = starts or _Starts()
    names = list(subjects)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:  # warm-up: connections made, code paths compiled, caches filled
        run_threads(subjects[name].sync, 4, min(0.3, cfg.window), starts())
    for clients in threads:
        found = {name: Window() for name in names}
        for r in range(cfg.repeats):
            for name in names[r % 2 :] + names[: r % 2]:
                found[name].merge(run_threads(subjects[name].sync, clients, cfg.window, starts()))
        out[f"threads.{clients}"] = {name: w.summary() for name, w in found.items()}
    if tasks:
        out.update(asyncio.run(_task_levels(subjects, cfg, starts)))
    return out


async def _task_levels(
    subjects: dict[str, Subject], cfg: Settings, starts: _Starts
) -> dict[str, dict[str, dict[str, float]]]:
    names = list(subjects)
    ops = {}
    closers = []
    for name in names:
        op, close = await subjects[name].make_async()
        ops[name] = op
        closers.append(close)
        await run_tasks(op, 8, min(0.3, cfg.window), starts())
    out: dict[str, dict[str, dict[str, float]]] = {}
    for clients in TASKS:
        found = {name: Window() for name in names}
        for r in range(cfg.repeats):
            for name in names[r % 2 :] + names[: r % 2]:
                found[name].merge(await run_tasks(ops[name], clients, cfg.window, starts()))
        out[f"tasks.{clients}"] = {name: w.summary() for name, w in found.items()}
    for close in closers:
        done = close()
        if asyncio.iscoroutine(done):
            await done
    return out


# ------------------------------------------------------------------------------------ backends


@contextlib.contextmanager
def _pg_database(cfg: Settings) -> Iterator[tuple[str, str]]:
    """A fresh Postgres database for the phase (URL, name), dropped afterwards."""
    import psycopg

    name = f"sgtp_{os.getpid()}"
    base = cfg.pg_url.rsplit("/", 1)[0]
    with psycopg.connect(cfg.pg_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{base}/{name}", name
    finally:
        with psycopg.connect(cfg.pg_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _pg_stat(cfg: Settings, sql: str, *args: Any) -> int:
    """One number read on a fresh connection to the admin database (never the bench's own)."""
    import psycopg

    with psycopg.connect(cfg.pg_url, autocommit=True) as conn:
        row = conn.execute(sql, args).fetchone()
    assert row is not None
    return int(row[0])


def _pg_counts(
    cfg: Settings, url: str, dbname: str, make: Callable[[], tuple[Subject, Callable[[], None]]]
) -> dict[str, float]:
    """Commits and WAL bytes per call of the subject ``make`` builds, one client, sequential.

    Commits: ``pg_stat_database.xact_commit`` of the phase's own database, which a backend reports
    when it exits; so each session closes its connections, and the figure is the difference of
    two sessions (``n`` and ``5 n`` calls), which cancels whatever a session costs to open and
    close. WAL: ``pg_current_wal_lsn()`` around ``n`` calls, the least of three tries (the
    server is shared: other sessions' WAL can only add).
    """
    commits_sql = "SELECT xact_commit FROM pg_stat_database WHERE datname = %s"
    lsn_sql = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint"
    n = cfg.counted
    start = 2 * 10**12

    def session(calls: int, wal: bool = False) -> int:
        nonlocal start
        subject, close = make()
        subject.sync(start)  # the session's connections made before anything is counted
        before = _pg_stat(cfg, lsn_sql) if wal else 0
        for i in range(calls):
            subject.sync(start + 1 + i)
        after = _pg_stat(cfg, lsn_sql) if wal else 0
        start += calls + 1
        close()
        return after - before

    def committed() -> int:
        time.sleep(0.5)  # the closed backends report their counters as they exit
        return _pg_stat(cfg, commits_sql, dbname)

    c0 = committed()
    session(n)
    c1 = committed()
    session(5 * n)
    c2 = committed()
    wal = min(session(n, wal=True) for _ in range(3))
    return {"commits": ((c2 - c1) - (c1 - c0)) / (4 * n), "wal_bytes": wal / n}


class _Tracer:
    """Counts sqlite3 statements and commits, per connection, while :attr:`on`.

    A commit is a COMMIT (or END) ending a BEGIN, or a write statement run outside one: in
    autocommit every such statement is a transaction of its own, and commits itself.
    """

    def __init__(self) -> None:
        self.on = False
        self.statements = 0
        self.commits = 0

    def callback(self) -> Callable[[str], None]:
        """A trace callback for one connection (it tracks that connection's transaction)."""
        inside = [False]

        def trace(statement: str) -> None:
            if not self.on:
                return
            self.statements += 1
            verb = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else ""
            if verb == "BEGIN":
                inside[0] = True
            elif verb in ("COMMIT", "END"):
                inside[0] = False
                self.commits += 1
            elif verb == "ROLLBACK":
                inside[0] = False
            elif not inside[0] and verb in ("INSERT", "UPDATE", "DELETE", "REPLACE"):
                self.commits += 1

        return trace

    def count(self, op: Callable[[int], object], n: int) -> dict[str, float]:
        """Statements and commits per call of ``op``, one client, ``n`` calls in a row."""
        op(10**12)
        self.statements = self.commits = 0
        self.on = True
        for i in range(n):
            op(10**12 + 1 + i)
        self.on = False
        return {"statements": self.statements / n, "commits": self.commits / n}


def _sqlite_counts(
    url: str, floor: Subject, tracer: _Tracer, n: int, tag: str
) -> dict[str, dict[str, float]]:
    """Statements and commits per call of ``floor`` (made with ``tracer``'s callbacks) and of a
    guard on a store whose engine's connections ``tracer`` watches (the statements do not depend
    on the pool)."""
    from sqlalchemy import event

    from sagaguard.idempotency.stores.sql import SqlStore, make_engine

    engine = make_engine(url)
    event.listen(engine, "connect", lambda dbapi, _rec: dbapi.set_trace_callback(tracer.callback()))
    store = SqlStore(engine, table_name="bench_tp_effects")
    guard = Guard(store, namespace="bench", retention=RETENTION)
    try:
        subjects = {"floor": floor, "guard": guard_subject(guard, f"{tag}-n")}
        return {name: tracer.count(subject.sync, n) for name, subject in subjects.items()}
    finally:
        guard.close()
        store.close()
        engine.dispose()


def sql_phase(kind: str, cfg: Settings) -> Result:
    """Guarded new calls against the two-commit floor on ``kind`` (``sqlite`` or ``postgres``)."""
    import tempfile

    from sagaguard.idempotency.stores.sql import SqlStore

    result = Result()
    tag = run_tag()
    with contextlib.ExitStack() as stack:
        if kind == "sqlite":
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="sgtp-"))
            url, dbname = f"sqlite:///{tmp}/sagaguard.db", ""
            result.info["sqlite_version"] = sqlite3.sqlite_version
        else:
            url, dbname = stack.enter_context(_pg_database(cfg))
            result.info["postgres_version"] = str(_pg_stat(cfg, "SHOW server_version_num"))
        tracer = _Tracer()
        # A store opened from its URL, as users open one (its own pool, in which its threads keep
        # their connections); SQLite's statements are counted on a second store (_sqlite_counts).
        store = SqlStore(url, table_name="bench_tp_effects")
        guard = Guard(store, namespace="bench", retention=RETENTION)
        floor = (
            sqlite_floor(url.removeprefix("sqlite:///"), tag, tracer.callback)
            if kind == "sqlite"
            else postgres_floor(url, tag)
        )
        subjects = {"floor": floor, "guard": guard_subject(guard, tag)}
        try:
            result.rows["guard"] = _levels(subjects, cfg)
            if kind == "sqlite":
                result.counts.update(_sqlite_counts(url, floor, tracer, cfg.counted, tag))
        finally:
            guard.close()
            store.close()
            floor.close()
        if kind == "postgres":

            def make_guard() -> tuple[Subject, Callable[[], None]]:
                s = SqlStore(url, table_name="bench_tp_effects")
                g = Guard(s, namespace="bench", retention=RETENTION)

                def close() -> None:
                    g.close()
                    s.close()

                return guard_subject(g, f"{tag}-c{time.monotonic_ns()}"), close

            def make_floor() -> tuple[Subject, Callable[[], None]]:
                f = postgres_floor(url, f"{tag}-c{time.monotonic_ns()}")
                return f, f.close

            result.counts["floor"] = _pg_counts(cfg, url, dbname, make_floor)
            result.counts["guard"] = _pg_counts(cfg, url, dbname, make_guard)
        result.rows["saga"] = _saga_levels(kind, url, cfg, tag)
        result.rows["outbox"] = _outbox_levels(kind, url, cfg, tag)
    return result


def _saga_levels(kind: str, url: str, cfg: Settings, tag: str) -> dict[str, dict[str, dict[str, float]]]:
    """Sagas of :data:`SAGA_STEPS` no-op steps against as many one-row commits, threads only.

    Rates are per step (per commit for the floor): a saga's run counts ``SAGA_STEPS`` calls.
    """
    from _subjects import noop_sagas, sql_commits_floor

    from sagaguard.saga.journals.sql import SqlJournal

    journal = SqlJournal(url)
    saga = noop_sagas(journal, SAGA_STEPS, tag)
    floor = sql_commits_floor(kind, url, f"{tag}-sf", SAGA_STEPS)
    saga_subject = Subject(saga, floor.make_async)
    try:
        rows = _levels({"floor": floor, "saga": saga_subject}, cfg, tasks=False)
    finally:
        journal.close()
        floor.close()
    for level in rows.values():  # per step, not per saga
        for summary in level.values():
            summary["rate"] *= SAGA_STEPS
            summary["cpu_us"] /= SAGA_STEPS
    return rows


def _outbox_levels(kind: str, url: str, cfg: Settings, tag: str) -> dict[str, dict[str, dict[str, float]]]:
    """Outbox enqueue + relay delivery against a business transaction's floor, threads only.

    sagaguard: each call is one business transaction through a SQLAlchemy ``Session`` (INSERT an
    order row, :meth:`Outbox.enqueue` one message, commit), while one :class:`Relay` in a thread of
    the same process delivers to a no-op handler (its own connection pool, batches of 100). The
    floor: the same order row and a two-column message row INSERTed on the bare driver in one
    commit, then that message marked delivered in a second commit (its delivery), per call. Each
    summary carries ``delivered``: messages the relay delivered per second over the series.
    """
    import sqlalchemy as sa
    from _subjects import outbox_floor
    from sqlalchemy.orm import Session

    from sagaguard.idempotency.outbox import Outbox, Relay, RelaySettings, create_tables
    from sagaguard.idempotency.stores.sql import make_engine

    engine = make_engine(url)
    orders = sa.Table(
        "bench_tp_orders", sa.MetaData(), sa.Column("id", sa.String, primary_key=True),
        sa.Column("total", sa.Integer, nullable=False),
    )  # fmt: skip
    table = "bench_tp_outbox"
    with engine.begin() as conn:
        orders.create(conn, checkfirst=True)
    create_tables(engine, table)
    outbox = Outbox(table)
    delivered = [0]

    def handler(message: Any) -> None:
        delivered[0] += 1

    outbox.register("order.paid", handler)
    relay = Relay(outbox, make_engine(url), RelaySettings(purge_every=None, poll_interval=0.05))

    def enqueue(i: int) -> object:
        with Session(engine) as session:
            key = f"{tag}-o{i}"
            session.execute(orders.insert().values(id=key, total=i))
            outbox.enqueue(session, "order.paid", {"order": key}, aggregate_type="order", aggregate_id=key)
            session.commit()
        return i

    floor = outbox_floor(kind, url, f"{tag}-of")
    subject = Subject(enqueue, floor.make_async)
    relay.start()
    starts = _Starts()
    try:
        rows: dict[str, dict[str, dict[str, float]]] = {}
        for clients in THREADS:
            before, started = delivered[0], time.perf_counter()
            subjects = {"floor": floor, "outbox": subject}
            level = _levels(subjects, cfg, tasks=False, threads=(clients,), starts=starts)
            rate = (delivered[0] - before) / (time.perf_counter() - started)
            for summary in level[f"threads.{clients}"].values():
                summary["delivered"] = rate
            rows.update(level)
    finally:
        relay.close()
        floor.close()
        engine.dispose()
    return rows


def redis_phase(cfg: Settings) -> Result:
    """Guarded new calls against SET NX + SET on Redis."""
    import redis
    from _redis import _cleanup

    from sagaguard.idempotency.stores.redis import RedisStore

    result = Result()
    tag = run_tag()
    prefix = f"sgtp{os.getpid()}"
    # The store opened from its URL, as a user opens it (its own client: threads keep connections),
    # with a pool as big as the floor's, so that neither side waits for a connection (the docs say
    # so). The client here only reads the server's version and removes the keys afterwards.
    client = redis.Redis.from_url(cfg.redis_url, decode_responses=True)
    result.info["redis_version"] = client.info("server").get("redis_version")
    result.info["redis_py"] = redis.__version__
    store = RedisStore(cfg.redis_url, prefix=prefix, max_connections=REDIS_CONNECTIONS)
    guard = Guard(store, namespace="bench", retention=RETENTION)
    floor = redis_floor(cfg.redis_url, prefix, REDIS_CONNECTIONS)
    try:
        result.rows["guard"] = _levels({"floor": floor, "guard": guard_subject(guard, tag)}, cfg)
    finally:
        guard.close()
        floor.close()
        result.info["redis_keys_removed"] = _cleanup(client, f"{prefix}:*")
        client.close()
    return result


def memory_phase(cfg: Settings) -> Result:
    """The guard's own CPU: new calls on the memory store, one thread and 64 tasks."""
    result = Result()
    guard = Guard(MemoryStore(), namespace="bench", retention=RETENTION)
    subject = guard_subject(guard, run_tag())
    try:
        rows = _levels({"guard": subject}, cfg, tasks=True, threads=(1,))
    finally:
        guard.close()
    result.rows["guard"] = {level: row for level, row in rows.items() if level in ("threads.1", "tasks.64")}
    return result


def run(name: str, cfg: Settings) -> Result:
    """The phase called ``name``."""
    if name == "redis":
        return redis_phase(cfg)
    if name == "memory":
        return memory_phase(cfg)
    return sql_phase(name, cfg)
