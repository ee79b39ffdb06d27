"""Turning the phases' figures into the markdown block of ``docs/benchmarks.md``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START, END = "<!-- bench:guard:start -->", "<!-- bench:guard:end -->"


@dataclass(frozen=True)
class Target:
    """One target from the issue: ``measured.p50 <= limit * base.p50``."""

    label: str
    measured: str
    base: str
    limit: float | None
    """None: a context row with no limit (DBOS, Powertools and async-vs-sync: limits retired for
    the throughput yardstick, bench/throughput.py)."""
    judged: bool = True
    """False: shown for context, not one of the issue's targets."""


def targets(million_rows: int = 1_000_000) -> list[Target]:
    redis, sqlite, pg = "Redis", "SQLite", "Postgres"
    rows = [
        Target(f"{redis}: new call vs 2 raw round trips (SET NX + SET)", "redis.new",
               "redis.floor_set_nx_set", 1.15),
        Target(f"{redis}: replay vs one PING", "redis.replay", "redis.ping", 1.2),
        Target(f"{redis}: new call vs 2 round trips pre-packed (no redis-py command path)",
               "redis.new", "redis.floor_packed", 1.15, False),
        Target(f"{redis}: replay vs one PING pre-packed", "redis.replay", "redis.ping_packed", 1.2,
               False),
        Target(f"{sqlite}: new call vs 2 commits, SQLAlchemy Core floor", "sqlite.new",
               "sqlite.floor_core", 1.3),
        Target(f"{sqlite}: new call vs 2 commits, raw sqlite3 floor", "sqlite.new",
               "sqlite.floor_raw", 1.3, False),
        Target(f"{pg}: new call vs 2 commits, SQLAlchemy Core floor", "postgres.new",
               "postgres.floor_core", 1.3),
        Target(f"{pg}: new call vs 2 commits, raw psycopg floor", "postgres.new",
               "postgres.floor_raw", 1.3, False),
        Target(f"{sqlite}: new call vs a DBOS step (same settings), each alone in the process",
               "sqlite.alone.new", "sqlite.alone.dbos_step", None, False),
        Target(f"{sqlite}: new call vs a DBOS step, interleaved, DBOS's threads running",
               "sqlite.new", "sqlite.dbos_step", None, False),
        Target(f"{sqlite}: new call vs a one-step DBOS workflow", "sqlite.new",
               "sqlite.dbos_workflow", None, False),
        Target(f"{pg}: new call vs a DBOS step, each alone in the process", "postgres.alone.new",
               "postgres.alone.dbos_step", None, False),
        Target(f"{pg}: new call vs a DBOS step, interleaved, DBOS's threads running",
               "postgres.new", "postgres.dbos_step", None, False),
        Target(f"{pg}: new call vs a one-step DBOS workflow", "postgres.new",
               "postgres.dbos_workflow", None, False),
        Target(f"{redis}: new call vs Powertools idempotent_function", "redis.new",
               "redis.powertools_new", None, False),
        Target(f"{redis}: replay vs Powertools replay", "redis.replay",
               "redis.powertools_replay", None, False),
    ]  # fmt: skip
    for backend in ("sqlite", "postgres", "redis"):
        rows.append(
            Target(
                f"{_NAMES[backend]}: new call, {million_rows:,} records vs empty store",
                f"{backend}.million.million_new",
                f"{backend}.million.empty_new",
                1.2,
            )
        )
    # Context: what an async call costs as the guard comes (offload=None: the store decides) and
    # with the two forced settings.
    defaults = {
        "redis": "called directly",
        "sqlite": "on the loop, a thread if it would wait",
        "postgres": "awaited on the loop",
    }
    for backend in ("redis", "sqlite", "postgres"):
        rows.append(
            Target(
                f"{_NAMES[backend]}: async new call, default ({defaults[backend]}) vs sync",
                f"{backend}.async.async_default_new",
                f"{backend}.async.sync_new",
                None,
                judged=False,
            )
        )
        for mode in ("offload", "direct"):
            rows.append(
                Target(
                    f"{_NAMES[backend]}: async new call (offload={mode == 'offload'}) vs sync",
                    f"{backend}.async.async_{mode}_new",
                    f"{backend}.async.sync_new",
                    None,
                    judged=False,
                )
            )
    return rows


_NAMES = {"sqlite": "SQLite", "postgres": "Postgres", "redis": "Redis", "memory": "Memory"}

DESCRIPTIONS = {
    "memory.new": "guarded no-op, new key (guard cost alone)",
    "memory.replay": "guarded no-op, replay",
    "redis.floor_set_nx_set": "floor: SET NX + SET, same client",
    "redis.ping": "one PING",
    "redis.new": "guarded no-op, new key",
    "redis.replay": "guarded no-op, replay",
    "redis.floor_packed": "floor: SET NX + SET pre-packed on a pooled connection (no redis-py command path)",
    "redis.ping_packed": "one PING pre-packed on a pooled connection",
    "store_claim_complete": "the store's claim + complete alone, no guard",
    "store_claim_existing": "the store's claim of a finished record alone (a replay without the guard)",
    "redis.powertools_new": "Powertools idempotent_function, new payload",
    "redis.powertools_replay": "Powertools idempotent_function, replay",
    "floor_core": "floor: INSERT commit + UPDATE commit, SQLAlchemy Core",
    "floor_raw": "floor: INSERT commit + UPDATE commit, raw driver",
    "new": "guarded no-op, new key",
    "replay": "guarded no-op, replay",
    "dbos_workflow": "DBOS one-step workflow, end to end",
    "dbos_step": "DBOS no-op step, timed inside the workflow",
    "dbos_workflow_rollback_journal": "DBOS one-step workflow, DBOS's default rollback journal",
    "dbos_step_rollback_journal": "DBOS step, DBOS's default rollback journal",
    "async.sync_new": "sync guarded call (inside the event loop)",
    "async.async_default_new": "await guarded async no-op, offload=None (the store decides)",
    "async.async_offload_new": "await guarded async no-op, offload=True",
    "async.async_direct_new": "await guarded async no-op, offload=False",
    "alone.new": "guarded no-op, new key, DBOS not launched (rounds alternating with alone.dbos_step)",
    "alone.dbos_step": "DBOS no-op step, no guarded calls running (rounds alternating with alone.new)",
    "million.empty_new": "new key, empty store",
    "million.million_new": "new key, the store holding the million records",
}


