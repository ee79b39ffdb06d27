"""The resume-at-once supervisor (issue 14): kill a research agent, restart it at once, count.

::

    with ResearchWorld() as world:
        clean = clean_resume_run(world, variant, Path(tmp) / "clean")
        done = supervise(world, variant, Path(tmp) / "k1", kill_after=1.3)   # or point="email_sent"
        done.failures, done.seconds, done.operator    # [] , 0.9, False

A process supervisor (systemd, Kubernetes, a retry loop) restarts a dead agent at once, in a fresh
process, and again whenever it fails, until it finishes. :func:`supervise` does that to a sagaguard
variant of :mod:`_research.sweep`, whose children open ``Guard(store)`` with its **default** options
as the framework pages show it: it starts the run, which dies by SIGKILL at a named
kill point (``point``) or after ``kill_after`` seconds (a random time, sent by the zygote), then
restarts it with ``action: resume`` at once after every exit until a run finishes (at most
``max_resumes`` restarts). It records:

- ``failures``: why each restart that did not finish failed (the exception's name, such as
  ``AlreadyInProgress``: a claim of the dead process still leased);
- ``seconds``: wall-clock seconds from the kill to the finish (for the docs table only; tests count
  failures instead of comparing times);
- ``parked``: the effects left in doubt for an operator once the run finished (the effect store's
  ``IN_DOUBT`` records, by name), so :attr:`Resumed.operator` says whether someone must act;
- ``in_flight``: the model calls claimed and not recorded at the kill (the store's ``IN_PROGRESS``
  records of :data:`MODEL_EFFECTS`): each may be paid again, and nothing else may;
- the world's counters (model calls, charges, emails), which the SIGKILL cannot touch.

:func:`kill_times` draws the seeded random delays, :func:`summarize` makes a framework's row and
:func:`render` the docs block that ``python tests/_research/resume.py`` writes between
``<!-- resume:start -->`` and ``<!-- resume:end -->`` in docs/frameworks/research_agent.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for entry in (HERE.parent.parent, HERE.parent):  # the project root and tests/, when run as a script
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

from _research.sweep import (  # noqa: E402
    Variant,
    _last_json,
    _run,
    _zygote,
    _zygote_for,
    all_variants,
    world_config,
)
from _research.world import TOPIC, ResearchWorld, expected_report  # noqa: E402
from _research.zygote import KILLED_AFTER  # noqa: E402
from sagaguard.idempotency.records import State  # noqa: E402
from sagaguard.idempotency.stores.sql import SqlStore  # noqa: E402
from sagaguard.idempotency.testing import CRASH_ENV  # noqa: E402

__all__ = [
    "MODEL_EFFECTS",
    "NAMED",
    "NAMED_FANOUT",
    "Resumed",
    "clean_resume_run",
    "fanout_variant",
    "kill_times",
    "render",
    "resume_variants",
    "summarize",
    "supervise",
]

MODEL_EFFECTS = ("llm.chat", "agents.model")
"""Effect names of journaled model calls: :class:`sagaguard.connectors.llm.ChatJournal`'s and the Agents SDK
loop's (:data:`sagaguard.connectors.frameworks.openai_agents.MODEL_EFFECT`)."""
DOC = HERE.parent.parent / "docs" / "frameworks" / "research_agent.md"
START, END = "<!-- resume:start -->", "<!-- resume:end -->"


@dataclass
class Resumed:
    """One supervised kill: what the world saw and what the restarts met.

    Attributes:
        kill: the named kill point, or ``"after 1.234 s"``.
        killed: the first run died by SIGKILL there (False: it finished before).
        finished: a restart finished the run (``status == "finished"``).
        seconds: wall-clock seconds from the kill to the finish (0.0 when it did not finish).
        failures: why each restart that did not finish failed, in order.
        parked: names of the effects left in doubt for an operator after the last run.
        in_flight: model calls claimed but not recorded at the kill.
        counters: the world's counters after the last run.
        result: the last run's JSON line.
        error: the last failed run's stderr tail.
    """

    kill: str
    killed: bool = False
    finished: bool = False
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    parked: list[str] = field(default_factory=list)
    in_flight: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def operator(self) -> bool:
        """Someone must act: the run did not finish, or it left an effect in doubt."""
        return not self.finished or bool(self.parked)


def resume_variants() -> list[Variant]:
    """The sagaguard variants of every framework (LangGraph, the Agents SDK)."""
    return [v for v in all_variants() if v.guarded]


