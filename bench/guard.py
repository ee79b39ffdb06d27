"""Benchmark of the guarded call against its floors and anchors, written into docs/benchmarks.md.

::

    .venv/bin/python bench/guard.py --quick            # smoke check, < 60 s, prints only
    .venv/bin/python bench/guard.py                    # full run, < 10 min, writes the docs
    .venv/bin/python bench/guard.py --million          # also 1,000,000-record stores (slower)

Each backend runs in its own process (``--phase``), one after the other, so DBOS (a process-wide
singleton) starts clean and no phase's garbage or threads weigh on the next. Needs Redis at
127.0.0.1:6379 and Postgres at 127.0.0.1:5432 (user postgres, trust auth) unless told otherwise;
it writes only keys under its own prefixes (with TTLs) and its own databases, and removes them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DBOS_ROUNDS, Config, PhaseResult, balance
from _report import render, write

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("profile", "redis", "sqlite", "postgres")
PHASE_TIMEOUT = 1800


def _run_phase(name: str, cfg: Config) -> PhaseResult:
    if name == "profile":
        from _profile import run as run_profile

        return run_profile(cfg)
    if name == "redis":
        from _redis import run as run_redis

        return run_redis(cfg)
    from _sql import run as run_sql

    return run_sql(name, cfg)


def _spawn(name: str, cfg: Config) -> PhaseResult:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    try:
        cmd = [sys.executable, __file__, "--phase", name, "--config", cfg.to_json(), "--result", str(out)]
        started = time.perf_counter()
        proc = subprocess.run(cmd, timeout=PHASE_TIMEOUT, check=False)
        print(f"[bench] phase {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"phase exited with status {proc.returncode}")
        return PhaseResult(**json.loads(out.read_text()))
    finally:
        out.unlink(missing_ok=True)


def _versions() -> str:
    found = []
    for dist in ("redis", "psycopg", "SQLAlchemy", "pydantic", "dbos", "aws-lambda-powertools"):
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
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"nproc {nproc} ({model or platform.processor() or 'unknown CPU'}), {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()} ({platform.python_implementation()})"
    )


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _command() -> str:
    exe = sys.executable
    if exe.startswith(str(ROOT) + os.sep):
        exe = os.path.relpath(exe, ROOT)
    return shlex.join([exe, *sys.argv])


def _per_sql_backend(
    series: dict[str, Any], a: str, b: str, say: Callable[[str, float, float], str]
) -> list[str]:
    """``say(label, p50 of a, p50 of b)`` for each SQL backend that measured both series."""
    found = []
    for backend, label in (("sqlite", "SQLite"), ("postgres", "Postgres")):
        first, second = series.get(f"{backend}.{a}"), series.get(f"{backend}.{b}")
        if first and second:
            found.append(say(label, first["p50"], second["p50"]))
    return found


def _alone(series: dict[str, Any]) -> str:
    """The same guarded call measured alone and interleaved with DBOS running."""
    found = _per_sql_backend(
        series,
        "alone.new",
        "new",
        lambda label, alone, beside: f"{label} {alone:.0f} µs alone, {beside:.0f} µs beside DBOS",
    )
    return "the guarded new call: " + "; ".join(found) + "." if found else "(not measured)."


def _notes(info: dict[str, Any], cfg: Config, series: dict[str, Any]) -> list[str]:
    notes = [
        "Each phase runs in a process of its own and starts with the disk quiet: `os.sync()` and a "
        "Postgres `CHECKPOINT` first, so nothing an earlier phase wrote (the SQLite million-row "
        "load, say) is flushed under its measurements.",
        "SQL floors: the ratio is judged against the **SQLAlchemy Core** floor (INSERT commit + "
        "UPDATE commit of one row of the store's own table layout, on the engine `make_engine` "
        "builds, so the same pool, pragmas and `BEGIN IMMEDIATE`): the store is built on SQLAlchemy "
        "by design, so that is what the same stack costs without sagaguard. The raw-driver floor "
        "(sqlite3 with the same pragmas; psycopg in autocommit, one round trip per commit) is shown "
        "for context.",
        "DBOS: `@DBOS.workflow` calling one no-op `@DBOS.step`; *a DBOS step* is the step call timed "
        "inside the workflow (the figure DBOS's own benchmarks quote per step), the whole one-step "
        "workflow is shown for context. SQLite: DBOS's file is switched to WAL first "
        "(synchronous=FULL is the default), the store's own settings; DBOS as it comes (rollback "
        "journal) is measured separately after, with fewer calls. Postgres: DBOS's system database is"
        " the run's fresh database, the one the store's table lives in. A guarded new call is two "
        "durable commits (the claim must be on disk before the effect runs), a DBOS step one (it "
        "writes nothing before the step, which is why a crash mid-step re-runs it). DBOS is context, "
        "with no limit: the ratio moved from 0.19x to 0.36x between machines and runs, because a DBOS"
        " step is mostly Python and a guarded call mostly I/O (the *Balance* line above); the "
        "throughput yardstick (bench/throughput.py, below) judges the guard against its own floor "
        "instead. DBOS runs nine background threads once launched (queue polling, notification "
        "listener, scheduler, ...), which weigh on whatever else the process runs, and no user of "
        "either runs the other beside it: so the DBOS rows measure "
        f"each alone, in {DBOS_ROUNDS} rounds that alternate a block of guarded calls (DBOS not "
        "launched) with a block of DBOS workflows (DBOS launched, then destroyed). The rows "
        "interleaved with DBOS running are context; "
        f"{_alone(series)}",
        "Powertools: `idempotent_function` with `RedisCachePersistenceLayer` on the same redis-py "
        "client, a stand-in Lambda context registered (300 s remaining); its package's DynamoDB "
        "layer needs boto3, which is not installed, so that one module is replaced by a stub "
        "(the Redis layer does not use it). A new call is SET NX + SET; a replay SET NX + GET.",
        "Redis: the issue's floors go through redis-py's command path on the store's client "
        "(built like `RedisStore` builds one). The store's scripts skip that path (pre-packed "
        "EVALSHA on pooled connections), so the same floors sent pre-packed are shown for context: "
        "they are what a round trip costs without redis-py's per-command overhead. Every key is "
        "under the run's prefix with a TTL and removed at the end.",
        "`store_claim_complete` / `store_claim_existing`: the store's primitives with no guard "
        "above them, interleaved with the rest; the guard's own cost is the difference. Between "
        "two socket round trips the guard's Python runs with cold caches, so it costs two to three "
        "times what the hot-loop component table below says.",
        "SQLite and Postgres figures are fsync-bound. On a shared VM other processes' fsyncs change "
        "commit latency several-fold within minutes, so compare figures only within one "
        "interleaved group (`sqlite.*`, `sqlite.async.*`, `sqlite.million.*` are three groups); "
        "every target above compares two series of the same group.",
        "Async: `await` on a guarded `async def` no-op on the same store as the sync call, "
        "context with no limit (the throughput yardstick's 64 and 256 tasks rows judge async "
        "calls now). The first row is the guard as it comes (`offload=None`: the store decides). SQLite: the "
        "claim and the record are written on the event loop when they can start at once (a kept "
        "connection, the write lock free under a zero busy timeout), so the loop waits only for "
        "the commit's own fsync, never for another writer's lock; otherwise, and while the "
        "store's writes average over 2 ms, in a worker thread. Postgres: the claim and the record "
        "awaited on the loop (libpq's non-blocking interface on a kept connection: a row lock or a "
        "slow network holds up the call, never the loop), rarer calls in a worker thread. Redis "
        "and memory: called "
        "directly (one round trip costs less than two thread hops). `offload=True` forces the "
        "thread for every store call (`sagaguard.idempotency.backends.offload`: the package's worker "
        "threads, a "
        "queue and a future per hop), `offload=False` forces direct calls.",
    ]
    if cfg.million:
        notes.append(
            f"Million: {cfg.million_rows:,} finished records in the store's own format (SQLite "
            "executemany in one transaction, Postgres COPY + VACUUM ANALYZE, Redis pipelined "
            "HSET + PEXPIRE into logical database "
            f"{info.get('redis_million_db', cfg.redis_million_db)}); load times in seconds: "
            f"SQLite {info.get('sqlite_million_load_s', 'n/a')}, Postgres "
            f"{info.get('postgres_million_load_s', 'n/a')}, Redis {info.get('redis_million_load_s', 'n/a')}."
            " The empty store is measured interleaved with the full one."
        )
    else:
        notes.append("Million-record figures: run with `--million`.")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tenth of the calls; prints, writes nothing")
    parser.add_argument(
        "--million", action="store_true", help="also measure stores holding 1,000,000 records"
    )
    parser.add_argument("--million-rows", type=int, default=Config.million_rows, help="rows for --million")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {PHASES}")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every iteration count")
    parser.add_argument("--write", action="store_true", help="write docs even with --quick")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--json", type=Path, help="also save the raw figures here")
    parser.add_argument("--redis-url", default=Config.redis_url)
    parser.add_argument("--redis-million-db", type=int, default=Config.redis_million_db)
    parser.add_argument("--pg-url", default=Config.pg_url, help="an existing database to connect to")
    parser.add_argument(
        "--from-json", type=Path, help="re-render the docs from figures saved by --json (no measuring)"
    )
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.phase:  # inside a phase process
        result = _run_phase(args.phase, Config.from_json(args.config))
        Path(args.result).write_text(json.dumps(dataclasses.asdict(result)))
        return 0

    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        meta, info, series, extra = saved["meta"], saved["info"], saved["series"], saved["extra"]
        # Re-rendered: the figures, command, date and machine stay those of the saved run.
        cfg = Config(**meta["config"]) if "config" in meta else Config(million="--million" in meta["command"])
    else:
        cfg = Config(
            quick=args.quick,
            million=args.million,
            scale=args.scale,
            redis_url=args.redis_url,
            redis_million_db=args.redis_million_db,
            pg_url=args.pg_url,
            million_rows=args.million_rows,
        )
        phases = [p.strip() for p in args.phases.split(",") if p.strip()]
        for name in phases:
            if name not in PHASES:
                parser.error(f"unknown phase {name!r}")
        meta, info, series, extra = _measure(cfg, phases)
    meta["notes"] = _notes(info, cfg, series)
    block = render(series, meta, extra)
    print(block)
    if args.json:
        args.json.write_text(
            json.dumps({"meta": meta, "info": info, "series": series, "extra": extra}, indent=1)
        )
    if not args.no_write and (args.write or not args.quick):
        write(args.output, block)
        print(f"[bench] wrote {args.output}", file=sys.stderr)
    return 1 if meta["failures"] else 0


def _quiet_disk(cfg: Config) -> None:
    """Flush what earlier phases left to be written (the kernel's dirty pages, Postgres's dirty
    buffers) before the next phase starts: a guarded call waits for two flushes, and a million-row
    load written back under the next phase's measurements slowed its commits by a fifth."""
    os.sync()
    with contextlib.suppress(Exception):  # no server, or no right to CHECKPOINT: the sync is enough
        import psycopg

        with psycopg.connect(cfg.pg_url, autocommit=True, connect_timeout=5) as conn:
            conn.execute("CHECKPOINT")
    os.sync()


def _measure(
    cfg: Config, phases: list[str]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Run the phases, one process each; returns meta, info, series and extra."""
    meta: dict[str, Any] = {
        "command": _command(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": _machine(),
        "balance": balance(),
        "load_before": _load(),
        "versions": _versions(),
        "failures": {},
        "million_rows": cfg.million_rows,
        "config": dataclasses.asdict(cfg),
    }
    series: dict[str, dict[str, float]] = {}
    info: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name in phases:
        _quiet_disk(cfg)
        try:
            result = _spawn(name, cfg)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            meta["failures"][name] = str(exc)
            continue
        series.update(result.series)
        info.update(result.info)
        extra.update(result.extra)
    meta["load_after"] = _load()
    server = ", ".join(
        f"{label} {info[key]}"
        for label, key in (
            ("Redis", "redis_version"),
            ("PostgreSQL", "postgres_version"),
            ("SQLite", "sqlite_version"),
        )
        if key in info
    )
    meta["versions"] = f"{server}; {meta['versions']}" if server else meta["versions"]
    return meta, info, series, extra


if __name__ == "__main__":
    sys.exit(main())
