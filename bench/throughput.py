"""The throughput yardstick: guarded new calls under load against the database's own floor.

::

    .venv/bin/python bench/throughput.py --quick        # smoke check (~30 s), prints only
    .venv/bin/python bench/throughput.py                # full run (~6 min), writes docs/benchmarks.md

For Postgres, SQLite and Redis: calls per second and p99 of guarded new calls (no-op body, a
default ``Guard``) with 1, 8, 32 and 128 threads and with 64 and 256 asyncio tasks, beside the
floor at the same concurrency (bench/_subjects.py), alternating which runs first; the client CPU
per call (process CPU time) against the floor's; statements, commits and WAL bytes per call; the
guard's own CPU on the memory store; and the same table for saga steps. Each backend runs in a
process of its own (``--phase``). Needs Redis at 127.0.0.1:6379 and Postgres at 127.0.0.1:5432
(user postgres, trust auth) unless told otherwise; it creates and drops its own database and
removes every Redis key it writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import write
from _throughput_phases import SAGA_STEPS, TASKS, THREADS, Result, Settings
from _throughput_phases import run as run_phase
from guard import _command, _load, _machine, _versions

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("memory", "redis", "sqlite", "postgres")
SECTION = "throughput"
"""The docs section written, between ``<!-- bench:{section}:start -->`` and its end marker."""
PHASE_TIMEOUT = 900
NAMES = {"postgres": "Postgres", "sqlite": "SQLite", "redis": "Redis", "memory": "memory"}

RATE_TARGET = 0.7
"""Guarded calls per second at least this times the floor's, at every concurrency."""
P99_TARGET = 2.0
"""Guarded p99 at most this times the floor's."""
FALL_TOLERANCE = 0.95
"""No fall from 8 to 128 threads: the rate at 128 at least this times the rate at 8 (run noise)."""
CPU_TARGET = {"postgres": 100.0, "sqlite": 100.0, "redis": 50.0}
"""Client CPU per guarded new call minus the floor's, µs."""
WAL_TARGET = 2.0
"""Postgres WAL bytes per guarded call at most this times the floor's."""


def levels() -> list[str]:
    """Every concurrency level of the guard tables, in order."""
    return [f"threads.{n}" for n in THREADS] + [f"tasks.{n}" for n in TASKS]


def _label(level: str) -> str:
    mode, n = level.split(".")
    return f"{n} {mode.removesuffix('s') if n == '1' else mode}"