def _describe(name: str) -> str:
    if name in DESCRIPTIONS:
        return DESCRIPTIONS[name]
    rest = name.split(".", 1)[1]
    return DESCRIPTIONS.get(rest, rest)


def _fmt(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} µs"


def render(series: dict[str, dict[str, float]], meta: dict[str, Any], extra: dict[str, Any]) -> str:
    """The markdown between the markers."""
    out = [
        "## Guarded-call latency (`bench/guard.py`)",
        "",
        f"Produced by `{meta['command']}` on {meta['date']}.",
        "",
        f"Machine: {meta['machine']}. Load average before/after: {meta['load_before']} / "
        f"{meta['load_after']}. Versions: {meta['versions']}.",
        "",
        *([f"Balance: {meta['balance']}.", ""] if meta.get("balance") else []),
        "Every ratio is of p50s measured in the same run, with the two sides interleaved in small "
        "alternating blocks so that machine noise hits both. Times are wall clock per call "
        "(`time.perf_counter_ns`), after a warm-up.",
        "",
        "### Targets",
        "",
        "| target | measured p50 (p99) | base p50 (p99) | ratio | limit | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for t in targets(meta.get("million_rows", 1_000_000)):
        m, b = series.get(t.measured), series.get(t.base)
        if m is None or b is None:
            limit = "—" if t.limit is None else f"{t.limit:g}x"
            out.append(f"| {t.label} | n/a | n/a | n/a | {limit} | not run |")
            continue
        ratio = m["p50"] / b["p50"]
        if t.limit is None:
            verdict, limit = "(context)", "—"
        elif t.judged:
            verdict, limit = ("**met**" if ratio <= t.limit else "**not met**"), f"{t.limit:g}x"
        else:
            verdict = "(context) within" if ratio <= t.limit else "(context) over"
            limit = f"{t.limit:g}x"
        out.append(
            f"| {t.label} | {_fmt(m['p50'])} ({_fmt(m['p99'])}) | {_fmt(b['p50'])} ({_fmt(b['p99'])}) "
            f"| {ratio:.2f}x | {limit} | {verdict} |"
        )
    out += ["", *[f"- {note}" for note in meta["notes"]], "", "### Every series", ""]
    out += ["| series | what | p50 | p99 | calls |", "|---|---|---|---|---|"]
    for name, s in series.items():
        out.append(f"| `{name}` | {_describe(name)} | {_fmt(s['p50'])} | {_fmt(s['p99'])} | {int(s['n'])} |")
    added = []
    for backend in ("memory", "redis", "sqlite", "postgres"):
        for call, base in (("new", "store_claim_complete"), ("replay", "store_claim_existing")):
            m, b = series.get(f"{backend}.{call}"), series.get(f"{backend}.{base}")
            if m and b:
                added.append(
                    f"| {_NAMES[backend]} | {call} | {_fmt(m['p50'] - b['p50'])} | {_fmt(b['p50'])} |"
                )
    if added:
        out += [
            "",
            "### What the guard adds to its store (p50 of the guarded call minus the store alone)",
            "",
        ]
        out += ["| store | call | guard adds | store alone |", "|---|---|---|---|", *added]
        out += [
            "",
            "The memory and Redis rows are the guard's own cost. The SQLite and Postgres rows subtract "
            "two fsync-bound series whose p50s move by hundreds of µs from run to run, so they only "
            "say that the guard's cost is lost in the commit's noise.",
        ]
    if "components" in extra:
        out += ["", "### Where the guard's own time goes (memory store, thread CPU, best of 5 repeats)", ""]
        out += ["| piece | µs |", "|---|---|"]
        out += [f"| {label} | {us:.2f} |" for label, us in extra["components"]]
    for key, title in (("cprofile_memory", "memory store"), ("cprofile_redis", "Redis")):
        if key in extra:
            out += [
                "",
                f"<details><summary>cProfile of new guarded calls on the {title} (by own time)</summary>",
                "",
                "```",
                extra[key],
                "```",
                "",
                "</details>",
            ]
    if meta.get("failures"):
        out += ["", "### Phases that failed", ""]
        out += [f"- `{name}`: {error}" for name, error in meta["failures"].items()]
    return "\n".join(out)


def write(path: Path, block: str, markers: tuple[str, str] = (START, END)) -> None:
    """Replace the text between the markers in ``path`` (creating the file or markers if absent).

    ``markers``: the start and end comments of the section (default: the guard benchmark's).
    """
    start, end = markers
    wrapped = f"{start}\n{block}\n{end}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# Benchmarks\n\n{wrapped}\n", encoding="utf-8")
        return
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: wrapped, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n{wrapped}\n"
    path.write_text(text, encoding="utf-8")
