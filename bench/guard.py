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
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Config, PhaseResult, balance
from _report import render, write

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("memory", "redis", "sqlite", "postgres")
PHASE_TIMEOUT = 1800


def _run_phase(name: str, cfg: Config) -> PhaseResult:
    if name == "memory":
        from _memory import run as run_memory

        return run_memory(cfg)
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
    block = render(series, meta)
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