def fanout_variant() -> Variant:
    """The Agents SDK + sagaguard with the fan-out plan: model calls from parallel tool calls."""
    sdk = next(v for v in resume_variants() if v.argv[-1] == "sagaguard" and "agents_child" in v.argv[1])
    return Variant(
        "OpenAI Agents SDK + sagaguard, parallel tool calls", (*sdk.argv[:-1], "fanout"), (), guarded=True,
        entry=sdk.entry, preload=sdk.preload,
    )  # fmt: skip


def _store(folder: Path) -> SqlStore | None:
    db = folder / "effects.db"
    return SqlStore(f"sqlite:///{db}") if db.exists() else None


def _names(folder: Path, state: State) -> list[str]:
    """The names of the effects in ``state`` in the run's effect store."""
    store = _store(folder)
    if store is None:
        return []
    try:
        return sorted(r.name for r in store.list(states=[state], limit=1000))
    finally:
        store.close()


SAGAGUARD_ERRORS = ("AlreadyInProgress", "OutcomeUnknown", "LostOwnership")
"""sagaguard's errors a restart may meet, named even when a framework wraps them (the Agents SDK
raises its ``UserError`` from an error in a tool)."""


def _failure(run: Any) -> str:
    """Why a restart failed: the exception's class name off its traceback's last line, and the
    sagaguard error it wraps (``"UserError from AlreadyInProgress"``)."""
    if run.returncode == 0:
        return "unfinished"
    if run.returncode < 0:
        return f"signal {-run.returncode}"
    last = f"exit {run.returncode}"
    for line in reversed(run.stderr.strip().splitlines()):
        found = re.match(r"([A-Za-z_][\w.]*)(:|$)", line)
        if found:
            last = found.group(1).rpartition(".")[2]
            break
    inner = next((name for name in SAGAGUARD_ERRORS if name in run.stderr), last)
    return last if inner == last else f"{last} from {inner}"


def _config(world: ResearchWorld, folder: Path, action: str) -> dict[str, Any]:
    return {**world_config(world), "dir": str(folder), "topic": TOPIC, "action": action}


def _fresh(world: ResearchWorld, folder: Path) -> None:
    world.reset()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


def clean_resume_run(world: ResearchWorld, variant: Variant, folder: Path) -> tuple[dict[str, int], float]:
    """A run without a kill, with Guard's defaults: the world's counters and its seconds.

    Raises:
        RuntimeError: it failed or did not write the expected report.
    """
    _fresh(world, folder)
    if variant.entry is not None:
        _zygote(variant)  # started (its imports paid) before the clock starts
    started = time.monotonic()
    run = _run(variant, _config(world, folder, "start"), {})
    seconds = time.monotonic() - started
    result = _last_json(run.stdout) if run.returncode == 0 else {}
    if result.get("status") != "finished" or result.get("report") != expected_report(TOPIC):
        raise RuntimeError(f"{variant.name}: the clean run failed (exit {run.returncode}):\n{run.stderr}")
    return world.counters(), seconds


def supervise(
    world: ResearchWorld,
    variant: Variant,
    folder: Path,
    *,
    point: str | None = None,
    kill_after: float | None = None,
    max_resumes: int = 8,
    resume_env: Mapping[str, str] | None = None,
) -> Resumed:
    """Kill a run of ``variant`` at ``point`` or after ``kill_after`` s; restart it at once until it
    finishes (at most ``max_resumes`` restarts). The world is reset and ``folder`` emptied first.
    ``resume_env`` is added to the restarts' environment (``$SAGAGUARD_HOST_ID``: "another host").

    Raises:
        ValueError: neither or both of ``point`` and ``kill_after``.
    """
    if (point is None) == (kill_after is None):
        raise ValueError("give a kill point or a kill time, one of them")
    _fresh(world, folder)
    done = Resumed(point if point is not None else f"after {kill_after:.3f} s")
    env = {CRASH_ENV: point} if point is not None else {}
    run = _run(variant, _config(world, folder, "start"), env, kill_after=kill_after)
    killed_at = time.monotonic()
    said = f"SIGKILL at {point} " if point is not None else KILLED_AFTER
    done.killed = run.returncode == -signal.SIGKILL and said in run.stderr
    if not done.killed:  # finished before the kill time (or the point does not exist)
        done.result = _last_json(run.stdout) if run.returncode == 0 else {}
        done.finished = done.result.get("status") == "finished"
        done.counters = world.counters()
        return done
    done.in_flight = sum(name in MODEL_EFFECTS for name in _names(folder, State.IN_PROGRESS))
    for _ in range(max_resumes):
        run = _run(variant, _config(world, folder, "resume"), dict(resume_env or {}))
        result = _last_json(run.stdout) if run.returncode == 0 else {}
        if result.get("status") == "finished":
            done.seconds = time.monotonic() - killed_at
            done.finished, done.result = True, result
            break
        done.failures.append(_failure(run))
        done.error = f"exit {run.returncode}: {run.stderr[-2000:]}"
    done.parked = _names(folder, State.IN_DOUBT)
    done.counters = world.counters()
    return done


