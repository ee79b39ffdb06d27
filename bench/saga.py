"""Benchmark of a saga's overhead per step against one raw commit and DBOS, into docs/benchmarks.md.

::

    .venv/bin/python bench/saga.py --quick      # smoke check, < 60 s, prints only
    .venv/bin/python bench/saga.py              # full run, writes the docs

A saga of ``--steps`` (10) no-op steps runs under a fresh saga id per call on a
:class:`~sagaguard.saga.journals.sql.SqlJournal`; its cost per step is the whole run divided by the steps.
Interleaved with it in the same process (``_harness.interleave``): the floor, one UPDATE commit of
one row on the journal's own engine (SQLAlchemy Core; judged as a run of ``--steps`` commits divided
by ``--steps``, timed like the saga) and on the bare driver (context), and
a DBOS workflow of the same number of no-op steps on the same kind of database (per step likewise).
Each database kind runs in its own process (DBOS is a process-wide singleton). Needs Postgres at
127.0.0.1:5432 (user postgres, trust auth) unless told otherwise; it creates its own database and
drops it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter_ns
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Config
from _harness import Case, interleave
from _report import write
from guard import _command, _load, _machine, _versions

from sagaguard.idempotency import Guard, MemoryStore
from sagaguard.saga import Saga, SagaRunner, SagaState, StepContext

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- bench:saga:start -->", "<!-- bench:saga:end -->"
KINDS = ("sqlite", "postgres")
ITERATIONS = {"sqlite": 300, "postgres": 300}
"""Sagas per series in a full run (``--quick``: a tenth, at least 20)."""
PHASE_TIMEOUT = 1800


@dataclass(frozen=True)
class Settings:
    """One run's settings, passed to each phase process as JSON."""

    quick: bool = False
    steps: int = 10
    scale: float = 1.0
    pg_url: str = Config.pg_url

    def iterations(self, kind: str) -> int:
        n = ITERATIONS[kind] * self.scale
        return max(20, int(n / 10 if self.quick else n))

    def warmup(self, kind: str) -> int:
        return 5 if self.quick else max(10, self.iterations(kind) // 10)


# --------------------------------------------------------------------------- inside a phase


def _floors(kind: str, url: str, engine: Any, steps: int) -> tuple[dict[str, Case], Any]:
    """One UPDATE commit of one row: through SQLAlchemy Core on ``engine`` (as a run of ``steps``
    commits divided by ``steps``, the way a saga's steps are timed), and on the bare driver."""
    import sqlalchemy as sa

    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS bench_floor (id INTEGER PRIMARY KEY, n INTEGER)")
        conn.exec_driver_sql("INSERT INTO bench_floor (id, n) VALUES (1, 0)")
    update = sa.text("UPDATE bench_floor SET n = n + 1 WHERE id = 1")

    def core_run(_i: int) -> int:
        t0 = perf_counter_ns()
        for _ in range(steps):
            with engine.begin() as conn:
                conn.execute(update)
        return (perf_counter_ns() - t0) // steps

    if kind == "sqlite":
        raw = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)
        for pragma in ("busy_timeout = 30000", "journal_mode = WAL", "synchronous = FULL"):
            raw.execute(f"PRAGMA {pragma}")

        def raw_floor(_i: int) -> int:
            t0 = perf_counter_ns()
            raw.execute("BEGIN IMMEDIATE")
            raw.execute("UPDATE bench_floor SET n = n + 1 WHERE id = 1")
            raw.execute("COMMIT")
            return perf_counter_ns() - t0

        return {"floor_core_run": core_run, "floor_raw": raw_floor}, raw.close

    import psycopg

    pconn = psycopg.connect(url, autocommit=True)

    def pg_floor(_i: int) -> int:
        t0 = perf_counter_ns()
        pconn.execute("UPDATE bench_floor SET n = n + 1 WHERE id = 1")
        return perf_counter_ns() - t0

    return {"floor_core_run": core_run, "floor_raw": pg_floor}, pconn.close


def _noop(ctx: StepContext, value: int) -> int:
    return value


def _saga_case(journal: Any, steps: int, tag: str) -> Case:
    """A saga of ``steps`` no-op steps under a fresh id; returns its duration per step."""
    noops: Saga[int] = Saga("bench_noops", input=int)
    for k in range(steps):
        noops.step(name=f"s{k}", compensate=None)(_noop)
    # The steps call no guarded effect, so the guard's store is never touched.
    runner = SagaRunner(journal, Guard(MemoryStore()), wait=0)

    def case(i: int) -> int:
        t0 = perf_counter_ns()
        outcome = runner.run(noops, f"{tag}-{i}", i)
        elapsed = perf_counter_ns() - t0
        if outcome.state is not SagaState.COMPLETED:
            raise RuntimeError(f"bench saga ended {outcome.state}")
        return elapsed // steps

    return case


