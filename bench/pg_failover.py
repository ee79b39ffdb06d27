"""Acknowledged claims lost when a Postgres primary fails over: asynchronous against synchronous
replication (docs/backends.md, "Replicated Postgres").

::

    .venv/bin/python bench/pg_failover.py [--rounds 3] [--threads 8] [--before 2000]

Each round starts a local primary and streaming standby (``tests/_pgpair.py``: initdb and
pg_ctl on free ports, run as the postgres user when run as root), has ``--threads`` threads make
guarded no-op calls on new keys through the multi-host URL, SIGKILLs the primary once ``--before``
calls returned, promotes the standby, and then counts the calls that had returned (the guard had
its claim and record acknowledged) whose record the promoted standby does not have. With
``synchronous_standby_names`` that count must be 0; without it, the primary acknowledges a commit
before the standby has it, and a failover may lose it: the effect would then run again. Also prints
the guarded calls per second before the kill, the price of waiting for the standby at each commit.
Not a test: whether the asynchronous standby is behind at the instant of the kill is a race.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _pgpair import LocalPgPair

from sagaguard.idempotency import Guard, scope
from sagaguard.idempotency.errors import IdempotencyError
from sagaguard.idempotency.stores.sql import SqlStore


def one_round(synchronous: bool, threads: int, before: int) -> tuple[int, int, float]:
    """(calls acknowledged, acknowledged records the promoted standby lacks, calls/s before the kill)."""
    pair = LocalPgPair(synchronous=synchronous).start()
    try:
        store = SqlStore(pair.url)
        guard = Guard(store, namespace="pgfailover-bench", lease=1.0, wait=0.0)
        acked: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()

        def worker(n: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                key = f"t{n}-{i}"
                try:
                    with scope(key):
                        guard.run("noop", lambda: None)
                except IdempotencyError:
                    time.sleep(0.05)
                    continue
                with lock:
                    acked.append(key)

        pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
        started = time.monotonic()
        for thread in pool:
            thread.start()
        while len(acked) < before:
            time.sleep(0.001)
        with lock:
            rate = len(acked) / (time.monotonic() - started)
            pair.kill_primary()  # under the lock: no acknowledgement is counted after the kill
            known = list(acked)
        pair.promote()
        stop.set()
        for thread in pool:
            thread.join()
        guard.close()
        store.close()
        with psycopg.connect(pair.node_url(1)) as conn:
            rows = conn.execute("SELECT scope FROM sagaguard_effects WHERE state = 'succeeded'").fetchall()
        present = {r[0] for r in rows}
        return len(known), sum(1 for key in known if key not in present), rate
    finally:
        pair.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--before", type=int, default=2000, help="calls acknowledged before the kill")
    args = parser.parse_args()
    for _ in range(args.rounds):
        for synchronous in (False, True):
            acked, lost, rate = one_round(synchronous, args.threads, args.before)
            label = "synchronous " if synchronous else "asynchronous"
            print(
                f"{label}: {acked} acknowledged, {lost} lost by the failover; {rate:,.0f} calls/s before it"
            )


if __name__ == "__main__":
    main()
