"""How much of a core the calling process spends, per thread count, guarded calls against the floor.

::

    .venv/bin/python bench/client_cores.py                    # Postgres, 1, 8 and 32 threads
    .venv/bin/python bench/client_cores.py --threads 1,8 --seconds 3

Closed loops of guarded new calls (a default ``Guard`` on ``SqlStore``, no-op body) and of the
floor (bench/_subjects.py: an INSERT commit and an UPDATE commit over psycopg in autocommit),
alternating, ``--rounds`` windows each. For every window: calls/s, process CPU per call
(``time.process_time``, every thread) and cores used (process CPU over wall time). CPython runs one
thread's bytecode at a time, so a process near one core is bound by its own CPU per call: its
calls/s can rise no further with more threads, whatever the database could take.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
from _load import run_threads
from _subjects import guard_subject, postgres_floor

from sagaguard.idempotency import Guard
from sagaguard.idempotency.stores.sql import SqlStore


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--threads", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    table = f"bench_cores_{uuid.uuid4().hex[:8]}"
    store = SqlStore(args.pg_url.replace("postgresql://", "postgresql+psycopg://", 1), table_name=table)
    subjects = {
        "floor": postgres_floor(args.pg_url, uuid.uuid4().hex),
        "guard": guard_subject(Guard(store, namespace="bench"), uuid.uuid4().hex),
    }
    print("| threads | series | calls/s | client CPU per call | cores used |")
    print("|---:|---|---:|---:|---:|")
    try:
        windows = 0
        for threads in (int(t) for t in args.threads.split(",")):
            for _ in range(args.rounds):
                for name in ("floor", "guard"):
                    windows += 1  # each window its own index range: every call is new
                    w = run_threads(subjects[name].sync, threads, args.seconds, windows * 10_000_000)
                    figures = w.summary()
                    print(
                        f"| {threads} | {name} | {figures['rate']:,.0f} | {figures['cpu_us']:,.0f} µs"
                        f" | {w.cpu / w.wall:.2f} |",
                        flush=True,
                    )
    finally:
        subjects["floor"].close()
        store.close()
        with psycopg.connect(args.pg_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
            conn.execute("DROP TABLE IF EXISTS bench_tp_floor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
