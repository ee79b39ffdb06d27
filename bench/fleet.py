"""A fleet of worker processes sharing one database: throughput, what each call costs it, recovery.

::

    .venv/bin/python bench/fleet.py --quick        # smoke run (about a minute), prints only
    .venv/bin/python bench/fleet.py                # full run (about 6 minutes), writes docs/benchmarks.md
    .venv/bin/python bench/fleet.py --workers 4 --backend postgres --no-recovery --json out.json
    .venv/bin/python bench/fleet.py --counts-only   # only the exact counts per unit (JSON)

Each backend runs on a server of the bench's own, started for the run and removed after: Postgres
a private cluster (``bench/round_trips.py``'s, with ``pg_stat_statements``; fsync and synchronous
commit on, as installed), Redis a local cluster of three primaries and three replicas
(``tests/_rediscluster.py``'s). Then:

1. **Throughput.** 1, 2, 4 and 8 worker *processes* (bench/_fleet_worker.py) each run the agent
   saga back to back for a window: three steps, each a guarded tool call (no-op body) with a
   guarded undo declared, on the backend's store and saga journal. Beside each level, the same
   number of processes run the database's floor for the same writes: per step, the guarded call's
   floor (an INSERT commit and an UPDATE commit of a two-column row, psycopg in autocommit; on
   Redis SET NX and SET) and the step's (one more commit; one more SET), from bench/_subjects.py.
   Which side runs first alternates from level to level.
2. **What the database pays.** From the server itself (bench/_fleet_server.py): commits, round
   trips (statements), WAL bytes and the server's own CPU time, per guarded call and per saga step
   (a saga of no-op steps, no effect in them), each beside its floor (two commits; one commit), at
   ``--cost-workers`` processes; and per step of the agent saga, from the throughput windows. The
   guarded call has a second floor, the same record on the bare driver (bench/_fleet_same.py): the
   store's own row (or hash) and its two writes, without sagaguard's statements around them.
   Commits, round trips (commands on Redis) and Postgres's WAL bytes are counted exactly by one
   client of this process (:func:`exact_counts`), the same on every run.
3. **Recovery** (bench/_fleet_recovery.py): four workers on one "host" under load, one SIGKILLed;
   the seconds until a sweeper on another host (``SAGAGUARD_HOST_ID``) has resumed its sagas,
   with the default lease and sweep interval; duplicates and missing effects counted at a counter
   service, sagas left behind in the journal.

The full run (every level, both backends) writes its block into docs/benchmarks.md between
``<!-- bench:fleet:start -->`` and ``<!-- bench:fleet:end -->``; ``--json`` saves every figure
(``results.backends.postgres.levels["4"].saga.rate`` is sagas/s at 4 processes). Needs
``initdb`` and ``pg_ctl`` under /usr/lib/postgresql, ``redis-server`` and ``redis-cli``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))  # tests/_rediscluster.py

from _fleet_procs import Fleet
from _fleet_same import create_table, template
from _fleet_server import difference, pg_reading, postmaster_pid, redis_reading
from _report import write
from guard import _command, _load, _machine, _versions

ROOT = Path(__file__).resolve().parent.parent
SECTION = ("<!-- bench:fleet:start -->", "<!-- bench:fleet:end -->")
HEADING = "## A fleet of worker processes (`bench/fleet.py`)"
WORKERS = (1, 2, 4, 8)
STEPS = 3
WAL_TARGET = 1.5
CPU_TARGET = 1.3
DB_CORES = 2
"""The database host the projection assumes: as many cores as this machine has."""
NAMES = {"postgres": "Postgres", "redis": "Redis Cluster"}


@dataclass
class Database:
    """One backend's server for the run: its URL and how to read its counters."""

    backend: str
    url: str
    read: Callable[[], dict[str, float]]
    version: str
    ports: list[int] = field(default_factory=list)
    """Redis: the cluster's nodes."""
    record: dict[str, Any] = field(default_factory=dict)
    """The record a real guarded call left: what the same-record floor writes (bench/_fleet_same.py)."""


