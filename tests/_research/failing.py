"""The failing research agent, killed (issue 16, point 9): it books and pays, then fails on a later
tool; its tool calls are undone as an agent saga. Kill it anywhere in the run or in its compensation,
resume at once, sweep with the worker, count at the world.

::

    with ResearchWorld() as world:
        clean = clean_failing_run(world, variant, Path(tmp) / "clean")     # the kill points it traced
        done = undo_experiment(world, variant, Path(tmp) / "k1", point="refund_applied")
        done.misses(clean)                                                 # [] : every target met

Per experiment, in a fresh directory and a reset world: start the child with ``$SAGAGUARD_CRASH_AT``
naming the point, or SIGKILL it ``kill_after`` seconds after its start (a random time); it must die
by SIGKILL. Then, at once, ``action: resume`` in a fresh process (the agent opens its run again and
goes on; a run killed in its compensation is taken over at once, its holder being dead on this
host, and finished when the run is opened: ``ended``) until a run reports the agent's run ended (at most
``max_resumes``); then ``action: worker``, one sweep of the worker API (``sagaguard.saga.recovery.recover``)
in a fresh process, which reads the run's saga state; then the world's counters and what is left in
place (:meth:`_research.world.ResearchWorld.left_in_place`), which the SIGKILL cannot touch.

The targets (:meth:`Undone.misses`, asserted for the sagaguard variants at every kill point): 0
duplicate effects (charges, bookings), 0 duplicate undos (refunds, cancellations beyond the clean
run's, or a cancellation that found its booking cancelled already), 0 effects left in place (a
charge not refunded, a booking not cancelled), the run's saga COMPENSATED after the worker's sweep
(never RUNNING or COMPENSATING: nothing stuck), no effect left in doubt for an operator. The
framework alone (``plain``) is the contrast, reported only: it leaves the booking and the charge in
place, and re-does them when a kill lands between an effect and the checkpoint.

A variant is a :class:`_research.sweep.Variant` whose child follows :mod:`_research.failing_langgraph`'s
protocol (``start``/``resume``/``worker``; a JSON line with ``status``, ``saga``, ``in_doubt``).
:func:`failing_variants` lists them (LangGraph now; an Agents SDK child joins through
:data:`PLUGINS`). :func:`summarize` makes a variant's row and :func:`render` the docs block that
``bench/research_failing.py`` writes between ``<!-- failing:start -->`` and ``<!-- failing:end -->``
in docs/frameworks/research_agent.md.
"""

from __future__ import annotations

import argparse
import os
import platform
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

from _research.points import TRACE_ENV  # noqa: E402
from _research.resume import kill_times  # noqa: E402
from _research.sweep import (  # noqa: E402
    LANGGRAPH_PRELOAD,
    Variant,
    _last_json,
    _run,
    _zygote,
    _zygote_for,
    plugged,
    world_config,
)
from _research.world import TOPIC, ResearchWorld  # noqa: E402
from _research.zygote import KILLED_AFTER  # noqa: E402
from sagaguard.idempotency.testing import CRASH_ENV  # noqa: E402

__all__ = [
    "ENDED",
    "LANGGRAPH_EARLY",
    "LANGGRAPH_FAILS_AT",
    "LANGGRAPH_FROM",
    "Failing",
    "PLUGINS",
    "Undone",
    "clean_failing_run",
    "failing_variants",
    "render",
    "summarize",
    "sweep_failing",
    "sweep_points",
    "undo_experiment",
]

DOC = HERE.parent.parent / "docs" / "frameworks" / "research_agent.md"
START, END = "<!-- failing:start -->", "<!-- failing:end -->"
ENDED = ("failed", "ended", "recovered", "completed")
"""Statuses of a process that saw the agent's run end (the child protocol's ``status``)."""
UNFINISHED = ("running", "compensating")
"""Saga states of a run still held (or due for the worker): stuck, after the worker's sweep."""
PRELOAD = (
    *LANGGRAPH_PRELOAD, "langchain_openai.chat_models.base", "sagaguard.saga.recovery",
    "sagaguard.saga.journals.sql",
)  # fmt: skip
PLUGINS = ("_research.failing_agents",)
"""Modules that may define ``failing_variants() -> list[Failing]`` (the Agents SDK's); missing
ones are skipped."""


