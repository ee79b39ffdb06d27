"""Loading a million finished records fast, in the SQL store's own row format."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

from _common import RETENTION

_COLUMNS = (
    "key, namespace, scope, name, ordinal, fingerprint, state, token, lease_until, attempts, "
    "created_at, updated_at, expires_at, result"
)


def _rows(count: int) -> Iterator[tuple[Any, ...]]:
    now = time.time()
    fp = "f1_" + "0" * 64
    for i in range(count):
        # Random keys like real ones (hashes): inserts land all over the primary-key index.
        yield (
            f"sg1_{os.urandom(32).hex()}", "bench", f"million-{i}", "bench.noop", 0, fp,
            "succeeded", 1, now + 60, 1, now, now, now + RETENTION, "0",
        )  # fmt: skip


def load_sqlite(path: str, table: str, count: int) -> float:
    """Insert ``count`` rows in one transaction; returns seconds. The table must exist."""
    t0 = time.perf_counter()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = OFF")  # loading only; the benchmark reopens with FULL
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(f"INSERT INTO {table} ({_COLUMNS}) VALUES ({', '.join('?' * 14)})", _rows(count))
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("ANALYZE")
    finally:
        conn.close()
    return time.perf_counter() - t0


def load_postgres(url: str, table: str, count: int) -> float:
    """``COPY`` ``count`` rows in, then ``VACUUM ANALYZE``; returns seconds. The table must exist."""
    import psycopg

    t0 = time.perf_counter()
    with psycopg.connect(url) as conn:
        with conn.cursor() as cur, cur.copy(f"COPY {table} ({_COLUMNS}) FROM STDIN") as copy:
            for row in _rows(count):
                copy.write_row(row)
        conn.commit()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {table}")
    return time.perf_counter() - t0