def _yes(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _guard_table(
    backend: str,
    rows: dict[str, dict[str, dict[str, float]]],
    them: str,
    units: tuple[str, str] = ("calls", "calls"),
) -> list[str]:
    lines = [
        f"**{NAMES[backend]}**",
        "",
        f"| concurrency | floor {units[0]}/s | {them} {units[1]}/s | ratio | >= {RATE_TARGET}x | floor p99 | "
        f"{them} p99 | p99 ratio | <= {P99_TARGET:.0f}x |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for level, found in rows.items():
        floor, ours = found["floor"], found[them]
        ratio = ours["rate"] / floor["rate"] if floor["rate"] else 0.0
        p99 = ours["p99"] / floor["p99"] if floor["p99"] else 0.0
        lines.append(
            f"| {_label(level)} | {floor['rate']:,.0f} | {ours['rate']:,.0f} | {ratio:.2f}x | "
            f"{_yes(ratio >= RATE_TARGET)} | {floor['p99']:,.0f} µs | {ours['p99']:,.0f} µs | {p99:.2f}x | "
            f"{_yes(p99 <= P99_TARGET)} |"
        )
    return lines


def render(results: dict[str, Any], meta: dict[str, Any]) -> str:
    """The markdown block for docs/benchmarks.md."""
    out = [
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; load average before {meta['load_before']}, after {meta['load_after']}  ",
        f"Machine: {meta['machine']}  ",
        f"Versions: {meta['versions']}  ",
        f"Windows: {meta['window']} s each, {meta['repeats']} per series (floor and sagaguard "
        "alternating which goes first)",
        "",
        "*The load averages above include the benchmark's own threads; a higher load (other work "
        "on the machine) makes absolute figures pessimistic. The ratios against the floor, measured "
        "in neighbouring windows, are the point.*",
        "",
        "#### Guarded new calls against the floor",
        "",
    ]
    for backend in ("postgres", "sqlite", "redis"):
        found = results.get(backend)
        if not found:
            out += [f"**{NAMES[backend]}**: not measured ({meta['failures'].get(backend, 'not run')}).", ""]
            continue
        rows = found["rows"]["guard"]
        out += _guard_table(backend, rows, "guard")
        r8, r128 = rows["threads.8"]["guard"]["rate"], rows["threads.128"]["guard"]["rate"]
        out += [
            "",
            f"No fall from 8 to 128 threads: {r8:,.0f} -> {r128:,.0f} calls/s "
            f"({r128 / r8:.2f}x): {_yes(r128 >= FALL_TOLERANCE * r8)} (within {1 - FALL_TOLERANCE:.0%}, "
            "the run-to-run noise).",
            "",
        ]
    out += [
        "#### What the application host pays: client CPU per call",
        "",
        "Process CPU time (every thread, `time.process_time`) over a window, divided by the calls it "
        "completed; one thread, and 64 tasks.",
        "",
        "| backend | concurrency | floor | guarded | difference | target | verdict |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for backend in ("postgres", "sqlite", "redis"):
        found = results.get(backend)
        if not found:
            continue
        for level in ("threads.1", "tasks.64"):
            row = found["rows"]["guard"][level]
            diff = row["guard"]["cpu_us"] - row["floor"]["cpu_us"]
            judged = level == "threads.1"
            target = f"<= {CPU_TARGET[backend]:.0f} µs" if judged else "(context)"
            verdict = _yes(diff <= CPU_TARGET[backend]) if judged else ""
            out.append(
                f"| {NAMES[backend]} | {_label(level)} | {row['floor']['cpu_us']:.0f} µs | "
                f"{row['guard']['cpu_us']:.0f} µs | {diff:+.0f} µs | {target} | {verdict} |"
            )
    memory = results.get("memory")
    if memory:
        rows = memory["rows"]["guard"]
        out += [
            "",
            "The guard's own CPU, on the memory store (no I/O; reported, no limit): "
            + "; ".join(
                f"{_label(level)} {row['guard']['cpu_us']:.1f} µs per call "
                f"({row['guard']['rate']:,.0f} calls/s)"
                for level, row in rows.items()
            )
            + ".",
        ]
    out += ["", "#### What the database pays, per call (one client)", ""]
    out += [
        "| backend | measure | floor | guarded | ratio | target | verdict |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    sqlite = results.get("sqlite")
    if sqlite and sqlite.get("counts"):
        floor, ours = sqlite["counts"]["floor"], sqlite["counts"]["guard"]
        out.append(
            f"| SQLite | statements (sqlite3 trace callback; BEGIN and COMMIT count) | "
            f"{floor['statements']:.1f} | {ours['statements']:.1f} | "
            f"{ours['statements'] / floor['statements']:.2f}x | | |"
        )
        out.append(
            f"| SQLite | commits | {floor['commits']:.1f} | {ours['commits']:.1f} | "
            f"{ours['commits'] / floor['commits']:.2f}x | 2 | {_yes(ours['commits'] <= 2.0)} |"
        )
    pg = results.get("postgres")
    if pg and pg.get("counts"):
        floor, ours = pg["counts"]["floor"], pg["counts"]["guard"]
        out.append(
            f"| Postgres | commits (`pg_stat_database.xact_commit`) | {floor['commits']:.2f} | "
            f"{ours['commits']:.2f} | {ours['commits'] / floor['commits']:.2f}x | 2 | "
            f"{_yes(ours['commits'] <= 2.05)} |"
        )
        ratio = ours["wal_bytes"] / floor["wal_bytes"]
        out.append(
            f"| Postgres | WAL bytes (`pg_current_wal_lsn()` delta) | {floor['wal_bytes']:,.0f} | "
            f"{ours['wal_bytes']:,.0f} | {ratio:.2f}x | <= {WAL_TARGET:.0f}x | {_yes(ratio <= WAL_TARGET)} |"
        )
    out += [
        "",
        "#### Saga steps against one-row commits",
        "",
        f"A saga of {SAGA_STEPS} no-op steps (`SagaRunner.run` on a `SqlJournal`, a fresh saga id per "
        f"run) against {SAGA_STEPS} one-row commits by the same client; rates per step and per "
        "commit (one step = one commit), p99 per saga run and per run of commits. The verdict "
        "columns apply the guarded call's targets, for comparison.",
        "",
    ]
    for backend in ("postgres", "sqlite"):
        found = results.get(backend)
        if found and "saga" in found["rows"]:
            out += _guard_table(backend, found["rows"]["saga"], "saga", ("commits", "steps"))
            out.append("")
    out += [
        "#### Outbox enqueue + relay delivery against a business transaction",
        "",
        "Each call is one business transaction through a SQLAlchemy `Session`: INSERT an order row, "
        "`Outbox.enqueue` one message, commit; one `Relay` in a thread of the same process delivers "
        "to a no-op handler meanwhile. The floor, on the bare driver: the order row and a two-column "
        "message row INSERTed in one commit, then the message marked delivered in a second commit. "
        "Threads only; the relay's deliveries per second over each level follow the table.",
        "",
    ]
    for backend in ("postgres", "sqlite"):
        found = results.get(backend)
        if found and "outbox" in found["rows"]:
            rows = found["rows"]["outbox"]
            out += _guard_table(backend, rows, "outbox", ("calls", "enqueues"))
            out += [
                "",
                "Relay deliveries/s while the enqueuers ran: "
                + "; ".join(
                    f"{_label(level)} {row['outbox'].get('delivered', 0.0):,.0f}"
                    for level, row in rows.items()
                )
                + ".",
                "",
            ]
    out += ["Notes:", ""]
    out += [f"- {note}" for note in NOTES]
    return "\n".join(out)


NOTES = [
    "The floor is what the same clients pay without sagaguard for the same durable work: on "
    "Postgres an INSERT commit then an UPDATE commit of a two-column row (psycopg 3, autocommit); "
    "on SQLite the same two commits on sqlite3 with the store's settings (WAL, synchronous=FULL, "
    "BEGIN IMMEDIATE); on Redis SET NX then SET (redis-py). A guarded new call writes the claim "
    "and then the record: two durable writes.",
    "SQL clients share at most 15 connections, floor and store alike: SQLAlchemy's default pool "
    "(5 + 10 overflow), which the store's engine uses; the shared Postgres server allows 100 "
    "connections in all. Async floors: psycopg's `AsyncConnection` (15 of them) on Postgres, "
    "redis-py's asyncio client on Redis, and on SQLite the two commits in `asyncio.to_thread` "
    "(sqlite3 has no async interface).",
    "Redis: the store is opened from its URL, as users open it (`RedisStore(url, "
    "max_connections=512)`: its own blocking pool, each thread keeping a connection, up to half "
    "the pool), and the floor's client gets a pool of 512 connections too (the store's default "
    "is 64: more threads than that wait for a connection instead of failing).",
    "Each level is a closed loop: every client calls again as soon as its call returns, with a "
    "fresh key each time; calls/s is the calls completed over the window's wall time.",
    "Postgres commits per call: the difference of two sessions' `xact_commit` counts (the "
    "phase's own database; backends report as they exit), which cancels the session's own "
    "set-up. WAL bytes: the least of three windows (the server is shared; others' WAL can only "
    "add). Postgres statements per call are not counted here: `pg_stat_statements` is not loaded "
    "on the shared server.",
    "Postgres round trips per call are counted by bench/round_trips.py on a cluster of its own "
    "with `pg_stat_statements` loaded (see docs/benchmarks.md).",
]


# ------------------------------------------------------------------------------ the driver


def _spawn(name: str, cfg: Settings) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    try:
        cmd = [sys.executable, __file__, "--phase", name, "--config",
               json.dumps(dataclasses.asdict(cfg)), "--result", str(out)]  # fmt: skip
        started = time.perf_counter()
        proc = subprocess.run(cmd, timeout=PHASE_TIMEOUT, check=False)
        print(f"[bench] phase {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"phase exited with status {proc.returncode}")
        found: dict[str, Any] = json.loads(out.read_text())
        return found
    finally:
        out.unlink(missing_ok=True)


def measure(cfg: Settings, phases: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the phases, one process each; returns (results by phase, meta)."""
    meta: dict[str, Any] = {
        "command": _command(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": _machine(),
        "load_before": _load(),
        "versions": _versions(),
        "window": cfg.window,
        "repeats": cfg.repeats,
        "failures": {},
    }
    results: dict[str, Any] = {}
    for name in phases:
        try:
            results[name] = _spawn(name, cfg)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            meta["failures"][name] = str(exc)
    meta["load_after"] = _load()
    return results, meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short windows; prints, writes nothing")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {PHASES}")
    parser.add_argument("--seconds", type=float, default=Settings.seconds, help="one window's length")
    parser.add_argument("--rounds", type=int, default=Settings.rounds, help="windows per series")
    parser.add_argument("--write", action="store_true", help="write the docs even with --quick")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--json", type=Path, help="also save the raw figures here")
    parser.add_argument("--section", default=SECTION, help="the docs section to write (its markers' name)")
    parser.add_argument("--from-json", type=Path, help="re-render from figures saved by --json")
    parser.add_argument("--redis-url", default=Settings.redis_url)
    parser.add_argument("--pg-url", default=Settings.pg_url, help="an existing database to connect to")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.phase:  # inside a phase process
        found: Result = run_phase(args.phase, Settings(**json.loads(args.config)))
        Path(args.result).write_text(json.dumps(dataclasses.asdict(found)))
        return 0
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        results, meta = saved["results"], saved["meta"]
    else:
        cfg = Settings(quick=args.quick, seconds=args.seconds, rounds=args.rounds,
                       redis_url=args.redis_url, pg_url=args.pg_url)  # fmt: skip
        phases = [p.strip() for p in args.phases.split(",") if p.strip()]
        for name in phases:
            if name not in PHASES:
                parser.error(f"unknown phase {name!r}")
        results, meta = measure(cfg, phases)
    block = render(results, meta)
    print(block)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "meta": meta}, indent=1))
    if not args.no_write and (args.write or not args.quick):
        write(
            args.output, block, (f"<!-- bench:{args.section}:start -->", f"<!-- bench:{args.section}:end -->")
        )
        print(f"[bench] wrote {args.output}", file=sys.stderr)
    return 1 if meta["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