@dataclass
class Undone:
    """One kill of a failing agent: what its resumes and the worker's sweep left, as the world saw it.

    Attributes:
        kill: the named kill point, or ``"after 1.234 s"``.
        killed: the start run died by SIGKILL there (False: it ended before).
        runs: child processes started (the killed one, the resumes and the worker's sweep).
        statuses: each resume's ``status``, in order.
        ended: a resume saw the agent's run end (failed and undone, or already ended).
        seconds: wall-clock seconds from the kill to the end of the resume that ended the run.
        saga: the run's saga state after the worker's sweep (``""``: no saga, the framework alone).
        in_doubt: effects left in doubt for an operator after the sweep.
        counters: the world's counters.
        left: what was done and not undone (``charges``, ``bookings``).
        error: the last failed process's stderr tail.
    """

    kill: str
    killed: bool = False
    runs: int = 0
    statuses: list[str] = field(default_factory=list)
    ended: bool = False
    seconds: float = 0.0
    saga: str = ""
    in_doubt: list[str] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)
    error: str = ""

    def more(self, clean: Mapping[str, int], counter: str) -> int:
        """How many more ``counter`` the world counted than in the clean run, at least 0."""
        return max(0, self.counters.get(counter, 0) - clean.get(counter, 0))

    def duplicate_effects(self, clean: Mapping[str, int]) -> int:
        """Charges and bookings beyond the clean run's."""
        return self.more(clean, "charges") + self.more(clean, "bookings")

    def duplicate_cancellations(self, clean: Mapping[str, int]) -> int:
        """Cancellations beyond the clean run's, or (when more) those that found their booking
        cancelled already: an undo that reached the desk twice."""
        return max(self.more(clean, "cancellations"), self.counters.get("cancellations_repeated", 0))

    def duplicate_undos(self, clean: Mapping[str, int]) -> int:
        """Refunds beyond the clean run's, and :meth:`duplicate_cancellations`."""
        return self.more(clean, "refunds") + self.duplicate_cancellations(clean)

    @property
    def not_undone(self) -> int:
        """Effects done and left in place: charges not refunded, bookings not cancelled."""
        return sum(self.left.values())

    @property
    def stuck(self) -> bool:
        """The run's saga is still RUNNING or COMPENSATING after the worker's sweep."""
        return self.saga in UNFINISHED

    @property
    def operator(self) -> bool:
        """Someone must act: the run did not end compensated, or it left an effect in doubt."""
        return self.saga != "compensated" or bool(self.in_doubt)

    def misses(self, clean: Mapping[str, int]) -> list[str]:
        """How this kill misses sagaguard's targets (empty: it meets them all)."""
        found = []
        if not self.killed:
            found.append("the kill point was not reached")
        for counter in ("charges", "bookings", "refunds", "cancellations"):
            if self.more(clean, counter):
                found.append(f"{self.more(clean, counter)} duplicate {counter}")
        if self.counters.get("cancellations_repeated", 0):
            found.append(f"{self.counters['cancellations_repeated']} cancellations of a cancelled booking")
        for kind, n in self.left.items():
            if n:
                found.append(f"{n} {kind} left in place")
        if self.stuck:
            found.append(f"saga stuck {self.saga} after the worker's sweep")
        elif self.operator:
            found.append(f"needs an operator: saga {self.saga or '?'}, in doubt {self.in_doubt} {self.error}")
        return found


def sweep_points(
    traced: Sequence[str], early: Sequence[str], start: str, fails_at: str, *, forward_stride: int = 1
) -> list[str]:
    """The full sweep's kill points, in run order: ``early`` (those the clean run reached), then the
    traced points from ``start`` up to ``fails_at`` (every ``forward_stride``-th of them), then every
    point from ``fails_at`` on (the failing tool and the whole compensation).

    Raises:
        ValueError: the clean run never reached ``start`` or ``fails_at``, or reached them out of order.
    """
    for point in (start, fails_at):
        if point not in traced:
            raise ValueError(f"the clean run never reached {point!r}")
    first, failing = traced.index(start), traced.index(fails_at)
    if first > failing:
        raise ValueError(f"{start!r} comes after {fails_at!r} in the clean run")
    return [
        *(p for p in early if p in traced[:first]),
        *traced[first:failing:forward_stride],
        *traced[failing:],
    ]


