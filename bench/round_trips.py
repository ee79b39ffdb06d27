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
- commits: ``pg_stat_database.xact_commit`` of the bench's database;
- WAL bytes: ``pg_stat_wal.wal_bytes``.

Each figure is the difference of two sessions (``n`` and ``5 n`` calls), each closed before the
counters are read (a backend reports its counters as it exits). Run as root, the cluster runs as
the ``postgres`` user.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import RETENTION, run_tag
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


Maker = Callable[[], tuple[Callable[[int], object], Callable[[], None]]]
"""Builds one session's operation (called with a fresh index per call) and its closer."""


def _counters(url: str) -> dict[str, float]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        statements = conn.execute(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
            "WHERE query NOT LIKE '%pg_stat%' AND query NOT LIKE '%pg_backend_pid%'"
        ).fetchone()
        commits = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        wal = conn.execute("SELECT wal_bytes FROM pg_stat_wal").fetchone()
    assert statements and commits and wal
    return {"statements": float(statements[0]), "commits": float(commits[0]), "wal_bytes": float(wal[0])}


def count(url: str, make: Maker, n: int) -> dict[str, float]:
    """Per call of what ``make`` builds: statements, commits, WAL bytes.

    The difference of two sessions, of ``n`` and of ``5 n`` calls, each made, run and closed between
    two readings of the counters: it cancels what a session costs to open and close (connecting,
    preparing statements, creating tables) and the readings' own statements.
    """

    def session(calls: int) -> dict[str, float]:
        time.sleep(1.2)  # what ran before has reported its counters (flushed at most once a second)
        before = _counters(url)
        op, close = make()
        for i in range(calls):
            op(i)
        close()  # backends report their counters as they exit
        time.sleep(1.2)
        after = _counters(url)
        return {k: after[k] - before[k] for k in after}

    one, five = session(n), session(5 * n)
    return {k: (five[k] - one[k]) / (4 * n) for k in one}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    cfg = parser.parse_args(argv)

    from sagaguard.idempotency import Guard, MemoryStore
    from sagaguard.idempotency.stores.sql import SqlStore
    from sagaguard.saga import Saga, SagaRunner, SagaState
    from sagaguard.saga.journals.sql import SqlJournal

    tag = run_tag()
    with cluster() as url:

        def guard() -> tuple[Callable[[int], object], Callable[[], None]]:
            store = SqlStore(url, table_name="bench_rt_effects")
            g = Guard(store, namespace="bench", retention=RETENTION)
            subject = guard_subject(g, f"{tag}-{time.monotonic_ns()}")
            return subject.sync, lambda: (g.close(), store.close())  # type: ignore[func-returns-value]

        def floor() -> tuple[Callable[[int], object], Callable[[], None]]:
            subject = postgres_floor(url, f"{tag}-{time.monotonic_ns()}")
            return subject.sync, subject.close

        steps = 5
        noops: Saga[int] = Saga("bench_rt_noops", input=int)
        for k in range(steps):
            noops.step(name=f"s{k}", compensate=None)(lambda ctx, value: value)

        def saga() -> tuple[Callable[[int], object], Callable[[], None]]:
            journal = SqlJournal(url)
            runner = SagaRunner(journal, Guard(MemoryStore()), wait=0)
            prefix = f"{tag}-{time.monotonic_ns()}"

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