def kill_times(seed: int, count: int, longest: float) -> list[float]:
    """``count`` kill delays drawn from ``random.Random(seed)``, uniform in ``(0, longest)``."""
    draw = random.Random(seed)
    return [round(draw.uniform(0.02, longest), 3) for _ in range(count)]


def summarize(name: str, clean: dict[str, int], runs: Sequence[Resumed]) -> dict[str, Any]:
    """A framework's row: counts over the runs that were killed (one per kill)."""
    killed = [r for r in runs if r.killed]
    seconds = [r.seconds for r in killed if r.finished]
    repaid = [r.counters.get("model_calls", 0) - clean.get("model_calls", 0) for r in killed]
    return {
        "variant": name,
        "kills": len(killed),
        "named": sum(not r.kill.startswith("after ") for r in killed),
        "random": sum(r.kill.startswith("after ") for r in killed),
        "not_killed": len(runs) - len(killed),
        "finished": sum(r.finished for r in killed),
        "no_operator": sum(not r.operator for r in killed),
        "p50": statistics.median(seconds) if seconds else 0.0,
        "max": max(seconds, default=0.0),
        "failed_resumes": sum(len(r.failures) for r in killed),
        "failure_kinds": sorted({f for r in killed for f in r.failures}),
        "duplicate_charges": sum(
            max(0, r.counters.get("charges", 0) - clean.get("charges", 0)) for r in killed
        ),
        "duplicate_emails": sum(max(0, r.counters.get("emails", 0) - clean.get("emails", 0)) for r in killed),
        "operator": [
            {"kill": r.kill, "parked": r.parked, "finished": r.finished} for r in killed if r.operator
        ],
        "repaid_max": max(repaid, default=0),
        "in_flight_max": max((r.in_flight for r in killed), default=0),
        "repaid_over_in_flight": sum(rp > r.in_flight for rp, r in zip(repaid, killed, strict=True)),
    }


def _operator_cell(row: dict[str, Any]) -> str:
    found = row["operator"]
    if not found:
        return "0"
    parts = []
    for op in found:
        where = ", ".join(op["parked"]) or "nothing parked"
        parts.append(f"{op['kill']}: {where} in doubt, {'finished' if op['finished'] else 'NOT finished'}")
    return f"{len(found)} ({'; '.join(parts)})"


def _failures_cell(row: dict[str, Any]) -> str:
    kinds = row["failure_kinds"]
    return f"{row['failed_resumes']} ({', '.join(kinds)})" if kinds else str(row["failed_resumes"])