LANGGRAPH_EARLY = (
    "model_answered#1",
    "checkpoint#3",
    "searched",
    "model_answered#4",
    "recorded:langgraph.tool.write_report#1",
)
"""The LangGraph agent's kill points before its first call with an undo that the full sweep takes:
the first model answer, the first checkpoint after it, inside the search, inside the report's model
call, the report recorded (nothing to undo yet; the points left out repeat these under other
numbers)."""
LANGGRAPH_FROM = "model_returned#4"
"""From here (the model node holds the answer asking for ``book_review``) the full sweep kills the
LangGraph agent at every point its clean run traced: the booking, the charge, the failing
``publish`` and every point of the compensation."""
LANGGRAPH_FAILS_AT = "enter:publish"
"""The failing tool's first line: every point from here on is the failure and the compensation."""


@dataclass(frozen=True)
class Failing:
    """A failing-agent variant and where its full sweep kills it (:func:`sweep_points`).

    Attributes:
        variant: the child (:mod:`_research.failing_langgraph`'s protocol).
        early: kill points before the first call with an undo.
        start: from this traced point on, every point (or every n-th until ``fails_at``).
        fails_at: from this traced point on (the failing tool), every point.
    """

    variant: Variant
    early: tuple[str, ...]
    start: str
    fails_at: str

    @property
    def name(self) -> str:
        """The variant's name."""
        return self.variant.name

    def points(self, traced: Sequence[str], *, forward_stride: int = 1) -> list[str]:
        """The full sweep's kill points of this variant, given its clean run's trace
        (:func:`sweep_points`)."""
        return sweep_points(traced, self.early, self.start, self.fails_at, forward_stride=forward_stride)


def failing_variants() -> list[Failing]:
    """LangGraph with an agent saga, and LangGraph's checkpointer alone; then the plug-ins'."""
    child = str(HERE / "failing_langgraph.py")
    entry = "_research.failing_langgraph:main"
    return [
        Failing(Variant("LangGraph + sagaguard", (sys.executable, child, "sagaguard"), guarded=True,
                        entry=entry, preload=PRELOAD), LANGGRAPH_EARLY, LANGGRAPH_FROM, LANGGRAPH_FAILS_AT),
        Failing(Variant("LangGraph alone (checkpointer)", (sys.executable, child, "plain"), entry=entry,
                        preload=PRELOAD), LANGGRAPH_EARLY, LANGGRAPH_FROM, LANGGRAPH_FAILS_AT),
        *plugged(PLUGINS, "failing_variants"),
    ]  # fmt: skip


def _config(world: ResearchWorld, folder: Path, action: str) -> dict[str, Any]:
    return {**world_config(world), "dir": str(folder), "topic": TOPIC, "action": action}


def _fresh(world: ResearchWorld, folder: Path) -> None:
    world.reset()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


def clean_failing_run(
    world: ResearchWorld, variant: Variant, folder: Path
) -> tuple[dict[str, int], list[str], float]:
    """A run without a kill (it fails at its last tool, and is undone under sagaguard): the world's
    counters, the kill points it traced in order, its seconds.

    Raises:
        RuntimeError: the run did not fail as planned (or, under sagaguard, did not end compensated).
    """
    _fresh(world, folder)
    if variant.entry is not None:
        _zygote(variant)  # started (its imports paid) before the clock starts
    trace = folder / "trace.txt"
    started = time.monotonic()
    run = _run(variant, _config(world, folder / "run", "start"), {TRACE_ENV: str(trace)})
    seconds = time.monotonic() - started
    result = _last_json(run.stdout) if run.returncode == 0 else {}
    ended = "compensated" if variant.guarded else ""
    if result.get("status") != "failed" or result.get("saga") != ended:
        raise RuntimeError(f"{variant.name}: the clean run did not fail as planned (exit {run.returncode}): "
                           f"{result}\n{run.stderr[-3000:]}")  # fmt: skip
    points = trace.read_text().split() if trace.exists() else []
    return world.counters(), list(dict.fromkeys(points)), seconds


