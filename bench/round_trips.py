"""What the database pays per call on Postgres: statements (round trips), commits and WAL bytes.

::

    .venv/bin/python bench/round_trips.py            # prints a markdown table
    .venv/bin/python bench/round_trips.py --calls 500

Starts a Postgres cluster of its own (``initdb`` and ``pg_ctl`` from /usr/lib/postgresql/*/bin, a
free port, a temporary directory, removed afterwards) with ``pg_stat_statements`` loaded, which the
shared server does not load; then, one client at a time, counts for ``--calls`` guarded new calls
(a default ``Guard`` on a ``SqlStore``), for as many calls of the floor (an INSERT commit and an
UPDATE commit of a two-column row, psycopg in autocommit), and for sagas of five no-op steps:

- statements: ``sum(calls)`` of ``pg_stat_statements`` (``BEGIN`` and ``COMMIT`` included); each is
  one round trip, as every statement here is sent alone (no pipeline);
- commits: ``pg_stat_database.xact_commit`` of the counted database;
- WAL bytes: the bytes of the WAL records written meanwhile (``pg_walinspect``), full-page images
  and the server's background records left out.

Each figure is the difference of two sessions (``n`` and ``5 n`` calls) in a fresh database, each
closed and its backends gone before the counters are read, autovacuum off meanwhile, the keys named
the same on every run (:func:`count`): statements and commits come out the same on every run, WAL
bytes within a few bytes per call (a claim names its holder's process id and start time, whose
digits vary, and an UPDATE's record holds only the bytes of the row that changed). Run as root, the cluster
runs as the ``postgres`` user.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import RETENTION
from _subjects import guard_subject, postgres_floor


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise SystemExit(f"no {name} under /usr/lib/postgresql/*/bin")
    return found[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@contextlib.contextmanager
def cluster() -> Iterator[str]:
    """A private Postgres cluster with pg_stat_statements; yields the URL of its ``bench`` database."""
    tmp = tempfile.mkdtemp(prefix="sg-rt-")
    data = os.path.join(tmp, "data")
    if os.geteuid() == 0:
        shutil.chown(tmp, "postgres", "postgres")
    port = _free_port()
    subprocess.run(
        _as_postgres([_bin("initdb"), "-D", data, "-A", "trust", "-U", "postgres"]),
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    options = (
        f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 "
        "-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all"
    )
    log = os.path.join(tmp, "log")
    subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", data, "-l", log, "-o", options, "-w", "start"]),
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench")
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/bench", autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
        yield f"postgresql://postgres@127.0.0.1:{port}/bench"
    finally:
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", data, "-m", "immediate", "stop"]),
                       check=False, stdout=subprocess.DEVNULL)  # fmt: skip
        shutil.rmtree(tmp, ignore_errors=True)


Maker = Callable[[str], tuple[Callable[[int], object], Callable[[], None]]]
"""Builds one session's operation on the database at the URL it is given (called with a fresh index
per call) and its closer."""

COUNTED_DB = "sg_counted"
"""The fresh database :func:`count` counts in, dropped and created again for every count."""
SETTLE_TIMEOUT = 60.0
"""Seconds a closed session's backends may take to exit (a bound only, on a busy machine)."""


def _admin(url: str) -> str:
    """The URL of the cluster's ``postgres`` database: where the counters are read, so that the
    readings' own transactions and statements never fall in the counted database."""
    return url.rsplit("/", 1)[0] + "/postgres"


def _reading(conn: Any, oid: int) -> dict[str, Any]:
    """The counted database's statements and commits and the WAL flushed so far, now (one query;
    after :func:`_settle`, every record written is flushed)."""
    row = conn.execute(
        "SELECT (SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE dbid = %(oid)s),"
        "       (SELECT xact_commit FROM pg_stat_database WHERE datid = %(oid)s),"
        "       (SELECT dealloc FROM pg_stat_statements_info),"
        "       pg_current_wal_flush_lsn()",
        {"oid": oid},
    ).fetchone()
    assert row is not None
    return {"statements": float(row[0]), "commits": float(row[1]), "dealloc": int(row[2]), "lsn": str(row[3])}


