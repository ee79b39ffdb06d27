"""Benchmark of the transactional outbox, side by side with a peer, written into docs/benchmarks.md.

::

    .venv/bin/python bench/outbox.py --quick        # smoke check (~1 min), prints only
    .venv/bin/python bench/outbox.py                # full run (~8 min), writes the docs

Measures, on SQLite (a file) and Postgres (127.0.0.1:5432, database ``test``):

- relay throughput with a no-op handler, 1 and 4 relay processes, on a backlog of ``--count``
  messages spread over ``--aggregates`` ordering keys (so per-aggregate order is enforced);
- enqueue overhead: a business transaction (one INSERT, commit) with and without one enqueued
  message in it.

The peer is txoutbox (PyPI), which does the same job (claims with leases, per-key order, retries,
dead letters), run with its own adapters (asyncpg on Postgres, sqlite3 on SQLite) and the same
workload. Its SQLite adapter is single-process by design, so it runs only with one relay there.
pactix and pgrelay need Python >= 3.12 and do not install on this project's 3.11.

Each relay is its own process; a run starts them together behind a gate and measures from the gate
to the last relay's report. Seeding is not timed (and is followed by VACUUM ANALYZE + CHECKPOINT on
Postgres). Each figure is the median of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "_outbox_workers.py"
DOCS = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench:outbox:start -->", "<!-- bench:outbox:end -->"
PG_URL = os.environ.get("SAGAGUARD_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
TARGET_RATE = 10_000
_NAMES = {"postgres": "Postgres", "sqlite": "SQLite"}
TARGET_RATIO = 2.0

sys.path.insert(0, str(ROOT))


def _spawn(role: str, spec: dict[str, Any], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKERS), role, json.dumps(spec)], text=True, stdout=subprocess.PIPE, **kw
    )


def relay_run(lib: str, url: str, relays: int, *, count: int, aggregates: int, batch: int) -> float:
    """Seed, then time ``relays`` processes draining the backlog; returns messages per second."""
    table = f"bench_{lib.replace('-', '_')}_outbox"
    spec = {"lib": lib, "url": url, "table": table, "count": count, "aggregates": aggregates, "batch": batch}
    seeded = _spawn("seed", spec)
    if seeded.wait(timeout=600) != 0:
        raise RuntimeError(f"seeding {lib} failed")
    procs = [_spawn("relay", spec, stdin=subprocess.PIPE) for _ in range(relays)]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {lib} relay did not start")
        started = time.perf_counter()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        delivered, cpu = 0, 0.0
        for proc in procs:
            assert proc.stdout is not None
            report = json.loads(proc.stdout.readline())
            delivered += int(report["delivered"])
            cpu += float(report.get("cpu", 0.0))
        seconds = time.perf_counter() - started
        if os.environ.get("SAGAGUARD_BENCH_VERBOSE"):
            print(f"[bench]   {lib} x{relays}: {seconds:.2f} s, relay CPU {cpu:.2f} s", file=sys.stderr)
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return delivered / seconds


# ------------------------------------------------------------------------------ enqueue overhead


def enqueue_overhead(url: str, transactions: int) -> dict[str, float]:
    """Median microseconds per business transaction, without and with one enqueued message."""
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    from sagaguard.idempotency.outbox import Outbox, create_tables
    from sagaguard.idempotency.stores.sql import make_engine

    engine = make_engine(url)
    orders = sa.Table(
        "bench_orders",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("total", sa.Integer, nullable=False),
    )
    table = "bench_enqueue_outbox"
    with engine.begin() as conn:
        orders.drop(conn, checkfirst=True)
        orders.create(conn)
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
    create_tables(engine, table)
    outbox = Outbox(table)
    counter = iter(range(10**9))

    def business(with_message: bool) -> float:
        started = time.perf_counter()
        with Session(engine) as session:
            n = next(counter)
            session.execute(orders.insert().values(id=n, total=n))
            if with_message:
                outbox.enqueue(
                    session, "order.paid", {"order": n}, aggregate_type="order", aggregate_id=str(n)
                )
            session.commit()
        return time.perf_counter() - started

    result = _interleaved(business, transactions)
    engine.dispose()
    return result


def _interleaved(call: Any, transactions: int) -> dict[str, float]:
    """Alternate blocks of both variants (so drift hits both), after a warm-up."""
    for _ in range(50):
        call(False)
        call(True)
    samples: dict[bool, list[float]] = {False: [], True: []}
    block = 50
    for _ in range(max(1, transactions // block)):
        for variant in (False, True):
            samples[variant].extend(call(variant) for _ in range(block))
    return {
        "without_us": statistics.median(samples[False]) * 1e6,
        "with_us": statistics.median(samples[True]) * 1e6,
    }


def txoutbox_enqueue_overhead(url: str, transactions: int) -> dict[str, float]:
    """The same business transaction on the peer's own driver, with and without ``insert``."""
    if url.startswith("sqlite"):
        import sqlite3

        from txoutbox.adapters.sqlite import SqliteStorage

        path = url.split("sqlite:///", 1)[1]
        storage = SqliteStorage(path, table="bench_tx_enqueue")
        storage._conn.execute("DROP TABLE IF EXISTS bench_tx_enqueue")
        storage.create_schema()
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # as sagaguard's engine, for the same commit cost
        conn.execute("DROP TABLE IF EXISTS bench_tx_orders")
        conn.execute("CREATE TABLE bench_tx_orders (id INTEGER PRIMARY KEY, total INTEGER NOT NULL)")
        counter = iter(range(10**9))

        def business(with_message: bool) -> float:
            started = time.perf_counter()
            n = next(counter)
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO bench_tx_orders VALUES (?, ?)", (n, n))
            if with_message:
                storage.insert(conn, "order.paid", {"order": n}, key=str(n))
            conn.execute("COMMIT")
            return time.perf_counter() - started

        result = _interleaved(business, transactions)
        conn.close()
        storage.close()
        return result

    async def run() -> dict[str, float]:
        import asyncpg
        from txoutbox.adapters.postgres import PostgresStorage

        pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
        # With its NOTIFY trigger, as sagaguard's table always has one: a NOTIFY makes the commit
        # queue a notification (a lock shared by every notifying transaction), part of the cost.
        storage = PostgresStorage(pool, table="bench_tx_enqueue", notify_channel="bench_tx_enqueue")
        await pool.execute("DROP TABLE IF EXISTS bench_tx_enqueue")
        await storage.create_schema()
        await pool.execute("DROP TABLE IF EXISTS bench_tx_orders")
        await pool.execute("CREATE TABLE bench_tx_orders (id integer PRIMARY KEY, total integer NOT NULL)")
        samples: dict[bool, list[float]] = {False: [], True: []}
        n = 0
        async with pool.acquire() as conn:
            for round_ in range(max(1, transactions // 50) + 1):
                for variant in (False, True):
                    for _ in range(50):
                        n += 1
                        started = time.perf_counter()
                        async with conn.transaction():
                            await conn.execute("INSERT INTO bench_tx_orders VALUES ($1, $2)", n, n)
                            if variant:
                                await storage.insert(conn, "order.paid", {"order": n}, key=str(n))
                        if round_:  # the first round warms up
                            samples[variant].append(time.perf_counter() - started)
        await pool.close()
        return {
            "without_us": statistics.median(samples[False]) * 1e6,
            "with_us": statistics.median(samples[True]) * 1e6,
        }

    return asyncio.run(run())


# ------------------------------------------------------------------------------------- report


def _versions() -> str:
    found = [f"Python {platform.python_version()}"]
    for dist in ("SQLAlchemy", "psycopg", "asyncpg", "txoutbox"):
        with contextlib.suppress(PackageNotFoundError):
            found.append(f"{dist} {version(dist)}")
    return ", ".join(found)


def _machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} vCPUs{' (' + model + ')' if model else ''}"


def _postgres_version() -> str:
    try:
        import psycopg

        with psycopg.connect(PG_URL, connect_timeout=3) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            return f"PostgreSQL {row[0].split()[0]}" if row else "PostgreSQL"
    except Exception:
        return "PostgreSQL"


def render(results: dict[str, Any], cfg: argparse.Namespace) -> str:
    """The markdown block between the outbox markers."""
    rate = results["rate"]
    lines = [
        START,
        "## Transactional outbox",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {_machine()}, {_postgres_version()}, SQLite in WAL mode "
        f"with `synchronous=FULL`; {_versions()}. Workload: {cfg.count:,} messages over "
        f"{cfg.aggregates:,} aggregates (ordering keys), a no-op handler, batches of {cfg.batch}; each "
        f"figure is the median of {cfg.repeat} runs; load average at the end "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}. Reproduce: `.venv/bin/python bench/outbox.py` "
        "(needs `pip install txoutbox asyncpg` for the peer).",
        "",
        "Relay throughput (messages per second, higher is better):",
        "",
        "| backend | relays | sagaguard (default) | sagaguard, `synchronous_commit=True` | txoutbox 0.2 "
        "| sagaguard / txoutbox |",
        "|---|---|---|---|---|---|",
    ]
    for backend in ("postgres", "sqlite"):
        for relays in (1, 4):
            ours = rate.get(f"sagaguard.{backend}.{relays}")
            sync = rate.get(f"sagaguard-sync.{backend}.{relays}")
            peer = rate.get(f"txoutbox.{backend}.{relays}")
            sync_text = f"{sync:,.0f}" if sync else "- (SQLite: always synchronous)"
            peer_text = f"{peer:,.0f}" if peer else "n/a (single-process adapter)"
            ratio = f"{ours / peer:.1f}x" if ours and peer else "-"
            if ours and peer and sync:
                ratio += f" ({sync / peer:.1f}x synchronous)"
            lines.append(
                f"| {_NAMES[backend]} | {relays} | {ours:,.0f} | {sync_text} | {peer_text} | {ratio} |"
            )
    ours4 = rate.get("sagaguard.postgres.4", 0.0)
    best_peer = max((v for k, v in rate.items() if k.startswith("txoutbox.postgres")), default=0.0)
    lines += [
        "",
        "Targets:",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        f"| Postgres, 4 relays: >= {TARGET_RATE:,} msg/s | {ours4:,.0f} msg/s | "
        f"{'yes' if ours4 >= TARGET_RATE else 'NO'} |",
        f"| Postgres, 4 relays: >= {TARGET_RATIO:.0f} x the best peer figure on Postgres "
        f"({best_peer:,.0f} msg/s) | {ours4 / best_peer if best_peer else 0:.1f}x | "
        f"{'yes' if best_peer and ours4 >= TARGET_RATIO * best_peer else 'NO'} |",
        "",
        "Enqueue overhead: one business transaction (INSERT one order row, commit), median microseconds:",
        "",
        "| backend | library | without a message | with one message | overhead |",
        "|---|---|---|---|---|",
    ]
    for backend in ("postgres", "sqlite"):
        for lib in ("sagaguard", "txoutbox"):
            found = results["enqueue"].get(f"{lib}.{backend}")
            if not found:
                continue
            extra = found["with_us"] - found["without_us"]
            lines.append(
                f"| {_NAMES[backend]} | {lib} | {found['without_us']:,.0f} | "
                f"{found['with_us']:,.0f} | +{extra:,.0f} us ({extra / found['without_us']:+.0%}) |"
            )
    lines += [
        "",
        "Notes: by default a sagaguard relay commits its claims and acks with Postgres "
        "`synchronous_commit = off` (`RelaySettings.synchronous_commit`): a database crash may make it "
        "deliver its last few messages again, never lose one (see docs/outbox.md); the column "
        "`synchronous_commit=True` waits for every WAL flush, as txoutbox does. "
        "sagaguard enqueues through a SQLAlchemy `Session` (psycopg 3 / sqlite3) and its relay is a "
        "synchronous loop in each process; txoutbox uses asyncpg and asyncio. On Postgres sagaguard "
        "claims only the head of each aggregate per round (`FOR UPDATE SKIP LOCKED`, no table lock), "
        "txoutbox serialises its claims with an advisory lock to keep per-key order. Both mark rows "
        "delivered (no delete on ack). The 2-core machine runs the relays and the database together, "
        "so more relays mostly share the same two cores. Enqueue: sagaguard's message is one more INSERT "
        "on the session's connection through SQLAlchemy and psycopg 3, of a wider row (UUIDv7 id, "
        "provider key, trace context) with a NOTIFY trigger on Postgres; txoutbox's is one asyncpg or "
        "sqlite3 call. Both overheads are dominated by the extra statement and the larger commit. "
        "Other outbox libraries on PyPI, pactix and pgrelay, require Python >= 3.12 and do not install "
        "on this project's 3.11; txoutbox is the peer that does the same job and installs.",
        "",
        END,
    ]
    return "\n".join(lines)