def undo_experiment(
    world: ResearchWorld,
    variant: Variant,
    folder: Path,
    *,
    point: str | None = None,
    kill_after: float | None = None,
    max_resumes: int = 3,
) -> Undone:
    """Kill a run of ``variant`` at ``point`` or after ``kill_after`` s, resume it at once until its
    run ended, sweep with the worker, count at the world (the module docstring).

    Raises:
        ValueError: neither or both of ``point`` and ``kill_after``.
    """
    if (point is None) == (kill_after is None):
        raise ValueError("give a kill point or a kill time, one of them")
    _fresh(world, folder)
    done = Undone(point if point is not None else f"after {kill_after:.3f} s")
    env = {CRASH_ENV: point} if point is not None else {}
    run = _run(variant, _config(world, folder, "start"), env, kill_after=kill_after)
    killed_at = time.monotonic()
    done.runs = 1
    said = f"SIGKILL at {point} " if point is not None else KILLED_AFTER
    done.killed = run.returncode == -signal.SIGKILL and said in run.stderr
    if not done.killed:
        result = _last_json(run.stdout) if run.returncode == 0 else {}
        done.error = f"not killed: exit {run.returncode}: {result} {run.stderr[-1500:]}"
    else:
        for _ in range(max_resumes):
            run = _run(variant, _config(world, folder, "resume"), {})
            done.runs += 1
            result = _last_json(run.stdout) if run.returncode == 0 else {}
            done.statuses.append(str(result.get("status", f"exit {run.returncode}")))
            if result.get("status") in ENDED and result.get("saga") not in UNFINISHED:
                done.ended, done.seconds = True, time.monotonic() - killed_at
                break
            done.error = f"exit {run.returncode}: {result} {run.stderr[-1500:]}"
    sweep = _run(variant, _config(world, folder, "worker"), {})
    done.runs += 1
    swept = _last_json(sweep.stdout) if sweep.returncode == 0 else {}
    if sweep.returncode != 0:
        done.error = f"worker: exit {sweep.returncode}: {sweep.stderr[-1500:]}"
    done.saga = str(swept.get("saga", "?"))
    done.in_doubt = list(swept.get("in_doubt") or [])
    done.counters = world.counters()
    done.left = world.left_in_place()
    return done


def sweep_failing(
    world: ResearchWorld,
    failing: Failing,
    folder: Path,
    *,
    points: Sequence[str] | None = None,
    stride: int = 1,
    seed: int = 16,
    random_kills: int = 0,
    forward_stride: int = 1,
    progress: Callable[[Undone], None] | None = None,
) -> tuple[dict[str, int], list[str], list[Undone]]:
    """The clean run, a kill at each of ``points`` (None: :meth:`Failing.points` of the clean run's
    trace, with ``forward_stride``; every ``stride``-th of them), then ``random_kills`` at seeded
    random times over the clean run's length. Returns the clean counters, the traced points and the
    experiments."""
    variant = failing.variant
    with _zygote_for(variant):
        clean, traced, longest = clean_failing_run(world, variant, folder / "clean")
        chosen = points if points is not None else failing.points(traced, forward_stride=forward_stride)
        chosen = list(chosen)[::stride]
        found = []
        for i, point in enumerate(chosen):
            found.append(undo_experiment(world, variant, folder / f"n{i:03d}", point=point))
            if progress is not None:
                progress(found[-1])
        for i, delay in enumerate(kill_times(seed, random_kills, longest)):
            found.append(undo_experiment(world, variant, folder / f"r{i:03d}", kill_after=delay))
            if progress is not None:
                progress(found[-1])
    return clean, traced, found


def summarize(
    name: str, clean: Mapping[str, int], runs: Sequence[Undone], *, guarded: bool
) -> dict[str, Any]:
    """A variant's row: counts over the runs that were killed."""
    killed = [r for r in runs if r.killed]
    seconds = [r.seconds for r in killed if r.ended]
    return {
        "variant": name,
        "guarded": guarded,
        "kills": len(killed),
        "named": sum(not r.kill.startswith("after ") for r in killed),
        "random": sum(r.kill.startswith("after ") for r in killed),
        "not_killed": len(runs) - len(killed),
        "no_operator": sum(not r.operator for r in killed),
        "duplicate_charges": sum(r.more(clean, "charges") for r in killed),
        "duplicate_bookings": sum(r.more(clean, "bookings") for r in killed),
        "duplicate_refunds": sum(r.more(clean, "refunds") for r in killed),
        "duplicate_cancellations": sum(r.duplicate_cancellations(clean) for r in killed),
        "runs_left_undone": sum(r.not_undone > 0 for r in killed),
        "charges_left": sum(r.left.get("charges", 0) for r in killed),
        "bookings_left": sum(r.left.get("bookings", 0) for r in killed),
        "stuck": sum(r.stuck for r in killed),
        "p50": statistics.median(seconds) if seconds else 0.0,
        "max": max(seconds, default=0.0),
        "finished_by_worker_api": sum("recovered" in r.statuses for r in killed),
        "misses": {r.kill: m for r in killed if guarded and (m := r.misses(clean))},
    }


