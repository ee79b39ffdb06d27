"""Turning the guard benchmark's figures into its headline block of ``docs/benchmarks.md``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

START, END = "<!-- bench:guard:start -->", "<!-- bench:guard:end -->"


_NAMES = {"sqlite": "SQLite", "postgres": "Postgres", "redis": "Redis", "memory": "Memory"}

_FLOORS = {
    "redis": ("redis.floor_set_nx_set", "SET NX + SET (redis-py)", 1.15),
    "sqlite": ("sqlite.floor_core", "2 commits, SQLAlchemy Core", 1.3),
    "postgres": ("postgres.floor_core", "2 commits, SQLAlchemy Core", 1.3),
}
"""Each store's judged floor for a new call: its series, what it is, the limit of the ratio."""


def _fmt(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} µs"


def _p(s: dict[str, float]) -> str:
    return f"{_fmt(s['p50'])} ({_fmt(s['p99'])})"


def _ratio(series: dict[str, dict[str, float]], a: str, b: str) -> float | None:
    first, second = series.get(a), series.get(b)
    return first["p50"] / second["p50"] if first and second else None


def render(series: dict[str, dict[str, float]], meta: dict[str, Any]) -> str:
    """The headline block between the guard markers: a new call and a replay per store against its
    floor, the bare-driver floors and the million-record stores as one line each. Every series the
    run measured (async calls, DBOS, Powertools, the store alone) is in the ``--json`` file."""
    out = [
        "## A guarded call against its floor (`bench/guard.py`)",
        "",
        f"`{meta['command']}`, {meta['date']}, load average {meta['load_before']} before and "
        f"{meta['load_after']} after. {meta['versions']}.",
        "",
        "A guarded no-op, one call at a time, on a new key (a claim and a record: two durable "
        "writes) and replayed, beside its floor: the same durable writes without sagaguard. The two "
        "sides run interleaved in small alternating blocks, so the machine's noise hits both; "
        "ratios are of p50s.",
        "",
        "| store | new call p50 (p99) | floor | floor p50 (p99) | ratio | target | replay p50 (p99) |",
        "|---|---|---|---|---:|---|---|",
    ]
    memory = series.get("memory.new")
    if memory:
        replay = series.get("memory.replay")
        out.append(
            f"| memory (the guard alone) | {_p(memory)} | none | | | | {_p(replay) if replay else 'n/a'} |"
        )
    for backend, (floor, what, limit) in _FLOORS.items():
        new, base, replay = series.get(f"{backend}.new"), series.get(floor), series.get(f"{backend}.replay")
        if not new or not base:
            out.append(f"| {_NAMES[backend]} | not run | {what} | | | <= {limit:g}x | |")
            continue
        ratio = new["p50"] / base["p50"]
        verdict = "met" if ratio <= limit else "**not met**"
        out.append(
            f"| {_NAMES[backend]} | {_p(new)} | {what} | {_p(base)} | {ratio:.2f}x | "
            f"<= {limit:g}x: {verdict} | {_p(replay) if replay else 'n/a'} |"
        )
    lines = []
    raw = [
        f"{_NAMES[b]} {r:.2f}x"
        for b in ("sqlite", "postgres")
        if (r := _ratio(series, f"{b}.new", f"{b}.floor_raw")) is not None
    ]
    if raw:
        lines.append(
            "Against the bare driver's two commits instead (sqlite3 with the store's pragmas; psycopg "
            "in autocommit), a new call is " + ", ".join(raw) + "."
        )
    ping = _ratio(series, "redis.replay", "redis.ping")
    if ping is not None:
        lines.append(f"A Redis replay is {ping:.2f}x one `PING` (target <= 1.2x).")
    million = [
        f"{_NAMES[b]} {r:.2f}x"
        for b in ("sqlite", "postgres", "redis")
        if (r := _ratio(series, f"{b}.million.million_new", f"{b}.million.empty_new")) is not None
    ]
    if million:
        lines.append(
            f"A store holding {meta.get('million_rows', 1_000_000):,} records against an empty one, "
            "new calls: " + ", ".join(million) + " (target <= 1.2x)."
        )
    out += ["", *[f"- {line}" for line in lines]] if lines else []
    if meta.get("failures"):
        out += ["", "Phases that failed:", ""]
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
