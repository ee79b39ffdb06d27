"""Client CPU of one guarded new call's store work, paired against the floor's, one thread.

::

    .venv/bin/python bench/store_cpu.py                       # Postgres, SQLite, Redis
    .venv/bin/python bench/store_cpu.py --backends postgres --profile 20
    .venv/bin/python bench/store_cpu.py --saga               # saga steps: Postgres, SQLite, Redis

For each backend, blocks of ``--pairs`` store claims each followed by its ``complete`` (a new key
every time) alternate with blocks of as many floor calls (bench/_subjects.py: an INSERT commit and
an UPDATE commit, or SET NX + SET), ``--rounds`` times, so machine load falls on both alike; each
block's figure is ``time.process_time`` over the block divided by its pairs. Prints the median and
the range of each, and of the guarded call (``Guard.effect`` around a no-op: the claim, the record
and the guard's own work). ``--profile N`` prints the top N functions of a cProfile of one block of
guarded calls instead (cumulative time). ``--saga`` measures saga steps instead: sagas of 5 no-op
steps (``SagaRunner.run`` on a ``SqlJournal`` or a ``RedisJournal`` opened from its URL, a fresh
saga id per run) against as many one-row commits by the floor's client (Redis: as many SETs), per
step (the throughput yardstick's saga series, on one thread).
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from _common import RETENTION
from _subjects import noop_sagas, postgres_floor, redis_floor, sql_commits_floor, sqlite_floor

from sagaguard.idempotency import Guard, scope
from sagaguard.idempotency.keys import EffectIdentity


def _cpu(fn: Callable[[int], object], n: int, start: int) -> float:
    t0 = time.process_time()
    for i in range(start, start + n):
        fn(i)
    return (time.process_time() - t0) / n * 1e6


def subjects(backend: str, args: argparse.Namespace, tmp: str, tag: str) -> tuple[Any, Any]:
    if backend == "postgres":
        from sagaguard.idempotency.stores.sql import SqlStore

        store = SqlStore(args.pg_url, table_name=f"bench_cpu_{tag}")
        return store, postgres_floor(args.pg_url, f"cpu-{tag}")
    if backend == "sqlite":
        from sagaguard.idempotency.stores.sql import SqlStore

        path = os.path.join(tmp, f"{tag}.db")
        store = SqlStore(f"sqlite:///{path}")
        return store, sqlite_floor(os.path.join(tmp, f"{tag}-floor.db"), f"cpu-{tag}")
    from sagaguard.idempotency.stores.redis import RedisStore

    store = RedisStore(args.redis_url, prefix=f"bench-cpu-{tag}")
    return store, redis_floor(args.redis_url, f"bench-cpu-{tag}", 16)


def statements(
    backend: str, args: argparse.Namespace, tmp: str, tag: str
) -> tuple[Callable[[int], object], Callable[[], None]] | None:
    """The store's own claim and record statements (a new key: the claim, then ``complete_held``,
    their rows fetched) on the bare driver, as the floor's client sends its own: what the table's
    layout costs the client without the store's code. Returns the call and what closes its
    connection (SQL backends; None on Redis, whose floor is the client the store runs on)."""
    if backend == "redis":
        return None
    import sqlite3

    import sqlalchemy as sa

    from sagaguard.idempotency.backends.sql_driver import Statement
    from sagaguard.idempotency.stores.sql_statements import effect_statements

    postgres = backend == "postgres"
    dialect = sa.create_engine(args.pg_url if postgres else "sqlite://").dialect
    table = dialect.identifier_preparer.quote(f"bench_cpu_{tag}" if postgres else "sagaguard_effects")
    texts = effect_statements(table, dialect.name, bound_now=not postgres)
    claim, record = (
        Statement(texts[n], dialect) for n in ("claim" if postgres else "insert", "complete_held")
    )
    run_id = uuid.uuid4().hex[:8]
    conn: Any
    if postgres:
        conn = psycopg.connect(args.pg_url, autocommit=True, cursor_factory=psycopg.RawCursor)
    else:
        conn = sqlite3.connect(os.path.join(tmp, f"{tag}.db"), isolation_level=None, timeout=30)
        for pragma in ("journal_mode = WAL", "synchronous = FULL"):
            conn.execute(f"PRAGMA {pragma}")

    def pair(i: int) -> object:
        ident = EffectIdentity.of("bench", f"{run_id}-r{i}", "cpu", 0)
        params: dict[str, Any] = {
            "key": ident.key, "namespace": ident.namespace, "scope": ident.scope, "name": ident.name,
            "ordinal": ident.ordinal, "fingerprint": "f" * 64, "lease": 30.0, "first_token": 7,
            "holder": "bench-host:1:1", "result": "null", "token": 7, "retention": RETENTION,
        }  # fmt: skip
        if not postgres:
            now = time.time()
            params.update(now=now, lease_until=now + 30.0)
        for statement in (claim, record):
            values = statement.values(params)
            rows = (
                conn.execute(statement.sql, values, prepare=True)
                if postgres
                else conn.execute(statement.sql, values)
            )
            rows.fetchall()  # SQLite finishes a RETURNING statement (and commits) only then
        return i

    return pair, conn.close


SAGA_STEPS = 5


def run_saga(backend: str, args: argparse.Namespace, tmp: str) -> None:
    """Client CPU per saga step against per one-row commit (see the module)."""
    from sagaguard.saga.journals.sql import SqlJournal

    tag = uuid.uuid4().hex[:8]
    journal: Any
    if backend == "postgres":
        journal = SqlJournal(args.pg_url, table_prefix=f"bench_cpu_{tag}_")
        floor = sql_commits_floor(backend, args.pg_url, f"cpu-{tag}", SAGA_STEPS)
    elif backend == "sqlite":
        journal = SqlJournal(f"sqlite:///{os.path.join(tmp, f'{tag}.db')}")
        floor = sql_commits_floor(backend, f"sqlite:///{tmp}/{tag}-floor.db", f"cpu-{tag}", SAGA_STEPS)
    else:  # a step is one script; its floor one SET per step
        from sagaguard.saga.journals.redis import RedisJournal

        journal = RedisJournal(args.redis_url, prefix=f"bench-cpu-j-{tag}")
        floor = _redis_sets(args.redis_url, f"bench-cpu-j-{tag}", SAGA_STEPS)
    saga = noop_sagas(journal, SAGA_STEPS, tag)

    n = max(1, args.pairs // SAGA_STEPS)
    counter = [0]

    def block(fn: Callable[[int], object]) -> float:
        counter[0] += n
        return _cpu(fn, n, counter[0]) / SAGA_STEPS

    for fn in (saga, floor.sync):
        block(fn)
    got: dict[str, list[float]] = {"floor": [], "saga": []}
    for r in range(args.rounds):
        order = [("floor", floor.sync), ("saga", saga)]
        for name, fn in order if r % 2 else reversed(order):
            got[name].append(block(fn))
    med = {k: statistics.median(v) for k, v in got.items()}
    print(
        f"{backend}: client CPU per saga step (floor: per commit), median (min-max) of {args.rounds} "
        f"blocks of {n} sagas: "
        + "; ".join(f"{k} {med[k]:.0f} ({min(v):.0f}-{max(v):.0f}) µs" for k, v in got.items())
        + f"; saga - floor {med['saga'] - med['floor']:+.0f} µs"
    )
    floor.close()
    journal.close()
    journal_tables = [f"bench_cpu_{tag}_{name}" for name in ("sagas", "saga_steps", "saga_signals")]
    clean(backend, args, tag, tables=journal_tables)


def clean(backend: str, args: argparse.Namespace, tag: str, *, tables: list[str]) -> None:
    """Remove what a run wrote to the shared servers: its tables and floor rows (Postgres), its
    keys (Redis). SQLite's files go with the temporary directory."""
    if backend == "postgres":
        with psycopg.connect(args.pg_url, autocommit=True) as conn:
            for table in tables:
                conn.execute(f'DROP TABLE IF EXISTS "{table}"')
            conn.execute("DELETE FROM bench_tp_floor WHERE k LIKE %s", (f"cpu-{tag}-%",))
    elif backend == "redis":
        import redis

        client = redis.Redis.from_url(args.redis_url)
        try:
            for key in client.scan_iter(match=f"bench-cpu-*{tag}*", count=1000):
                client.delete(key)
        finally:
            client.close()