@contextlib.contextmanager
def database(backend: str) -> Iterator[Database]:
    """The backend's private server, for the run."""
    if backend == "postgres":
        import psycopg
        from round_trips import cluster

        from sagaguard.idempotency import open_store
        from sagaguard.saga.journals import open_journal

        with cluster() as url:
            pid = postmaster_pid(url)
            with psycopg.connect(url) as conn:
                row = conn.execute("SHOW server_version").fetchone()
            _prepare(url, open_store, open_journal)
            yield Database(backend, url, lambda: pg_reading(url, pid), f"Postgres {row[0] if row else '?'}",
                           record=template(url))  # fmt: skip
        return
    from _rediscluster import LocalCluster

    from sagaguard.idempotency import open_store
    from sagaguard.saga.journals import open_journal

    with tempfile.TemporaryDirectory(prefix="sg-fleet-") as tmp:
        nodes = LocalCluster(Path(tmp)).start()
        try:
            _prepare(nodes.url, open_store, open_journal)
            import redis

            for port in nodes.ports:
                # No automatic AOF rewrite during the run: a rewrite shrinks the file, and a
                # window's AOF bytes (the growth of aof_current_size) would come out negative.
                with redis.Redis(port=port) as node:
                    node.config_set("auto-aof-rewrite-percentage", 0)
            client = redis.Redis(port=nodes.ports[0], decode_responses=True)
            version = f"Redis {client.info('server')['redis_version']} (3 primaries, 3 replicas, AOF)"
            client.close()
            yield Database(backend, nodes.url, lambda: redis_reading(nodes.ports), version, nodes.ports,
                           template(nodes.url))  # fmt: skip
        finally:
            nodes.stop()


def _prepare(url: str, open_store: Any, open_journal: Any) -> None:
    """Create the store's, the journal's and the floors' tables once, before workers race to."""
    open_store(url).close()
    open_journal(url).close()
    if url.startswith("postgresql"):
        from _subjects import postgres_floor

        postgres_floor(url, "prepare").close()
        create_table(url)


@dataclass(frozen=True)
class Settings:
    workers: tuple[int, ...] = WORKERS
    seconds: float = 5.0
    steps: int = STEPS
    cost_workers: int = 4
    costs: bool = True
    recovery: bool = True
    recovery_workers: int = 4
    kill_after: float = 3.0
    lease: float | None = None
    interval: float | None = None
    quick: bool = False


def windows(db: Database, kinds: list[str], n: int, cfg: Settings, tag: str) -> dict[str, dict[str, Any]]:
    """``n`` worker processes, one window of each of ``kinds`` in turn: units/s, client CPU and the
    server's figures per unit."""
    config = {"backend": db.backend, "url": db.url, "kinds": kinds, "steps": cfg.steps,
              "seconds": cfg.seconds, "tag": f"{tag}-{n}-{'-'.join(kinds)}", "effect": "noop",
              "record": db.record}  # fmt: skip
    fleet = Fleet(config, n)
    found = {}
    try:
        fleet.start()
        for kind in kinds:
            before = db.read()
            figures = fleet.run(kind)
            after = db.read()
            units = sum(int(r["units"]) for r in figures)
            found[kind] = {
                "workers": n,
                "units": units,
                "rate": sum(r["units"] / r["wall"] for r in figures if r["wall"]),
                "client_cpu_us": sum(r["cpu"] for r in figures) / units * 1e6 if units else 0.0,
                "server": difference(before, after, units),
            }
        fleet.close()
    except BaseException:
        fleet.kill_all()
        raise
    return found


def measure(db: Database, cfg: Settings, tag: str, say: Callable[[str], None]) -> dict[str, Any]:
    """The throughput levels and the cost windows on one backend."""
    levels: dict[str, dict[str, Any]] = {}
    for i, n in enumerate(cfg.workers):
        kinds = ["saga", "saga_floor"] if i % 2 == 0 else ["saga_floor", "saga"]
        levels[str(n)] = windows(db, kinds, n, cfg, tag)
        say(
            f"{db.backend} {n} workers: "
            + ", ".join(f"{k} {v['rate']:.0f}/s" for k, v in levels[str(n)].items())
        )
    costs: dict[str, dict[str, Any]] = {}
    counted: dict[str, dict[str, float]] = {}
    if cfg.costs:
        kinds = ["call", "call_floor", "call_same", "step_floor", "step"]
        costs = windows(db, kinds, cfg.cost_workers, cfg, tag)
        say(f"{db.backend} costs: " + ", ".join(f"{k} {v['rate']:.0f}/s" for k, v in costs.items()))
        counted = exact_counts(db, cfg)
        say(f"{db.backend} counted: {json.dumps(counted)}")
    return {"version": db.version, "levels": levels, "costs": costs, "counted": counted}