def write(block: str) -> None:
    """Replace the outbox block of docs/benchmarks.md (appended when missing); nothing else."""
    text = DOCS.read_text(encoding="utf-8")
    if START in text and END in text:
        head, rest = text.split(START, 1)
        tail = rest.split(END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOCS.write_text(text, encoding="utf-8")


BENCH_TABLES = (
    "bench_sagaguard_outbox",
    "bench_sagaguard_sync_outbox",
    "bench_txoutbox_outbox",
    "bench_enqueue_outbox",
    "bench_orders",
    "bench_tx_enqueue",
    "bench_tx_orders",
)


def _drop_bench_tables(url: str) -> None:
    """Leave the Postgres database as the run found it (SQLite lived in a temporary directory)."""
    import psycopg

    with contextlib.suppress(psycopg.Error), psycopg.connect(url, autocommit=True) as conn:
        for table in BENCH_TABLES:
            conn.execute(f"DROP TABLE IF EXISTS {table} CASCADE")
            conn.execute(f'DROP FUNCTION IF EXISTS "{table}_notify"() CASCADE')
        if conn.execute("SELECT to_regclass('sagaguard_schema')").fetchone() != (None,):
            conn.execute("DELETE FROM sagaguard_schema WHERE name = ANY(%s)", (list(BENCH_TABLES),))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small and fast; prints only")
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--aggregates", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--transactions", type=int, default=2000)
    parser.add_argument("--no-write", action="store_true", help="print the block, leave the docs alone")
    parser.add_argument("--enqueue-only", action="store_true", help="only the enqueue overhead; prints only")
    cfg = parser.parse_args(argv)
    if cfg.quick:
        cfg.count, cfg.aggregates, cfg.repeat, cfg.transactions = 20_000, 2_000, 1, 300
    try:
        import txoutbox  # noqa: F401

        peers = ["txoutbox"]
    except ImportError:
        print("[bench] txoutbox is not installed: measuring sagaguard only", file=sys.stderr)
        peers = []
    results: dict[str, Any] = {"rate": {}, "enqueue": {}}
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"postgres": PG_URL, "sqlite": f"sqlite:///{tmp}/bench-outbox.db"}
        for backend, url in urls.items():
            for relays in () if cfg.enqueue_only else (1, 4):
                libs = [
                    lib
                    for lib in ["sagaguard", "sagaguard-sync", *peers]
                    if not (lib == "txoutbox" and backend == "sqlite" and relays > 1)
                    and not (lib == "sagaguard-sync" and backend == "sqlite")
                ]
                runs: dict[str, list[float]] = {lib: [] for lib in libs}
                for repeat in range(cfg.repeat):
                    # Interleaved, in alternating order: a machine whose load drifts hits both.
                    for lib in libs if repeat % 2 == 0 else libs[::-1]:
                        rate = relay_run(
                            lib, url, relays, count=cfg.count, aggregates=cfg.aggregates, batch=cfg.batch
                        )
                        runs[lib].append(rate)
                for lib in libs:
                    key = f"{lib}.{backend}.{relays}"
                    results["rate"][key] = statistics.median(runs[lib])
                    rounded = [round(r) for r in runs[lib]]
                    print(f"[bench] {key}: {results['rate'][key]:,.0f} msg/s  runs {rounded}")
            results["enqueue"][f"sagaguard.{backend}"] = enqueue_overhead(url, cfg.transactions)
            if peers:
                results["enqueue"][f"txoutbox.{backend}"] = txoutbox_enqueue_overhead(url, cfg.transactions)
            for key, value in results["enqueue"].items():
                if key.endswith(backend):
                    print(f"[bench] enqueue {key}: {value['without_us']:.0f} -> {value['with_us']:.0f} us")
    _drop_bench_tables(PG_URL)
    if cfg.enqueue_only:
        return 0
    block = render(results, cfg)
    print(block)
    if not (cfg.quick or cfg.no_write):
        write(block)
        print(f"[bench] wrote {DOCS.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