def render(rows: Sequence[dict[str, Any]], fanout: dict[str, Any] | None, note: str) -> str:
    """The docs block: the per-framework table (the parallel variant last), and how it was produced."""
    lines = [
        "| variant | runs killed (named / random) | finished without an operator "
        "| kill to finish, s (p50 / max) | failed restarts | model calls in flight at the kill / re-paid "
        "(max) | duplicate charges | duplicate emails | needed an operator |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in [*rows, *([fanout] if fanout is not None else [])]:
        lines.append(
            f"| {row['variant']} | {row['kills']} ({row['named']} / {row['random']}) "
            f"| {row['no_operator']} / {row['kills']} | {row['p50']:.2f} / {row['max']:.2f} "
            f"| {_failures_cell(row)} | {row['in_flight_max']} / {row['repaid_max']} "
            f"| {row['duplicate_charges']} | {row['duplicate_emails']} | {_operator_cell(row)} |"
        )
    skipped = sum(row["not_killed"] for row in [*rows, *([fanout] if fanout is not None else [])])
    lines += [
        "",
        f"Random kill times that fell after the run had finished (not counted above): {skipped}.",
    ]
    if fanout is not None:
        lines.append(
            f"With parallel tool calls, runs that re-paid more model calls than were in flight at their "
            f"kill: {fanout['repaid_over_in_flight']} of {fanout['kills']}."
        )
    return "\n".join([START, *lines, "", note, END])


def write_docs(block: str, doc: Path = DOC) -> None:
    """Replace the block between the markers in ``doc`` (appended at the end when missing)."""
    text = doc.read_text()
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def _sweep_variant(
    world: ResearchWorld,
    variant: Variant,
    *,
    folder: Path,
    points: Sequence[str],
    seed: int,
    kills: int,
    progress: Callable[[Resumed], None] | None = None,
) -> tuple[dict[str, int], list[Resumed]]:
    """The clean run, a supervised kill at each of ``points``, then ``kills`` at random times (drawn
    with ``seed`` over the clean run's length)."""
    with _zygote_for(variant):
        clean, longest = clean_resume_run(world, variant, folder / "clean")
        delays = kill_times(seed, kills, longest)
        found = []
        for i, point in enumerate(points):
            found.append(supervise(world, variant, folder / f"n{i:03d}", point=point))
            if progress is not None:
                progress(found[-1])
        for i, delay in enumerate(delays):
            found.append(supervise(world, variant, folder / f"r{i:03d}", kill_after=delay))
            if progress is not None:
                progress(found[-1])
    return clean, found


NAMED = {
    "LangGraph + sagaguard": ("model_answered#7", "model_answered#20", "charge_applied", "email_sent"),
    "OpenAI Agents SDK + sagaguard": (
        "model_answered#59",
        "body:summarize#3",
        "charge_applied",
        "email_sent",
    ),
}
"""Named kill points per framework for the supervised sweep: a model answer in flight (in a node or
tool, and the Agents SDK loop's own), the charge applied before its record, the email accepted before
its record."""
NAMED_FANOUT = ("model_answered#16", "model_answered#30")
"""The parallel variant's named kill points: the 3rd of the 11 summaries' answers arrived (the loop's
13th answer asked for all 11), the 5th of the 15 claim checks' (the 25th asked for all 15), with the
others of the fan-out in flight."""


def run_all(
    world: ResearchWorld,
    folder: Path,
    *,
    seed: int,
    random_kills: int,
    fanout_kills: int,
    progress: Callable[[Resumed], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list[Resumed]]:
    """Every framework's named and random kills, then the fan-out variant's random kills."""
    rows, every = [], []
    for n, variant in enumerate(resume_variants()):
        points = NAMED.get(variant.name, ())
        clean, found = _sweep_variant(
            world,
            variant,
            folder=folder / f"v{n}",
            points=points,
            seed=seed + n,
            kills=random_kills,
            progress=progress,
        )
        rows.append(summarize(variant.name, clean, found))
        every += found
    fanout = None
    if fanout_kills:
        variant = fanout_variant()
        clean, found = _sweep_variant(
            world,
            variant,
            folder=folder / "fanout",
            points=NAMED_FANOUT,
            seed=seed + 100,
            kills=fanout_kills,
            progress=progress,
        )
        fanout = summarize(variant.name, clean, found)
        every += found
    return rows, fanout, every


def _progress(r: Resumed) -> None:
    print(
        f"  {r.kill}: finished={r.finished} failures={r.failures} parked={r.parked} "
        f"in_flight={r.in_flight} {r.seconds:.2f} s",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python tests/_research/resume.py [--seed N] [--random K] [--fanout K] [--no-write]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="random kill times' seed (default: the clock)")
    parser.add_argument("--random", type=int, default=12, help="random kills per framework")
    parser.add_argument("--fanout", type=int, default=10, help="random kills of the parallel variant")
    parser.add_argument("--no-write", action="store_true", help="print the block, leave the docs alone")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    started = time.monotonic()
    with ResearchWorld() as world, tempfile.TemporaryDirectory(prefix="resume-") as tmp:
        rows, fanout, every = run_all(
            world, Path(tmp), seed=seed, random_kills=args.random, fanout_kills=args.fanout,
            progress=_progress,
        )  # fmt: skip
    command = f".venv/bin/python tests/_research/resume.py --seed {seed} --random {args.random} " + (
        f"--fanout {args.fanout}"
    )
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    note = (
        f"Produced by `{command}` (random kill times drawn with seed {seed}, uniform over a clean run's "
        f"length; {len(every)} kills in {time.monotonic() - started:.0f} s), {when}, "
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs. "
        "Each kill is followed at once by restarts in fresh processes with Guard's default options, "
        "until the run finishes (at most 8)."
    )
    block = render(rows, fanout, note)
    print(block)
    if not args.no_write:
        write_docs(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