COUNTED = {"call": 40, "call_floor": 40, "call_same": 40, "step": 15, "step_floor": 15, "saga": 10,
           "saga_floor": 10}  # fmt: skip
"""Units in the shorter of the two counting sessions of :func:`exact_counts`, per kind, quick runs
too (a few seconds in all): enough that both sessions are past what a connection does once after a
few calls (psycopg prepares a statement after five executions, a commit of its own that no
statement counter shows), so that the difference cancels it."""
NAMED_AS = {"call_same": "call"}
"""Kinds whose units are named as another kind's: the same-record floor writes the very scopes the
guarded call writes (its own table, in a database of its own while counted), bytes the WAL holds."""


def exact_counts(db: Database, cfg: Settings) -> dict[str, dict[str, float]]:
    """What one unit of each kind costs, counted exactly by one client in this process: the same
    figures on every run.

    Keys and saga ids are named the same on every run (``count-{kind}-{session}``, never the run's
    tag or the time): on Postgres their bytes are in the WAL, and on a Redis Cluster a saga id's
    slot decides whether a journal write and its due index share a primary (one pipeline) or not
    (two), so other ids would make other counts. Postgres: statements, commits and WAL bytes in a
    fresh database, the difference of two sessions (``round_trips.count``). Redis: the commands
    this process's client sent the primaries (``redis_commands``), after two units of warm-up
    (cluster discovery, script loading).
    """
    from _fleet_server import redis_commands
    from _fleet_worker import build
    from round_trips import count

    found = {}
    for kind, n in COUNTED.items():
        sessions = iter(range(1000))

        def make(
            url: str, kind: str = kind, sessions: Iterator[int] = sessions
        ) -> tuple[Callable[[int], object], Callable[[], None]]:
            config = {"backend": db.backend, "url": url, "kind": kind, "steps": cfg.steps,
                      "tag": f"count-{NAMED_AS.get(kind, kind)}-{next(sessions):03d}", "effect": "noop",
                      "record": db.record}  # fmt: skip
            return build(config)

        if db.backend == "postgres":
            found[kind] = count(db.url, make, n)
            continue
        op, close = make(db.url)
        op(-1)
        op(-2)

        def units(op: Callable[[int], object] = op, n: int = n) -> None:
            for i in range(n):
                op(i)

        sent = redis_commands(db.ports, units)
        close()
        found[kind] = {"statements": sent / n}
    return found


def _n(value: float) -> str:
    """A count for prose: a whole number as one, else two decimals."""
    return f"{value:,.0f}" if value == round(value) else f"{value:,.2f}"


def _us(seconds: float) -> float:
    return seconds * 1e6


def _level(found: dict[str, Any], cfg_workers: int) -> str | None:
    """The throughput level the cost rows and the projection read: ``cost_workers`` if measured,
    else the largest."""
    levels = found["levels"]
    if str(cfg_workers) in levels:
        return str(cfg_workers)
    return max(levels, key=int) if levels else None


