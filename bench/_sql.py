"""SQLite and Postgres phases: guarded calls against two raw commits, and DBOS on the same database.

Two floors, each an INSERT commit then an UPDATE commit of one row of the very table layout the
store uses (same columns, same indexes, made by the store's own model):

- ``floor_core``: SQLAlchemy Core ``insert()``/``update()``, each in ``engine.begin()``, on the
  engine :func:`sagaguard.idempotency.stores.sql.make_engine` builds (the store's engine, shared).
- ``floor_raw``: the bare driver. sqlite3 with the same pragmas and ``BEGIN IMMEDIATE``; psycopg 3
  in autocommit (one round trip, one commit per statement: the physical minimum).

SQLite runs in a temporary directory; Postgres in a database created for the run and dropped after.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter_ns
from typing import Any

import sqlalchemy as sa
from _cases import async_cases, store_cases
from _common import DBOS_ROUNDS, RETENTION, Config, PhaseResult, noop, run_tag
from _harness import Case, interleave, interleave_async, stats

from sagaguard.idempotency import Guard, scope
from sagaguard.idempotency.stores.sql import SqlStore, make_engine

_FP = "f1_" + "0" * 64


def _row(key: str, scope_id: str) -> dict[str, Any]:
    now = time.time()
    return {
        "key": key, "namespace": "bench", "scope": scope_id, "name": "bench.noop", "ordinal": 0,
        "fingerprint": _FP, "state": "in_progress", "token": 1, "lease_until": now + 60,
        "attempts": 1, "created_at": now, "updated_at": now,
    }  # fmt: skip


@contextmanager
def _database(kind: str, cfg: Config) -> Iterator[str]:
    """A fresh database URL for the phase, removed afterwards."""
    if kind == "sqlite":
        with tempfile.TemporaryDirectory(prefix="sgbench-") as tmp:
            yield f"sqlite:///{tmp}/sagaguard.db"
        return
    import psycopg

    name = f"sgbench_{os.getpid()}"
    base = cfg.pg_url.rsplit("/", 1)[0]
    with psycopg.connect(cfg.pg_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(cfg.pg_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _core_floor(engine: sa.Engine, tag: str) -> Case:
    table = SqlStore(engine, table_name="bench_floor_core")._table  # same layout as the store's
    insert = table.insert()
    update = table.update().where(table.c.key == sa.bindparam("k"))

    def floor(i: int) -> int:
        row = _row(f"{tag}-{i}", f"{tag}-{i}")
        done = {"k": row["key"], "state": "succeeded", "result": "0",
                "expires_at": row["created_at"] + RETENTION, "updated_at": row["created_at"]}  # fmt: skip
        t0 = perf_counter_ns()
        with engine.begin() as conn:
            conn.execute(insert, row)
        with engine.begin() as conn:
            conn.execute(update, done)
        return perf_counter_ns() - t0

    return floor


_INSERT = (
    "INSERT INTO bench_floor_raw (key, namespace, scope, name, ordinal, fingerprint, state, token, "
    "lease_until, attempts, created_at, updated_at) VALUES ({})"
)
_UPDATE = (
    "UPDATE bench_floor_raw SET state = 'succeeded', result = {0}, expires_at = {0}, "
    "updated_at = {0} WHERE key = {0}"
)


def _raw_floor(kind: str, url: str, engine: sa.Engine, tag: str) -> tuple[Case, Callable[[], None]]:
    SqlStore(engine, table_name="bench_floor_raw")  # creates the table, same layout
    if kind == "sqlite":
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)
        for pragma in ("busy_timeout = 30000", "journal_mode = WAL", "synchronous = FULL"):
            conn.execute(f"PRAGMA {pragma}")
        ins, upd = _INSERT.format(", ".join("?" * 12)), _UPDATE.format("?")

        def floor(i: int) -> int:
            row = _row(f"{tag}-{i}", f"{tag}-{i}")
            args = tuple(row.values())
            done = ("0", row["created_at"] + RETENTION, row["created_at"], row["key"])
            t0 = perf_counter_ns()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(ins, args)
            conn.execute("COMMIT")
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(upd, done)
            conn.execute("COMMIT")
            return perf_counter_ns() - t0

        return floor, conn.close

    import psycopg

    pconn = psycopg.connect(url, autocommit=True)
    ins, upd = _INSERT.format(", ".join(["%s"] * 12)), _UPDATE.format("%s")

    def pg_floor(i: int) -> int:
        row = _row(f"{tag}-{i}", f"{tag}-{i}")
        args = tuple(row.values())
        done = ("0", row["created_at"] + RETENTION, row["created_at"], row["key"])
        t0 = perf_counter_ns()
        pconn.execute(ins, args)
        pconn.execute(upd, done)
        return perf_counter_ns() - t0

    return pg_floor, pconn.close


def _guard_cases(guard: Guard, tag: str, total: int) -> dict[str, Case]:
    guarded = guard.effect("bench.noop")(noop)
    for i in range(total):
        with scope(f"{tag}-r{i}"):
            guarded(i)

    def new(i: int) -> int:
        with scope(f"{tag}-n{i}"):
            t0 = perf_counter_ns()
            guarded(i)
            return perf_counter_ns() - t0

    def replay(i: int) -> int:
        with scope(f"{tag}-r{i}"):
            t0 = perf_counter_ns()
            guarded(i)
            return perf_counter_ns() - t0

    return {"new": new, "replay": replay}


def _alone(dbos_url: str, guard: Guard, tag: str, n: int, warm: int) -> dict[str, Any]:
    """A guarded new call and a DBOS step, each with the other absent from the process.

    DBOS runs background threads once launched (queue polling, a notification listener, a
    scheduler), which weigh on whatever else the process runs; a user of either never runs the
    other beside it. So: ``DBOS_ROUNDS`` rounds, each a block of guarded calls with DBOS not
    launched, then DBOS launched, a block of workflows (warm-up, then the timed steps), DBOS
    destroyed. The rounds alternate so that the machine's drift over the run weighs on both.
    """
    from _dbos import dbos_case

    @guard.effect("bench.alone")
    def guarded(i: int) -> int:
        return i

    ours: list[int] = []
    steps: list[int] = []
    per = max(1, n // DBOS_ROUNDS)
    for r in range(DBOS_ROUNDS):
        for i in range(warm + per):
            with scope(f"{tag}-alone{r}-{i}"):
                t0 = perf_counter_ns()
                guarded(i)
                took = perf_counter_ns() - t0
            if i >= warm:
                ours.append(took)
        workflow, step_samples, stop, _ = dbos_case(dbos_url)
        try:
            first = len(step_samples)
            for i in range(warm + per):
                workflow(i)
            steps.extend(step_samples[first + warm :])
        finally:
            stop()
    return {"new": stats(ours), "dbos_step": stats(steps)}


def _million(kind: str, url: str, cfg: Config, result: PhaseResult, tag: str) -> None:
    """New calls on an empty effects table against one holding a million records, interleaved."""
    from _bulk import load_postgres, load_sqlite

    if kind == "sqlite":
        # Two fresh files made alike (the WAL checkpointed and truncated in both), so neither
        # starts with a WAL already grown by earlier phases.
        full_url, empty_url = (url.replace("sagaguard.db", f"{n}.db") for n in ("million", "empty"))
        for made in (full_url, empty_url):
            SqlStore(made).close()
        seconds = load_sqlite(full_url.removeprefix("sqlite:///"), "sagaguard_effects", cfg.million_rows)
        load_sqlite(empty_url.removeprefix("sqlite:///"), "sagaguard_effects", 0)
        full_store, empty_store = SqlStore(full_url), SqlStore(empty_url)
    else:
        full_store = SqlStore(url, table_name="bench_million")
        seconds = load_postgres(url, "bench_million", cfg.million_rows)
        empty_store = SqlStore(url, table_name="bench_empty")
    result.info[f"{kind}_million_load_s"] = round(seconds, 1)
    cases: dict[str, Case] = {}
    guards = []
    for label, store in (("empty", empty_store), ("million", full_store)):
        guard = Guard(store, namespace="bench", retention=RETENTION)
        guards.append(guard)
        fn = guard.effect("bench.noop")(noop)

        def case(i: int, fn: Callable[[int], int] = fn, label: str = label) -> int:
            with scope(f"{tag}-m{label}{i}"):
                t0 = perf_counter_ns()
                fn(i)
                return perf_counter_ns() - t0

        cases[f"{label}_new"] = case
    n = cfg.iterations(kind)
    result.add(f"{kind}.million", interleave(cases, n, warmup=cfg.warmup(kind)))
    for guard in guards:
        guard.close()
    empty_store.close()
    full_store.close()


def _dbos_rollback_journal(url: str, cfg: Config, result: PhaseResult) -> None:
    """DBOS as it comes on SQLite (rollback journal): measured alone, after, with fewer calls."""
    from _dbos import dbos_case

    wf_case, step_samples, stop_dbos, _ = dbos_case(url.replace("sagaguard.db", "dbos-default.db"))
    try:
        n = max(20, cfg.iterations("sqlite") // 5)
        found = interleave({"dbos_workflow_rollback_journal": wf_case}, n, warmup=5)
        found["dbos_step_rollback_journal"] = stats(step_samples[-n:])
        result.add("sqlite", found)
    finally:
        stop_dbos()


def run(kind: str, cfg: Config) -> PhaseResult:
    """The phase for ``kind`` (``sqlite`` or ``postgres``)."""
    from _dbos import dbos_case

    result = PhaseResult()
    tag = run_tag()
    n, warm = cfg.iterations(kind), cfg.warmup(kind)
    with _database(kind, cfg) as url:
        engine = make_engine(url)
        with engine.connect() as conn:
            if kind == "sqlite":
                result.info["sqlite_version"] = sqlite3.sqlite_version
                result.info["sqlite_pragmas"] = "journal_mode=WAL, synchronous=FULL, BEGIN IMMEDIATE"
            else:
                result.info["postgres_version"] = conn.exec_driver_sql("SHOW server_version").scalar()
                result.info["postgres_synchronous_commit"] = conn.exec_driver_sql(
                    "SHOW synchronous_commit"
                ).scalar()
        result.info["sqlalchemy"] = sa.__version__
        store = SqlStore(engine, table_name="bench_effects")
        guard = Guard(store, namespace="bench", retention=RETENTION)
        raw, close_raw = _raw_floor(kind, url, engine, tag)
        dbos_url = url
        if kind == "sqlite":
            # The store's settings: WAL (persisted in the file) and synchronous=FULL (the default).
            dbos_url = url.replace("sagaguard.db", "dbos.db")
            with sqlite3.connect(dbos_url.removeprefix("sqlite:///")) as conn:
                conn.execute("PRAGMA journal_mode = WAL")
        wf_case, step_samples, stop_dbos, dbos_info = dbos_case(dbos_url)
        result.info.update({f"{kind}_{k}": v for k, v in dbos_info.items()})
        try:
            cases: dict[str, Case] = {
                "floor_core": _core_floor(engine, tag),
                "floor_raw": raw,
                **_guard_cases(guard, tag, n + warm),
                **store_cases(store, tag, n + warm),
                "dbos_workflow": wf_case,
            }
            found = interleave(cases, n, warmup=warm)
            found["dbos_step"] = stats(step_samples[-n:])
            result.add(kind, found)
        finally:
            stop_dbos()
            close_raw()
        result.add(f"{kind}.alone", _alone(dbos_url, guard, tag, n, warm))
        if kind == "sqlite":
            _dbos_rollback_journal(url, cfg, result)
        acases, guards = async_cases(store, tag)
        result.add(f"{kind}.async", asyncio.run(interleave_async(acases, n, warmup=warm)))
        for g in (guard, *guards):
            g.close()
        if cfg.million:
            _million(kind, url, cfg, result, tag)
        store.close()
        engine.dispose()
    return result
