"""The processes of the outbox benchmark: seeding a backlog, and one relay (ours or a peer's).

Run as ``python bench/_outbox_workers.py ROLE '<json spec>'``:

- ``seed``: (re)create the table of ``lib`` (``sagaguard`` or ``txoutbox``) and insert ``count``
  messages spread round-robin over ``aggregates`` ordering keys, then ANALYZE and CHECKPOINT
  (Postgres), so the timed relays do not pay for the seeding's WAL.
- ``relay``: say ``ready``, wait for a line on stdin, then deliver with a no-op handler until the
  table has nothing pending, and print ``{"delivered": n, "seconds": s}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from sagaguard.idempotency.migrations import table_sets
from sagaguard.idempotency.outbox import Outbox, OutboxControl, Relay, RelaySettings, create_tables, uuid7
from sagaguard.idempotency.outbox.model import SCHEMA_TABLE, outbox_table
from sagaguard.idempotency.stores.sql import make_engine


def _pg_dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _sqlite_path(url: str) -> str:
    return url.split("sqlite:///", 1)[1]


def _row(i: int, aggregates: int, now: float) -> dict[str, Any]:
    return {
        "id": uuid7(),
        "aggregatetype": "order",
        "aggregateid": str(i % aggregates),
        "type": "noop",
        "payload": json.dumps({"n": i}),
        "provider_key": f"pk-{i}",
        "status": "pending",
        "attempts": 0,
        "max_attempts": 10,
        "created_at": now,
        "updated_at": now,
        "available_at": now,
    }


def seed_sagaguard(spec: dict[str, Any]) -> None:
    engine = make_engine(spec["url"])
    table = spec["table"]
    # The table's schema revision lives in a version table of its own: dropped with it, or the
    # next create_tables would find the revision recorded and leave the table uncreated.
    version_table = next(s for s in table_sets() if s.name == "outbox").version_table_for(table)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {version_table}")
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f'DROP FUNCTION IF EXISTS "{table}_notify"() CASCADE')
        if sa.inspect(conn).has_table(SCHEMA_TABLE):
            conn.execute(sa.text(f"DELETE FROM {SCHEMA_TABLE} WHERE name = :n"), {"n": table})
    create_tables(engine, table)
    now = time.time()
    rows = [_row(i, spec["aggregates"], now) for i in range(spec["count"])]
    insert = outbox_table(table).insert()
    with engine.begin() as conn:
        for start in range(0, len(rows), 5000):
            conn.execute(insert, rows[start : start + 5000])
    _settle_database(engine, table)
    engine.dispose()


def _settle_database(engine: sa.Engine, table: str) -> None:
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f"VACUUM ANALYZE {table}")
            conn.exec_driver_sql("CHECKPOINT")
    else:
        fairy = engine.raw_connection()  # no BEGIN: a checkpoint cannot run inside a transaction
        try:
            fairy.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            fairy.close()


def relay_sagaguard(spec: dict[str, Any]) -> dict[str, Any]:
    engine = make_engine(spec["url"])
    outbox = Outbox(spec["table"])
    outbox.register("noop", lambda message: None)
    settings = RelaySettings(
        batch_size=spec["batch"],
        purge_every=None,
        listen=False,
        status_every=3600,
        synchronous_commit=spec.get("sync", False),
    )
    relay = Relay(outbox, engine, settings)
    control = OutboxControl(engine, spec["table"])
    relay.run_once()  # warm up: connect, check the schema, prepare statements
    warm = relay.stats().delivered
    _ready()
    started, cpu = time.perf_counter(), time.process_time()
    while True:
        if relay.run_once():
            continue
        if control.status().depth == 0:
            break
        time.sleep(0.002)
    seconds = time.perf_counter() - started
    delivered = relay.stats().delivered - warm
    relay.close()
    engine.dispose()
    return {"delivered": delivered, "seconds": seconds, "cpu": time.process_time() - cpu}


# --------------------------------------------------------------------------------- txoutbox


def seed_txoutbox(spec: dict[str, Any]) -> None:
    url, table, count, aggregates = spec["url"], spec["table"], spec["count"], spec["aggregates"]
    rows = [("noop", str(i % aggregates), json.dumps({"n": i}).encode()) for i in range(count)]
    if url.startswith("sqlite"):
        from txoutbox.adapters.sqlite import SqliteStorage

        storage = SqliteStorage(_sqlite_path(url), table=table)
        with storage._lock:  # its own connection, serialised as its adapter does
            storage._conn.execute(f"DROP TABLE IF EXISTS {table}")
        storage.create_schema()
        now = time.time()
        with storage._lock:
            storage._conn.execute("BEGIN")
            storage._conn.executemany(
                f"INSERT INTO {table} (topic, key, payload, created_at) VALUES (?, ?, ?, ?)",
                [(*row, now) for row in rows],
            )
            storage._conn.execute("COMMIT")
        storage.close()
    else:

        async def seed() -> None:
            import asyncpg
            from txoutbox.adapters.postgres import PostgresStorage

            pool = await asyncpg.create_pool(_pg_dsn(url), min_size=1, max_size=2)
            storage = PostgresStorage(pool, table=table)
            await pool.execute(f"DROP TABLE IF EXISTS {table}")
            await storage.create_schema()
            await pool.executemany(f"INSERT INTO {table} (topic, key, payload) VALUES ($1, $2, $3)", rows)
            await pool.close()

        asyncio.run(seed())
    engine = make_engine(url)
    _settle_database(engine, table)
    engine.dispose()


def relay_txoutbox(spec: dict[str, Any]) -> dict[str, Any]:
    from txoutbox import Relay as TxRelay
    from txoutbox import RelayConfig

    async def noop(message: Any) -> None:
        return None

    async def run() -> dict[str, Any]:
        pool: Any = None
        if spec["url"].startswith("sqlite"):
            from txoutbox.adapters.sqlite import SqliteStorage

            storage: Any = SqliteStorage(_sqlite_path(spec["url"]), table=spec["table"])
        else:
            import asyncpg
            from txoutbox.adapters.postgres import PostgresStorage

            pool = await asyncpg.create_pool(_pg_dsn(spec["url"]), min_size=2, max_size=4)
            storage = PostgresStorage(pool, table=spec["table"])
        config = RelayConfig(batch_size=spec["batch"], lease=timedelta(seconds=120), concurrency=64)
        relay = TxRelay(storage, noop, config=config)
        await relay.run_once()
        _ready()
        started, cpu = time.perf_counter(), time.process_time()
        delivered = 0
        while True:
            result = await relay.run_once()
            delivered += result.published
            if result.claimed:
                continue
            if (await storage.stats()).pending == 0:
                break
            await asyncio.sleep(0.002)
        seconds = time.perf_counter() - started
        if pool is not None:
            await pool.close()
        else:
            storage.close()
        return {"delivered": delivered, "seconds": seconds, "cpu": time.process_time() - cpu}

    return asyncio.run(run())


def _ready() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


ROLES = {
    ("seed", "sagaguard"): seed_sagaguard,
    ("seed", "sagaguard-sync"): seed_sagaguard,
    ("seed", "txoutbox"): seed_txoutbox,
    ("relay", "sagaguard"): relay_sagaguard,
    ("relay", "sagaguard-sync"): lambda spec: relay_sagaguard({**spec, "sync": True}),
    ("relay", "txoutbox"): relay_txoutbox,
}

if __name__ == "__main__":
    role, raw = sys.argv[1], sys.argv[2]
    spec = json.loads(raw)
    result = ROLES[(role, spec["lib"])](spec)
    if result is not None:
        print(json.dumps(result), flush=True)