def _settle(conn: Any, oid: int) -> None:
    """Wait until no backend is connected to the counted database.

    A backend flushes its statistics (commits) as it exits, after its client has gone: a reading
    taken as soon as the client closed can miss them (Postgres 15 flushes statistics
    asynchronously). A backend leaves ``pg_stat_activity`` after that flush, so once none is left
    the counters are whole. Then wait until the WAL written so far is flushed, which
    ``pg_walinspect`` requires of what it reads."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        row = conn.execute(
            "SELECT count(*), pg_current_wal_insert_lsn() <= pg_current_wal_flush_lsn()"
            "  FROM pg_stat_activity WHERE datid = %s",
            (oid,),
        ).fetchone()
        if row is not None and row[0] == 0 and row[1]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the counted database still has {row[0] if row else '?'} backends")
        time.sleep(0.05)


def _wal_bytes(conn: Any, start: str, end: str) -> float:
    """Bytes of the WAL records written between two positions (``pg_walinspect``), full-page
    images and the server's own background records (checkpoints, standby snapshots) left out: a
    full-page image is written for the first change of a page after each checkpoint, so its bytes
    depend on when the server last checkpointed, not on the call."""
    if start == end:
        return 0.0
    row = conn.execute(
        "SELECT coalesce(sum(record_length), 0) FROM pg_get_wal_records_info(%s, %s)"
        " WHERE resource_manager <> 'Standby'"
        "   AND NOT (resource_manager = 'XLOG' AND record_type LIKE 'CHECKPOINT%%')",
        (start, end),
    ).fetchone()
    assert row is not None
    return float(row[0])


@contextlib.contextmanager
def _quiet(admin: Any) -> Iterator[None]:
    """Autovacuum off while counting (its transactions and WAL would fall in the counts at random:
    its launcher visits a new database first), and none of its processes left running; on again
    afterwards. The launcher exits once it has read the new setting (a reload is asynchronous),
    so its absence is the sign that no worker will start."""
    admin.execute("ALTER SYSTEM SET autovacuum = off")
    admin.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + SETTLE_TIMEOUT
    try:
        while True:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE backend_type IN ('autovacuum launcher', 'autovacuum worker')"
            ).fetchone()
            if row is not None and row[0] == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("autovacuum still running after it was turned off")
            time.sleep(0.1)
        yield
    finally:
        admin.execute("ALTER SYSTEM RESET autovacuum")
        admin.execute("SELECT pg_reload_conf()")


def count(url: str, make: Maker, n: int) -> dict[str, float]:
    """Per call of what ``make`` builds: statements, commits, WAL bytes, counted exactly.

    Counted in a fresh database of the cluster at ``url`` (:data:`COUNTED_DB`), so every count
    starts from the same state whatever ran before: its tables are created by a first session of no
    calls, then a session of ``n`` calls and one of ``5 n`` run, one client at a time, each closed
    and its backends gone before the counters are read (:func:`_settle`). The difference of the two
    cancels what a session costs to open and close (connecting, preparing statements). Counters:
    ``pg_stat_statements`` and ``pg_stat_database`` of that database only, read from another
    database; the WAL records in between (:func:`_wal_bytes`); autovacuum off meanwhile
    (:func:`_quiet`). ``make`` should name its keys and ids the same on every run (the WAL holds
    them). Statements and commits are then the same on every run; WAL bytes within a few bytes
    per call (the times and process ids written differ).

    Raises:
        RuntimeError: ``pg_stat_statements`` evicted entries meanwhile (its count would be short).
    """
    import psycopg

    with psycopg.connect(_admin(url), autocommit=True) as admin:
        admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        admin.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        admin.execute(f"DROP DATABASE IF EXISTS {COUNTED_DB}")
        admin.execute(f"CREATE DATABASE {COUNTED_DB}")
        row = admin.execute("SELECT oid FROM pg_database WHERE datname = %s", (COUNTED_DB,)).fetchone()
        assert row is not None
        oid, target = int(row[0]), url.rsplit("/", 1)[0] + f"/{COUNTED_DB}"
        with _quiet(admin):

            def session(calls: int) -> dict[str, float]:
                _settle(admin, oid)
                before = _reading(admin, oid)
                op, close = make(target)
                for i in range(calls):
                    op(i)
                close()
                _settle(admin, oid)
                after = _reading(admin, oid)
                if after["dealloc"] != before["dealloc"]:
                    raise RuntimeError("pg_stat_statements evicted entries while counting")
                return {
                    "statements": after["statements"] - before["statements"],
                    "commits": after["commits"] - before["commits"],
                    "wal_bytes": _wal_bytes(admin, before["lsn"], after["lsn"]),
                }

            session(0)  # creates the tables
            one, five = session(n), session(5 * n)
        admin.execute(f"DROP DATABASE {COUNTED_DB}")
    return {k: (five[k] - one[k]) / (4 * n) for k in one}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    cfg = parser.parse_args(argv)

    from sagaguard.idempotency import Guard, MemoryStore
    from sagaguard.idempotency.stores.sql import SqlStore
    from sagaguard.saga import Saga, SagaRunner, SagaState
    from sagaguard.saga.journals.sql import SqlJournal

    with cluster() as url:
        # Keys and ids named the same on every run (never the time): their bytes are in the WAL.
        sessions = iter(range(1_000_000))

        def guard(target: str) -> tuple[Callable[[int], object], Callable[[], None]]:
            store = SqlStore(target, table_name="bench_rt_effects")
            g = Guard(store, namespace="bench", retention=RETENTION)
            subject = guard_subject(g, f"rt-{next(sessions):03d}")
            return subject.sync, lambda: (g.close(), store.close())  # type: ignore[func-returns-value]

        def floor(target: str) -> tuple[Callable[[int], object], Callable[[], None]]:
            subject = postgres_floor(target, f"rt-{next(sessions):03d}")
            return subject.sync, subject.close

        steps = 5
        noops: Saga[int] = Saga("bench_rt_noops", input=int)
        for k in range(steps):
            noops.step(name=f"s{k}", compensate=None)(lambda ctx, value: value)

        def saga(target: str) -> tuple[Callable[[int], object], Callable[[], None]]:
            journal = SqlJournal(target)
            runner = SagaRunner(journal, Guard(MemoryStore()), wait=0)
            prefix = f"rt-{next(sessions):03d}"

            def run(i: int) -> object:
                outcome = runner.run(noops, f"{prefix}-{i}", i)
                if outcome.state is not SagaState.COMPLETED:
                    raise RuntimeError(f"bench saga ended {outcome.state}")
                return outcome

            return run, journal.close

        rows = {"floor": count(url, floor, cfg.calls), "guard": count(url, guard, cfg.calls)}
        per_saga = count(url, saga, max(20, cfg.calls // steps))
    print(f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}`; load average {os.getloadavg()}")
    print()
    print("| per call | floor | guarded | ratio | target |")
    print("|---|---:|---:|---:|---|")
    for name, target in (("statements", "2"), ("commits", "2"), ("wal_bytes", "<= 1.5x floor")):
        f, g = rows["floor"][name], rows["guard"][name]
        print(f"| {name} | {f:,.2f} | {g:,.2f} | {g / f if f else 0:.2f}x | {target} |")
    print()
    print(f"Saga of {steps} no-op steps, per step: " + ", ".join(
        f"{name} {value / steps:,.2f}" for name, value in per_saga.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
