"""WAL bytes per guarded call on Postgres, by table layout, against the floor's: where the bytes go.

::

    .venv/bin/python bench/wal_layout.py                  # the layouts, least of 3 windows each
    .venv/bin/python bench/wal_layout.py --dump           # also one call's WAL records (pg_waldump)

The store's claim then its record (``SqlStore.claim`` + ``complete``, a new key each time: the two
statements a no-op guarded call makes) on three layouts of the effects table, against the floor (as
in bench/_subjects.py: an INSERT commit and an UPDATE commit of a two-column row):

- ``as created``: the table with its two partial indexes (``expires_at``; ``(state, key)``);
- ``no secondary index``: the same table with both dropped, so no index names a column the record
  changes and Postgres can make the record's UPDATE a heap-only (HOT) update;
- ``lean row``: that table with the key and the fingerprint stored as their 32 bytes of digest
  (``bytea``) instead of their 68 and 67 characters of text: what a leaner row would write. The
  store cannot run on it, so the store's own claim and record statements run on psycopg
  (prepared, ``RawCursor``) with the values the store would bind.

WAL bytes are ``pg_current_wal_lsn()`` around ``--calls`` calls, the least of three windows (the
server is shared: others' WAL can only add). The HOT column is ``pg_stat_user_tables``'s share of
updates that were heap-only. ``--dump`` prints the WAL records of one call on each layout with
``pg_waldump`` (it needs to read the server's ``pg_wal`` directory: run as its owner or root).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from _common import RETENTION

from sagaguard.idempotency import holder
from sagaguard.idempotency.backends.sql_driver import Statement
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.stores.sql import SqlStore, make_engine
from sagaguard.idempotency.stores.sql_statements import effect_statements

FP = "f1_" + "a" * 64
_RECORD = re.compile(r"rmgr: (\w+)\s+len \(rec/tot\):\s*\d+/\s*(\d+),.*?desc: ([^,]*)")
"""A pg_waldump line: resource manager, total bytes, what the record is."""


def _lsn(admin: psycopg.Connection[Any]) -> int:
    row = admin.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint").fetchone()
    assert row is not None
    return int(row[0])


def _least_wal(admin: psycopg.Connection[Any], call: Callable[[int], object], calls: int) -> float:
    best = float("inf")
    for window in range(3):
        start = _lsn(admin)
        for i in range(calls):
            call(window * calls + i)
        best = min(best, (_lsn(admin) - start) / calls)
    return best


def _dump(admin: psycopg.Connection[Any], call: Callable[[int], object], at: int) -> str:
    waldump = shutil.which("pg_waldump") or next(
        (str(p) for p in sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_waldump"))), None
    )
    row = admin.execute("SHOW data_directory").fetchone()
    if waldump is None or row is None:
        return "  (pg_waldump not found)"
    start = admin.execute("SELECT pg_current_wal_lsn()").fetchone()
    call(at)
    end = admin.execute("SELECT pg_current_wal_lsn()").fetchone()
    assert start is not None and end is not None
    done = subprocess.run(
        [waldump, "-p", f"{row[0]}/pg_wal", "-s", str(start[0]), "-e", str(end[0])],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode:
        return f"  (pg_waldump failed: {done.stderr.strip()[:200]})"
    lines = []
    for line in done.stdout.splitlines():
        # "rmgr: Heap len (rec/tot): 338/338, tx: ..., desc: INSERT off 27 ..." -> "Heap 338 INSERT"
        found = _RECORD.match(line)
        if found:
            rmgr, size, desc = found.groups()
            lines.append(f"  {rmgr:<12} {int(size):>5} B  {desc.split(' off')[0].split(' 20')[0][:60]}")
    return "\n".join(lines)


def _lean(url: str, admin: psycopg.Connection[Any], table: str) -> tuple[Callable[[int], object], Any]:
    """The ``lean row`` layout's call (see the module) on ``table`` (made by the store, its secondary
    indexes dropped), and what closes its connection."""
    admin.execute(
        f"ALTER TABLE {table} ALTER COLUMN key TYPE bytea USING key::bytea, "
        "ALTER COLUMN fingerprint TYPE bytea USING fingerprint::bytea"
    )
    engine = make_engine(url)  # for its dialect only: it renders the ``$n`` parameters
    dialect = engine.dialect
    engine.dispose()
    texts = effect_statements(table, "postgresql", bound_now=False)
    claim, record = (Statement(texts[name], dialect) for name in ("claim", "complete_held"))
    conn = psycopg.connect(url, autocommit=True, cursor_factory=psycopg.RawCursor)

    def call(i: int) -> object:
        identity = EffectIdentity.of("bench", f"{table}-{i}", "wal", 0)
        params = {
            "key": bytes.fromhex(identity.key[4:]), "namespace": identity.namespace,
            "scope": identity.scope, "name": identity.name, "ordinal": identity.ordinal,
            "fingerprint": bytes.fromhex(FP[3:]), "lease": 30.0, "first_token": 7,
            "holder": holder.current(), "result": "null", "token": 7, "retention": RETENTION,
        }  # fmt: skip
        for statement in (claim, record):
            rows = conn.execute(statement.sql, statement.values(params), prepare=True).fetchall()
            assert rows, "the lean row's claim or record changed nothing"
        return i

    return call, conn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--dump", action="store_true")
    args = parser.parse_args()
    admin = psycopg.connect(args.pg_url, autocommit=True)
    tag = uuid.uuid4().hex[:8]
    results: list[tuple[str, float, str]] = []

    floor_table = f"bench_wal_floor_{tag}"
    admin.execute(f"CREATE TABLE {floor_table} (k TEXT PRIMARY KEY, v TEXT)")
    floor_conn = psycopg.connect(args.pg_url, autocommit=True)

    def floor(i: int) -> object:
        key = f"{tag}-f{i}"
        floor_conn.execute(f"INSERT INTO {floor_table} (k, v) VALUES (%s, 'pending')", (key,))
        return floor_conn.execute(f"UPDATE {floor_table} SET v = 'done' WHERE k = %s", (key,))

    dumps: list[tuple[str, str]] = []
    try:
        for i in range(200):
            floor(10**6 + i)
        results.append(("floor (INSERT + UPDATE, two columns)", _least_wal(admin, floor, args.calls), ""))
        if args.dump:
            dumps.append(("floor", _dump(admin, floor, 2 * 10**6)))
        for layout in ("as created", "no secondary index", "lean row"):
            table = f"bench_wal_{tag}_{len(results)}"
            store = SqlStore(args.pg_url, table_name=table)
            if layout != "as created":
                admin.execute(f"DROP INDEX ix_{table}_expiring")
                admin.execute(f"DROP INDEX ix_{table}_rare")

            def pair(i: int, store: SqlStore = store, table: str = table) -> object:
                identity = EffectIdentity.of("bench", f"{table}-{i}", "wal", 0)
                claimed = store.claim(identity, FP, 30.0).record
                return store.complete(identity.key, claimed.token, "null", RETENTION)

            closing: Any = store
            if layout == "lean row":
                store.close()
                pair, closing = _lean(args.pg_url, admin, table)
            try:
                for i in range(200):
                    pair(10**6 + i)
                wal = _least_wal(admin, pair, args.calls)
                if args.dump:
                    dumps.append((layout, _dump(admin, pair, 2 * 10**6)))
                time.sleep(0.7)  # the statistics collector reports every 500 ms
                row = admin.execute(
                    "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = %s", (table,)
                ).fetchone()
                hot = f"{row[1] / row[0]:.0%} HOT" if row and row[0] else "?"
                results.append((f"guarded call, {layout}", wal, hot))
            finally:
                closing.close()
                admin.execute(f'DROP TABLE IF EXISTS "{table}"')
    finally:
        floor_conn.close()
        admin.execute(f"DROP TABLE IF EXISTS {floor_table}")
    base = results[0][1]
    print(f"WAL bytes per call, least of 3 windows of {args.calls} calls")
    print("| layout | WAL bytes per call | against the floor | updates |")
    print("|---|---:|---:|---|")
    for name, wal, hot in results:
        print(f"| {name} | {wal:,.0f} | {wal / base:.2f}x | {hot} |")
    for name, text in dumps:
        print(f"\nOne call's WAL records, {name}:\n{text}")
    admin.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