def cost_rows(found: dict[str, Any], steps: int, cost_workers: int) -> list[dict[str, Any]]:
    """Per guarded call, per saga step and per agent-saga step: our figures and the floor's.

    Commits, round trips and WAL bytes are the exact counts (one client) where taken (Postgres),
    else the window's; server CPU is always the window's (``cost_workers`` processes).
    """
    windows = {k: v["server"] for k, v in found["costs"].items()}
    level = _level(found, cost_workers)
    if level is not None:
        windows["saga"] = found["levels"][level]["saga"]["server"]
        windows["saga_floor"] = found["levels"][level]["saga_floor"]["server"]
    specs = (
        ("call", "call_floor", "guarded call (no-op body)", 1, True),
        # The second floor: the store's own record on the bare driver (bench/_fleet_same.py). No
        # target: it splits the first row's gap into the record's share and the code path's.
        ("call", "call_same", "guarded call against the same record, bare driver", 1, False),
        ("step", "step_floor", f"saga step (a saga of {steps} no-op steps, per step)", steps, True),
        ("saga", "saga_floor", f"agent-saga step (a guarded tool call in a step; CPU at {level} processes)",
         steps, False),
    )  # fmt: skip
    rows = []
    for kind, floor_kind, label, per, judged in specs:
        if kind not in windows or floor_kind not in windows:
            continue
        ours, floor = dict(windows[kind]), dict(windows[floor_kind])
        ours.update(found["counted"].get(kind, {}))
        floor.update(found["counted"].get(floor_kind, {}))
        rows.append({"unit": label, "kind": floor_kind, "per": per, "judged": judged,
                     "ours": {k: v / per for k, v in ours.items()},
                     "floor": {k: v / per for k, v in floor.items()}})  # fmt: skip
    return rows


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def render(results: dict[str, Any], meta: dict[str, Any]) -> str:
    """The markdown between the section's markers."""
    steps = meta["settings"]["steps"]
    out = [
        HEADING,
        "",
        f"Produced by `{meta['command']}` on {meta['date']}.",
        "",
        f"Machine: {meta['machine']}. Load average before / after: {meta['load_before']} / "
        f"{meta['load_after']} (after: the bench's own workers and servers included). Versions: "
        f"{meta['versions']}.",
        "",
        f"Worker processes and the database share this machine's cores, so on it the workers' own "
        f"CPU caps every throughput figure below, the floor's as much as sagaguard's; the projection "
        f"at the end says what the database alone would allow with the workers on other hosts. A "
        f"saga is the agent saga of {steps} steps, each a guarded tool call (no-op body) with a "
        f"guarded undo declared; its floor does the same durable writes on the bare driver: per step "
        f"two one-row commits for the call and one for the step (on Redis: SET NX, SET, SET). Each "
        f"window lasts {meta['settings']['seconds']:g} s; the two sides alternate which runs first.",
    ]
    for backend, found in results["backends"].items():
        name = NAMES[backend]
        out += ["", f"### {name}: throughput by worker processes ({found['version']})", ""]
        out += ["| processes | sagas/s | effects/s | floor sagas/s (same writes) | ratio "
                "| client CPU per saga (floor) |", "|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for n, level in found["levels"].items():
            ours, floor = level["saga"], level["saga_floor"]
            ratio = ours["rate"] / floor["rate"] if floor["rate"] else 0.0
            out.append(
                f"| {n} | {ours['rate']:,.0f} | {ours['rate'] * steps:,.0f} | {floor['rate']:,.0f} | "
                f"{ratio:.2f}x | {ours['client_cpu_us']:,.0f} µs ({floor['client_cpu_us']:,.0f} µs) |"
            )
        rows = cost_rows(found, steps, meta["settings"]["cost_workers"])
        if not rows:
            continue
        sql = backend == "postgres"
        out += ["", f"### {name}: what each unit costs the database server (floor's in parentheses)", ""]
        out += ["| per | commits | round trips | WAL bytes | ratio | server CPU | ratio | targets |",
                "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for row in rows:
            o, f = row["ours"], row["floor"]
            wal = o["wal_bytes"] / f["wal_bytes"] if f["wal_bytes"] else 0.0
            cpu = o["cpu"] / f["cpu"] if f["cpu"] else 0.0
            commits = f"{o['commits']:.2f} ({f['commits']:.2f})" if sql else "—"
            verdict = "(context)"
            if row["judged"]:
                # Exact counts: equal means equal (the tolerance is for the division only).
                same = abs(o["statements"] - f["statements"]) < 1e-9
                if sql:
                    same = same and abs(o["commits"] - f["commits"]) < 1e-9
                verdict = ", ".join([
                    f"{'counts' if sql else 'commands'} equal {_verdict(same)}",
                    f"WAL ≤{WAL_TARGET:g}x {_verdict(wal <= WAL_TARGET)}",
                    f"CPU ≤{CPU_TARGET:g}x {_verdict(cpu <= CPU_TARGET)}",
                ])  # fmt: skip
            out.append(
                f"| {row['unit']} | {commits} | {o['statements']:.2f} ({f['statements']:.2f}) | "
                f"{o['wal_bytes']:,.0f} ({f['wal_bytes']:,.0f}) | {wal:.2f}x | {_us(o['cpu']):,.0f} µs "
                f"({_us(f['cpu']):,.0f} µs) | {cpu:.2f}x | {verdict} |"
            )
        out += ["", _cost_sources(sql, meta["settings"]["cost_workers"]), "", _floor_note(sql)]
        if (same := _same_note(rows, sql)) is not None:
            out += ["", same]
        if "step" in found["counted"]:
            whole = found["counted"]["step"]["commits" if sql else "statements"]
            sagas = COUNTED["step"]
            out += ["", f"A saga of {steps} no-op steps is {_n(whole)} {'commits' if sql else 'commands'} "
                        f"whole{'' if sql else f' (on average over the {sagas} sagas counted)'}, "
                        f"{_n(whole - steps)} more than its steps: that excess, spread over the "
                        "steps, is what the saga-step row holds above one per step."
                        + ("" if sql else _slot_note())]  # fmt: skip
        out += ["", *_projection(found, steps, sql, meta["settings"]["cost_workers"])]
    out += _recovery(results.get("recovery"))
    if meta.get("notes"):
        out += ["", *[f"- {note}" for note in meta["notes"]]]
    return "\n".join(out)


def _floor_note(sql: bool) -> str:
    """What the floor leaves out, so the ratios read right."""
    if sql:
        return (
            "The floor writes a two-column row with a primary key only; the store's and the "
            "journal's rows carry the record (identity, fingerprint, state, token, lease, result, "
            "times) and the indexes its queries need, which is where most of the WAL difference is."
        )
    return (
        "The floor's SETs are acknowledged by the primary alone; on a cluster the store waits by "
        "default for a replica to acknowledge each claim (`WAIT`, one more round trip) so that a "
        "failover cannot lose it. The store's records are hashes with the record's fields; the "
        "floor's, short strings."
    )


def _same_note(rows: list[dict[str, Any]], sql: bool) -> str | None:
    """What the same-record floor shows: the share of the guarded call's gap to the two-column floor
    that the record itself accounts for, the rest being sagaguard's code path."""
    by_floor = {row["kind"]: row for row in rows}
    if "call_floor" not in by_floor or "call_same" not in by_floor:
        return None
    ours, floor = by_floor["call_floor"]["ours"], by_floor["call_floor"]["floor"]
    same = by_floor["call_same"]["floor"]

    def share(figure: str) -> str:
        gap = ours[figure] - floor[figure]
        return f"{(same[figure] - floor[figure]) / gap:.0%}" if gap > 0 else "n/a"

    writes = (
        "an INSERT of the columns a claim writes and an UPDATE of what its success sets, into a table "
        "made from the store's own definition (both partial indexes)" if sql else
        "the record as a hash in the store's key layout: HSET then `WAIT 1` (pipelined), then HSET and "
        "`PEXPIRE` (pipelined)"
    )  # fmt: skip
    return (
        f"The same-record row's floor writes the store's record on the bare driver: {writes}, the "
        "values a real claim wrote, but nothing conditional, fenced or read back. Of the guarded "
        f"call's excess over the two-column floor, the record itself accounts for {share('wal_bytes')} "
        f"of the {'WAL' if sql else 'AOF'} bytes and {share('cpu')} of the server CPU; what the guarded "
        "call pays beyond the same record is sagaguard's code path (the claim's check of a record in "
        "the way, the fence, what comes back)."
    )


def _slot_note() -> str:
    """Why a saga's commands on a cluster depend on its id (and so are counted on fixed ids)."""
    return (
        " A saga's start also lowers its entry in the journal's due index: when the saga id's slot "
        "and the index's are on different primaries, that is a pipeline of its own (a `ZADD` and "
        "one more `WAIT`): a saga is one command more when its id's slot is on another primary "
        "than the index's, so the count depends on the ids counted; they are the same on every run."
    )


def _cost_sources(sql: bool, workers: int) -> str:
    """Where the cost table's figures come from."""
    if sql:
        counts = (
            "Commits, round trips and WAL bytes are counted exactly, the same on every run: one "
            "client at a time in a fresh database, autovacuum off, keys named the same on every "
            "run, the difference of two sessions each closed and its server processes gone before "
            "the counters are read (`pg_stat_database` and `pg_stat_statements` of that database; "
            "the bytes of the WAL records written meanwhile, `pg_walinspect`, full-page images and "
            "the server's background records left out: a page's first change after a checkpoint "
            "copies the whole page, so those bytes depend on when the server last checkpointed). "
            "Commits and round trips come out the same on every run; WAL bytes within a few bytes "
            "per unit: a claim names its holder's process id and start time, whose digits vary, "
            "and the record of an UPDATE holds only the bytes of the row that changed, how many of "
            "a timestamp's depending on the time. "
        )
        cpu = "`/proc`: the postmaster and every child, exited ones included"
    else:
        counts = (
            "The round-trips column holds commands, counted exactly, the same on every run: those "
            "one client sent the primaries, seen with `MONITOR` (the calls a script makes inside "
            "it and other clients' commands left out), saga ids named the same on every run. The "
            "server cannot tell which came pipelined: the store sends a claim's "
            "script and its `WAIT` in one write, so a guarded call's three commands are two round "
            "trips. WAL bytes are the growth of the primaries' append-only files during the windows. "
        )
        cpu = "`INFO cpu` of every node, replicas included"
    return (
        f"{counts}Server CPU is the server's own user + system time ({cpu}) during the windows at "
        f"{workers} processes, divided by the units done."
    )


def _projection(found: dict[str, Any], steps: int, sql: bool, cost_workers: int) -> list[str]:
    """The fleet's ceiling with the workers on other hosts, from the server's CPU per saga."""
    levels, level = found["levels"], _level(found, cost_workers)
    if level is None:
        return []
    ours, floor = levels[level]["saga"]["server"]["cpu"], levels[level]["saga_floor"]["server"]["cpu"]
    if not ours or not floor:
        return []
    best = max(lv["saga"]["rate"] for lv in levels.values())
    ceiling, floor_ceiling = DB_CORES / ours, DB_CORES / floor
    return [
        f"Projection: at {level} processes the server spent {_us(ours):,.0f} µs of CPU per saga "
        f"({_us(floor):,.0f} µs for the floor's writes). With the workers on other hosts and "
        f"{DB_CORES} cores for the database alone, that is about **{ceiling:,.0f} sagas/s** "
        f"({ceiling * steps:,.0f} effects/s) against the floor's {floor_ceiling:,.0f}: "
        f"**{ceiling / floor_ceiling:.2f}x the database's ceiling for the same writes**, where this "
        f"machine measured at most {best:,.0f} sagas/s with the workers' CPU on the same two cores. "
        + ("The projection counts CPU only: a disk slower to flush than this one would cap both "
           "sides earlier, at its group-commit rate." if sql else
           "The projection counts CPU only (the AOF is flushed once a second).")
    ]  # fmt: skip


def _doubt(found: dict[str, Any]) -> str:
    answers = found.get("in_doubt") or {}
    return ", ".join(f"{n} {answer}" for answer, n in answers.items()) or "none"


def _s(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds:.1f} s"


def _recovery(found: dict[str, Any] | None) -> list[str]:
    if not found:
        return []
    wait = found["wait_s"]
    ok = wait is not None and wait <= found["bound_s"] and found["resumed"] == found["sagas_of_the_dead"]
    return [
        "",
        f"### Recovery after a SIGKILL ({NAMES[found['backend']]})",
        "",
        f"{found['workers']} worker processes on one host run the agent saga under load, each "
        "effect charging a counter service (a separate process, deduplication off, so a repeat "
        "would be counted there); one worker is SIGKILLed; a sweeper (`RecoveryWorker`) on another "
        "host (another `SAGAGUARD_HOST_ID`, so the dead worker cannot be proven dead and its lease "
        "must run out) resumes its sagas.",
        "",
        "| lease | sweep interval | sagas of the dead worker | taken over after the kill | target "
        "| completed after the kill | sagas in the run | left behind | effects counted (expected) "
        "| duplicates |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        f"| {found['lease_s']:g} s | {found['interval_s']:g} s | {found['sagas_of_the_dead']} | "
        f"{_s(wait)} | ≤ {found['bound_s']:g} s {_verdict(ok)} | {_s(found['done_s'])} | "
        f"{found['sagas']:,} | {found['left_behind']} | {found['effects_counted']:,} "
        f"({found['effects_expected']:,}) | {found['duplicates']} |",
        "",
        f"The dead worker's lease had {found['lease_left_at_kill_s']:.1f} s left when it was killed "
        "(a commit renews it once a fifth of it has passed): the wait is that remainder plus the time to the "
        "sweeper's next pass. It ends as the sweep that took the saga over starts (its claim is "
        "that sweep's first write); the saga then runs its remaining steps. Each tool call takes "
        "50 ms after its charge, so the kill most likely leaves an effect charged but not recorded; "
        f"effects the sweeper found in doubt and settled with the counter service: {_doubt(found)}.",
    ]


def _shared_note(load_before: str) -> str | None:
    """A note when other work shared the machine as the run began: the 1-minute load average before
    it above the machine's cores. The load after is no sign of that: it holds the bench's own
    workers and servers."""
    cores = os.cpu_count() or 1
    if load_before == "n/a" or float(load_before.split(maxsplit=1)[0]) <= cores:
        return None
    return (
        f"The machine was shared as this ran: a load average of {load_before.split(maxsplit=1)[0]} over the "
        f"minute before it, on {cores} cores. The rates and CPU times are noisy, and the ratios of "
        "one run more than its absolute figures; the counts (commits, round trips, commands, "
        "effects) are not."
    )


def counts_only(backends: tuple[str, ...], cfg: Settings) -> dict[str, Any]:
    """Only the exact counts (:func:`exact_counts`) on each backend's fresh server: a fast check
    that they come out the same on every run."""
    found = {}
    for backend in backends:
        with database(backend) as db:
            found[backend] = exact_counts(db, cfg)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny windows, short lease: a smoke run")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="process counts (1 2 4 8)")
    parser.add_argument("--backend", choices=("postgres", "redis", "both"), default="both")
    parser.add_argument("--seconds", type=float, default=None, help="window length (5; quick 1)")
    parser.add_argument("--no-costs", action="store_true", help="skip the cost windows")
    parser.add_argument("--no-recovery", action="store_true", help="skip the kill and recovery")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--json", type=Path, help="also save every figure here")
    parser.add_argument(
        "--counts-only", action="store_true", help="only the exact counts per unit, printed as JSON"
    )
    args = parser.parse_args(argv)
    quick = args.quick
    cfg = Settings(
        workers=tuple(args.workers or ((1, 2) if quick else WORKERS)),
        seconds=args.seconds or (1.0 if quick else 5.0),
        costs=not args.no_costs,
        recovery=not args.no_recovery,
        cost_workers=2 if quick else 4,
        recovery_workers=2 if quick else 4,
        kill_after=1.0 if quick else 3.0,
        lease=2.0 if quick else None,  # None: the library's defaults
        interval=0.5 if quick else None,
        quick=quick,
    )
    backends = ("postgres", "redis") if args.backend == "both" else (args.backend,)
    if args.counts_only:
        counted = counts_only(backends, cfg)
        print(json.dumps(counted, indent=2))
        if args.json:
            args.json.write_text(json.dumps(counted, indent=2), encoding="utf-8")
        return 0
    meta: dict[str, Any] = {
        "command": _command(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": _machine(), "load_before": _load(), "versions": _versions(),
        "settings": {**cfg.__dict__, "workers": list(cfg.workers)}, "notes": [],
    }  # fmt: skip
    from _common import run_tag

    tag = run_tag()
    results: dict[str, Any] = {"backends": {}}

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    for backend in backends:
        with database(backend) as db:
            results["backends"][backend] = measure(db, cfg, tag, say)
            if cfg.recovery and backend == backends[0]:
                import _fleet_recovery

                found = _fleet_recovery.run(
                    backend, db.url, steps=cfg.steps, workers=cfg.recovery_workers,
                    kill_after=cfg.kill_after, tag=tag, interval=cfg.interval, lease=cfg.lease,
                )  # fmt: skip
                results["recovery"] = {"backend": backend, **found}
                say(f"recovery: {json.dumps(found)}")
    meta["load_after"] = _load()
    if (note := _shared_note(meta["load_before"])) is not None:
        meta["notes"].append(note)
    if quick:
        meta["notes"].append("Quick run: tiny windows and a 2 s lease; figures for the shape only.")
    block = render(results, meta)
    print(block)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2), encoding="utf-8")
    # Only the full run, as documented, replaces the docs' block (a run of one level or backend,
    # for a comparison, does not).
    if not quick and not args.no_write and args.workers is None and args.backend == "both":
        write(ROOT / "docs" / "benchmarks.md", block, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
