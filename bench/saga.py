"""Benchmark of a saga's overhead per step against one raw commit and DBOS, into docs/benchmarks.md.

::

    .venv/bin/python bench/saga.py --quick      # smoke check, < 60 s, prints only
    .venv/bin/python bench/saga.py              # full run, writes the docs

A saga of ``--steps`` (10) no-op steps runs under a fresh saga id per call on a
:class:`~sagaguard.saga.journals.sql.SqlJournal`; its cost per step is the whole run divided by the steps.
Interleaved with it in the same process (``_harness.interleave``): the floor, one UPDATE commit of
one row on the journal's own engine (SQLAlchemy Core; judged as a run of ``--steps`` commits divided
by ``--steps``, timed like the saga, and shown alone as context) and on the bare driver (context), and
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
    """One UPDATE commit of one row: through SQLAlchemy Core on ``engine`` (alone, and as a run of
    ``steps`` commits divided by ``steps``, the way a saga's steps are timed), and on the bare
    driver."""
    import sqlalchemy as sa

    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS bench_floor (id INTEGER PRIMARY KEY, n INTEGER)")
        conn.exec_driver_sql("INSERT INTO bench_floor (id, n) VALUES (1, 0)")
    update = sa.text("UPDATE bench_floor SET n = n + 1 WHERE id = 1")

    def core(_i: int) -> int:
        t0 = perf_counter_ns()
        with engine.begin() as conn:
            conn.execute(update)
        return perf_counter_ns() - t0

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

        return {"floor_core_run": core_run, "floor_core": core, "floor_raw": raw_floor}, raw.close

    import psycopg

    pconn = psycopg.connect(url, autocommit=True)

    def pg_floor(_i: int) -> int:
        t0 = perf_counter_ns()
        pconn.execute("UPDATE bench_floor SET n = n + 1 WHERE id = 1")
        return perf_counter_ns() - t0

    return {"floor_core_run": core_run, "floor_core": core, "floor_raw": pg_floor}, pconn.close


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


@dataclass(frozen=True)
class _Target:
    label: str
    measured: str
    base: str
    limit: float | None
    """None: context with no limit (DBOS: its 0.3x limit is retired, see bench/throughput.py)."""
    judged: bool = True


def _targets() -> list[_Target]:
    rows = []
    for kind, name, driver in (("sqlite", "SQLite", "sqlite3"), ("postgres", "Postgres", "psycopg")):
        rows += [
            _Target(f"{name}: saga step vs one commit, SQLAlchemy Core floor (a run of commits / its length)",
                    f"{kind}.saga_step", f"{kind}.floor_core_run", 1.3),
            _Target(f"{name}: saga step vs one commit, SQLAlchemy Core floor (single commits)",
                    f"{kind}.saga_step", f"{kind}.floor_core", 1.3, False),
            _Target(f"{name}: saga step vs one commit, raw {driver} floor", f"{kind}.saga_step",
                    f"{kind}.floor_raw", 1.3, False),
            _Target(f"{name}: saga step vs a DBOS workflow step", f"{kind}.saga_step",
                    f"{kind}.dbos_step", None, False),
        ]  # fmt: skip
    return rows


_WHAT = {
    "saga_step": "saga of {steps} no-op steps, fresh id, whole run / {steps}",
    "floor_core_run": "floor: {steps} UPDATE commits in a row / {steps}, SQLAlchemy Core, journal's engine",
    "floor_core": "floor: one UPDATE commit, SQLAlchemy Core on the journal's engine",
    "floor_raw": "floor: one UPDATE commit, raw driver",
    "dbos_step": "DBOS workflow of {steps} no-op steps, whole workflow / {steps}",
}


def _limit(limit: float | None) -> str:
    return "—" if limit is None else f"{limit:g}x"


def _fmt(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} µs"


def render(series: dict[str, dict[str, float]], meta: dict[str, Any]) -> str:
    """The markdown between the saga markers."""
    steps = meta["steps"]
    out = [
        "## Saga overhead per step (`bench/saga.py`)",
        "",
        f"Produced by `{meta['command']}` on {meta['date']}.",
        "",
        f"Machine: {meta['machine']}. Load average before/after: {meta['load_before']} / "
        f"{meta['load_after']}. Versions: {meta['versions']}.",
        "",
        f"A saga of {steps} no-op steps (`SagaRunner.run` on a `SqlJournal`, a fresh saga id per run) "
        "is timed end to end and divided by its steps; a DBOS workflow of the same number of no-op "
        "`@DBOS.step`s likewise. The floor is one commit: an UPDATE of one row in its own "
        "transaction. The **SQLAlchemy Core** floor (same engine as the journal: `make_engine`'s "
        "pool, pragmas and `BEGIN IMMEDIATE`) is the one judged, timed the way the saga is: a run "
        f"of {steps} commits in a row divided by {steps}, so that both sides' p50 is that of a mean "
        "of as many commits (a single commit's p50 sits below its mean when the disk is busy: that "
        "floor is shown too, as context); the raw-driver floor (sqlite3 with "
        "the same pragmas; psycopg in autocommit) is context. All series of a database run "
        "interleaved in one process, in small alternating blocks, so machine noise hits each alike; "
        "ratios are of p50s.",
        "",
        "| target | saga p50 (p99) per step | base p50 (p99) | ratio | limit | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for t in _targets():
        m, b = series.get(t.measured), series.get(t.base)
        if m is None or b is None:
            out.append(f"| {t.label} | n/a | n/a | n/a | {_limit(t.limit)} | not run |")
            continue
        ratio = m["p50"] / b["p50"]
        if t.limit is None:
            verdict = "(context)"
        elif t.judged:
            verdict = "**met**" if ratio <= t.limit else "**not met**"
        else:
            verdict = "(context) within" if ratio <= t.limit else "(context) over"
        out.append(
            f"| {t.label} | {_fmt(m['p50'])} ({_fmt(m['p99'])}) | {_fmt(b['p50'])} ({_fmt(b['p99'])}) "
            f"| {ratio:.2f}x | {_limit(t.limit)} | {verdict} |"
        )
    out += ["", "| series | what | p50 | p99 | mean | runs |", "|---|---|---|---|---|---|"]
    for name, s in series.items():
        what = _WHAT.get(name.split(".", 1)[1], "").format(steps=steps)
        figures = " | ".join(_fmt(s[k]) for k in ("p50", "p99", "mean"))
        out.append(f"| `{name}` | {what} | {figures} | {int(s['n'])} |")
    out += ["", *[f"- {note}" for note in meta["notes"]]]
    if meta.get("failures"):
        out += ["", "Phases that failed:", ""]
        out += [f"- `{name}`: {error}" for name, error in meta["failures"].items()]
    return "\n".join(out)


def _notes(steps: int, info: dict[str, Any]) -> list[str]:
    counted = ", ".join(
        f"{name} {info[f'{kind}_saga_commits']} commits / {info[f'{kind}_saga_statements']} statements"
        for kind, name in (("sqlite", "SQLite"), ("postgres", "Postgres"))
        if f"{kind}_saga_commits" in info
    )
    return [
        f"A saga of {steps} steps writes {steps + 1} journal commits: the start (the saga row with "
        "the first step STARTED), then one per step (its result with the next step STARTED; the last "
        "with COMPLETED). One commit per step is the floor; the extra commit of the start is part "
        "of the measured per-step cost. On Postgres each commit is one statement in autocommit (the "
        "fenced UPDATE of the saga row with the step upserts in a data-modifying WITH); on SQLite "
        "one `BEGIN IMMEDIATE` transaction (UPDATE, the step upserts, COMMIT: statements run "
        "in-process, no round trips). Counted at the driver for one run: "
        f"{counted or 'n/a'} (the floor is one statement per commit, plus BEGIN/COMMIT on SQLite).",
        f"A saga or DBOS sample is its whole run divided by its {steps} steps (a mean of {steps} "
        f"steps), and so is a sample of the judged floor ({steps} commits in a row); a single-commit "
        "sample is one commit: when commit latency is skewed (a busy disk), the p50 of a mean sits "
        "above the p50 of single commits even at the same mean cost per commit, which is why the "
        "judged floor is timed as a run. The mean column shows every series' mean. The verdicts "
        "use p50s.",
        "SQLite: both the journal's file and DBOS's are in WAL mode with synchronous=FULL. "
        "Postgres: the journal and DBOS's system database share the run's fresh database.",
        f"DBOS {info.get('dbos', 'n/a')}. SQLite and Postgres figures are fsync-bound; on a shared VM "
        "absolute figures drift several-fold within minutes, so compare only within one database's "
        "interleaved group.",
    ]


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
    meta["notes"] = _notes(cfg.steps, info)
    block = render(series, meta)
    print(block)
    if not args.no_write and (args.write or not args.quick):
        write(args.output, block, (START, END))
        print(f"[bench] wrote {args.output}", file=sys.stderr)
    return 1 if meta["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