def _count_round_trips(journal: Any, engine: Any, saga_case: Case, index: int) -> dict[str, int]:
    """The commits and statements of one more saga run, counted at the driver.

    The journal's hot path runs on the driver's own cursors, out of sight of SQLAlchemy's
    execution events, so every connection the engine's pool hands out meanwhile is watched
    directly: the journal takes a connection from the pool for each call and gives it back at
    once, so the watch starts and ends with each checkout. SQLite's trace callback sees every
    statement the library runs (``BEGIN``, ``COMMIT``, each row of an ``executemany``); on
    Postgres a cursor class counts each execute (one round trip) and each commit (an autocommit
    statement outside ``BEGIN``, or ``COMMIT``). Commits SQLAlchemy makes itself are counted by its
    ``commit`` event.
    """
    import psycopg
    import sqlalchemy as sa

    from sagaguard.idempotency.backends.sql_pq import PqCursor

    counts = {"commits": 0, "statements": 0}
    sqlite = engine.dialect.name == "sqlite"

    def traced(sql: str) -> None:
        counts["statements"] += 1
        if sql.strip().upper() == "COMMIT":
            counts["commits"] += 1

    class Counting(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            traced(str(query))
            conn = self.connection
            idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            if conn.autocommit and idle and str(query).strip().upper() != "BEGIN":
                counts["commits"] += 1  # a statement of its own: one transaction
            return super().execute(query, params, **kwargs)

        def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> None:
            traced(str(query))
            super().executemany(query, params_seq, **kwargs)

    class CountingRaw(PqCursor):  # the hot path's cursors (sql_driver.raw_cursor)
        def execute(self, query: str, params: Any = None, *, prepare: bool | None = None) -> None:
            traced(query)
            conn = self.connection
            idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            if conn.autocommit and idle and query.strip().upper() != "BEGIN":
                counts["commits"] += 1  # a statement of its own: one transaction
            super().execute(query, params, prepare=prepare)

    def on_checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        if sqlite:
            dbapi_conn.set_trace_callback(traced)
        else:
            dbapi_conn.cursor_factory = Counting

    def on_checkin(dbapi_conn: Any, _record: Any) -> None:
        if sqlite:
            dbapi_conn.set_trace_callback(None)
        else:
            dbapi_conn.cursor_factory = psycopg.Cursor

    def on_commit(_conn: Any) -> None:
        if not sqlite:  # SQLite's COMMIT is seen by the trace callback
            counts["commits"] += 1

    sa.event.listen(engine, "checkout", on_checkout)
    sa.event.listen(engine, "checkin", on_checkin)
    sa.event.listen(engine, "commit", on_commit)
    from sagaguard.idempotency.backends import sql_driver

    engine.dispose()  # connections made afresh, with counting cursors (the pool keeps one each)
    hot_cursor, sql_driver.raw_cursor = sql_driver.raw_cursor, CountingRaw  # type: ignore[assignment]
    try:
        saga_case(index)
    finally:
        sql_driver.raw_cursor = hot_cursor  # type: ignore[assignment]
        sa.event.remove(engine, "checkout", on_checkout)
        sa.event.remove(engine, "checkin", on_checkin)
        sa.event.remove(engine, "commit", on_commit)
    return {f"saga_{k}": v for k, v in counts.items()}


def _dbos_case(url: str, steps: int) -> tuple[Case, Any, dict[str, Any]]:
    import _dbos_saga
    from _dbos import dbos_case

    _, _, stop, info = dbos_case(url)

    def case(_i: int) -> int:
        t0 = perf_counter_ns()
        _dbos_saga.noop_steps_workflow(steps)
        return (perf_counter_ns() - t0) // steps

    return case, stop, info


def _phase(kind: str, cfg: Settings) -> dict[str, Any]:
    import sqlalchemy as sa
    from _sql import _database

    from sagaguard.idempotency.stores.sql import make_engine
    from sagaguard.saga.journals.sql import SqlJournal

    info: dict[str, Any] = {"sqlalchemy": sa.__version__}
    tag = f"sb-{uuid.uuid4().hex[:8]}"
    n, warm = cfg.iterations(kind), cfg.warmup(kind)
    with _database(kind, Config(pg_url=cfg.pg_url)) as url:
        engine = make_engine(url)
        with engine.connect() as conn:
            if kind == "sqlite":
                info["sqlite_version"] = sqlite3.sqlite_version
            else:
                info["postgres_version"] = conn.exec_driver_sql("SHOW server_version").scalar()
        journal = SqlJournal(engine)
        floors, close_raw = _floors(kind, url, engine, cfg.steps)
        dbos_url = url
        if kind == "sqlite":
            # The journal's settings: WAL (persisted in the file) and synchronous=FULL (the default).
            dbos_url = url.replace("sagaguard.db", "dbos.db")
            with sqlite3.connect(dbos_url.removeprefix("sqlite:///")) as conn:
                conn.execute("PRAGMA journal_mode = WAL")
        dbos, stop_dbos, dbos_info = _dbos_case(dbos_url, cfg.steps)
        info.update(dbos_info)
        try:
            cases = {"saga_step": _saga_case(journal, cfg.steps, tag), **floors, "dbos_step": dbos}
            found = interleave(cases, n, warmup=warm, block=5)
            info.update(_count_round_trips(journal, engine, cases["saga_step"], n + warm))
        finally:
            stop_dbos()
            close_raw()
            journal.close()
            engine.dispose()
    info = {f"{kind}_{k}" if k.startswith("saga_") else k: v for k, v in info.items()}
    return {"series": {f"{kind}.{k}": v.as_dict() for k, v in found.items()}, "info": info}


# ------------------------------------------------------------------------------------ report


_FLOORS = (
    ("floor_core_run", "one commit, SQLAlchemy Core", 1.3),
    ("floor_raw", "one commit, bare driver", None),
    ("dbos_step", "a DBOS step", None),
)
"""What a saga step is set beside: the series, what it is, the limit of the ratio (None: context)."""


def _fmt(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} µs"


def render(series: dict[str, dict[str, float]], meta: dict[str, Any]) -> str:
    """The headline block between the saga markers: a step per database against one commit (the
    judged floor), the bare driver's commit and a DBOS step. Every series is in the printout."""
    steps = meta["steps"]
    out = [
        "## A saga step against one commit (`bench/saga.py`)",
        "",
        f"`{meta['command']}`, {meta['date']}, load average {meta['load_before']} before and "
        f"{meta['load_after']} after. {meta['versions']}.",
        "",
        f"A saga of {steps} no-op steps (`SagaRunner.run` on a `SqlJournal`, a fresh saga id per "
        "run), timed end to end and divided by its steps, beside one commit of a one-row UPDATE "
        f"(timed the same way: a run of {steps} divided by {steps}) and a DBOS workflow of as many "
        "no-op steps; all interleaved in one process, ratios of p50s. A step is one journal commit "
        f"(a saga of {steps} steps makes {steps + 1}: the start is one more).",
        "",
        "| database | saga step p50 (p99) | against | its p50 (p99) | ratio | target |",
        "|---|---|---|---|---:|---|",
    ]
    for kind, name in (("sqlite", "SQLite"), ("postgres", "Postgres")):
        step = series.get(f"{kind}.saga_step")
        if step is None:
            out.append(f"| {name} | not run | | | | |")
            continue
        for floor, what, limit in _FLOORS:
            base = series.get(f"{kind}.{floor}")
            if base is None:
                continue
            ratio = step["p50"] / base["p50"]
            verdict = "met" if limit is not None and ratio <= limit else "**not met**"
            target = "" if limit is None else f"<= {limit:g}x: {verdict}"
            out.append(
                f"| {name} | {_fmt(step['p50'])} ({_fmt(step['p99'])}) | {what} | "
                f"{_fmt(base['p50'])} ({_fmt(base['p99'])}) | {ratio:.2f}x | {target} |"
            )
    if meta.get("failures"):
        out += ["", "Phases that failed:", ""]
        out += [f"- `{name}`: {error}" for name, error in meta["failures"].items()]
    return "\n".join(out)


# -------------------------------------------------------------------------------------- main


def _spawn(kind: str, cfg: Settings) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    try:
        config = json.dumps(dataclasses.asdict(cfg))
        cmd = [sys.executable, __file__, "--phase", kind, "--config", config, "--result", str(out)]
        started = time.perf_counter()
        proc = subprocess.run(cmd, timeout=PHASE_TIMEOUT, check=False)
        print(f"[bench] phase {kind}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"phase exited with status {proc.returncode}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result
    finally:
        out.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tenth of the runs; prints, writes nothing")
    parser.add_argument("--steps", type=int, default=Settings.steps, help="no-op steps per saga")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {KINDS}")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every iteration count")
    parser.add_argument("--write", action="store_true", help="write docs even with --quick")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--pg-url", default=Settings.pg_url, help="an existing database to connect to")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.phase:  # inside a phase process
        result = _phase(args.phase, Settings(**json.loads(args.config)))
        Path(args.result).write_text(json.dumps(result))
        return 0

    if args.steps < 1:
        parser.error("--steps must be >= 1")
    cfg = Settings(quick=args.quick, steps=args.steps, scale=args.scale, pg_url=args.pg_url)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"unknown kind {kind!r}")
    meta: dict[str, Any] = {
        "command": _command(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": _machine(),
        "load_before": _load(),
        "versions": _versions(),
        "steps": cfg.steps,
        "failures": {},
    }
    series: dict[str, dict[str, float]] = {}
    info: dict[str, Any] = {}
    for kind in kinds:
        try:
            result = _spawn(kind, cfg)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            meta["failures"][kind] = str(exc)
            continue
        series.update(result["series"])
        info.update(result["info"])
    meta["load_after"] = _load()
    server = ", ".join(
        f"{label} {info[key]}"
        for label, key in (("PostgreSQL", "postgres_version"), ("SQLite", "sqlite_version"))
        if key in info
    )
    meta["versions"] = f"{server}; {meta['versions']}" if server else meta["versions"]
    block = render(series, meta)
    print(block)
    if not args.no_write and (args.write or not args.quick):
        write(args.output, block, (START, END))
        print(f"[bench] wrote {args.output}", file=sys.stderr)
    return 1 if meta["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