def _redis_sets(url: str, prefix: str, n: int) -> Any:
    """``n`` SETs of one key in a row, redis-py: the Redis journal's floor per saga of ``n`` steps."""
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)

    class Floor:
        @staticmethod
        def sync(i: int) -> object:
            for step in range(n):
                client.set(f"{prefix}:floor:{i}", str(step), px=int(RETENTION * 1000))
            return i

        close = client.close

    return Floor()


def store_pair(store: Any, run_id: str) -> Callable[[int], object]:
    """The store's work for call ``i``: a claim of a new key, then its ``complete``."""

    def pair(i: int) -> object:
        ident = EffectIdentity.of("bench", f"{run_id}-{i}", "cpu", 0)
        claimed = store.claim(ident, "f" * 64, 30.0)
        return store.complete(ident.key, claimed.record.token, "null", RETENTION)

    return pair


def guarded_noop(guard: Guard, run_id: str) -> Callable[[int], object]:
    """Guarded new call ``i``: ``Guard.effect`` around a no-op, in a scope of its own."""
    noop = guard.effect("bench.cpu")(lambda i: i)

    def guarded(i: int) -> object:
        with scope(f"{run_id}-g{i}"):
            return noop(i)

    return guarded


def run(backend: str, args: argparse.Namespace, tmp: str) -> None:
    tag = uuid.uuid4().hex[:8]
    store, floor = subjects(backend, args, tmp, tag)
    guard = Guard(store)
    run_id = uuid.uuid4().hex[:8]
    pair = store_pair(store, run_id)
    guarded = guarded_noop(guard, run_id)

    n = args.pairs
    counter = [0]

    def block(fn: Callable[[int], object]) -> float:
        counter[0] += n
        return _cpu(fn, n, counter[0])

    bare = statements(backend, args, tmp, tag)
    series: dict[str, Callable[[int], object]] = {"floor": floor.sync}
    if bare is not None:
        series["statements"] = bare[0]
    series.update(store=pair, guarded=guarded)
    for fn in series.values():  # warm-up: prepared statements, pools, caches
        block(fn)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        block(guarded)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    else:
        got: dict[str, list[float]] = {name: [] for name in series}
        for r in range(args.rounds):
            order = list(series.items())
            if r % 2:
                order.reverse()
            for name, fn in order:
                got[name].append(block(fn))
        med = {k: statistics.median(v) for k, v in got.items()}
        steps = list(med)
        print(
            f"{backend}: client CPU per call, median (min-max) of {args.rounds} blocks of {n}: "
            + "; ".join(f"{k} {med[k]:.0f} ({min(v):.0f}-{max(v):.0f}) µs" for k, v in got.items())
            + f"; guarded - floor {med['guarded'] - med['floor']:+.0f} µs ("
            + ", ".join(f"{b} - {a} {med[b] - med[a]:+.0f}" for a, b in itertools.pairwise(steps))
            + ")"
        )
    if bare is not None:
        bare[1]()
    floor.close()
    store.close()
    clean(backend, args, tag, tables=[f"bench_cpu_{tag}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="postgres,sqlite,redis")
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--profile", type=int, default=0)
    parser.add_argument("--saga", action="store_true", help="saga steps instead")
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/5")
    args = parser.parse_args()
    print(f"load: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            if args.saga:
                run_saga(backend, args, tmp)
            else:
                run(backend, args, tmp)
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