def render(rows: Sequence[Mapping[str, Any]], note: str) -> str:
    """The docs block: one row per variant, and how it was produced."""
    lines = [
        "| variant | runs killed (named / random) | ended undone without an operator "
        "| duplicate charges / bookings | duplicate refunds / cancellations | runs left with an effect not "
        "undone (charges / bookings left) | sagas stuck RUNNING after the worker's sweep "
        "| kill to ended, s (p50 / max) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        stuck = str(row["stuck"]) if row["guarded"] else "- (no saga)"
        lines.append(
            f"| {row['variant']} | {row['kills']} ({row['named']} / {row['random']}) "
            f"| {row['no_operator']} / {row['kills']} "
            f"| {row['duplicate_charges']} / {row['duplicate_bookings']} "
            f"| {row['duplicate_refunds']} / {row['duplicate_cancellations']} "
            f"| {row['runs_left_undone']} ({row['charges_left']} / {row['bookings_left']}) "
            f"| {stuck} | {row['p50']:.2f} / {row['max']:.2f} |"
        )
    skipped = sum(row["not_killed"] for row in rows)
    lines += ["", f"Random kill times that fell after the run had ended (not counted above): {skipped}."]
    return "\n".join([START, *lines, "", note, END])


def _progress(r: Undone) -> None:
    print(
        f"  {r.kill}: killed={r.killed} statuses={r.statuses} saga={r.saga} left={r.left} "
        f"charges={r.counters.get('charges')} refunds={r.counters.get('refunds')} "
        f"bookings={r.counters.get('bookings')} cancellations={r.counters.get('cancellations')} "
        f"{r.seconds:.2f} s",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python tests/_research/failing.py [--seed N] [--random K] [--stride-plain S] [--no-write]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="random kill times' seed (default: the clock)")
    parser.add_argument("--random", type=int, default=6, help="random kills per variant")
    parser.add_argument("--stride-plain", type=int, default=1, help="kill the contrast at every n-th point")
    parser.add_argument("--variants", default="", help="only the variants whose name contains this")
    parser.add_argument("--no-write", action="store_true", help="print the block, leave the docs alone")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    load = os.getloadavg()
    started = time.monotonic()
    rows = []
    with ResearchWorld() as world, tempfile.TemporaryDirectory(prefix="failing-") as tmp:
        for n, failing in enumerate(v for v in failing_variants() if args.variants in v.name):
            guarded = failing.variant.guarded
            print(failing.name, flush=True)
            clean, _, runs = sweep_failing(
                world, failing, Path(tmp) / f"v{n}", stride=1 if guarded else args.stride_plain,
                seed=seed + n, random_kills=args.random if guarded else 0, progress=_progress,
            )  # fmt: skip
            rows.append(summarize(failing.name, clean, runs, guarded=guarded))
    after = os.getloadavg()
    command = f".venv/bin/python bench/research_failing.py --seed {seed} --random {args.random}"
    if args.stride_plain != 1:
        command += f" --stride-plain {args.stride_plain}"
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    kills = sum(row["kills"] + row["not_killed"] for row in rows)
    note = (
        f"Produced by `{command}` (the kill points a clean run traced from the answer asking for the "
        "booking on, a few before it, then, for the sagaguard variants, random kill times drawn "
        f"with seed {seed}, uniform over a clean run's length; {kills} kills in "
        f"{time.monotonic() - started:.0f} s), {when}, {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, load average {load[0]:.1f} at the start and "
        f"{after[0]:.1f} at the end (a shared machine). Each kill is followed at once by a resume in a fresh "
        "process, then one sweep of the worker API in another; the counts are read off the local Stripe "
        "and the review desk."
    )
    block = render(rows, note)
    print(block)
    for row in rows:
        if row["misses"]:
            print(f"{row['variant']} misses: {row['misses']}")
    if not args.no_write:
        _write(block)
    return 0


def _write(block: str) -> None:
    """Replace the block between this sweep's markers in the docs page."""
    text = DOC.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{DOC} has no {START} ... {END} block to fill")
    head, rest = text.split(START, 1)
    DOC.write_text(head + block + rest.split(END, 1)[1])


if __name__ == "__main__":
    sys.exit(main())
