"""The kill-point sweep: a clean run, then for each kill point a SIGKILL there and a resume, measured at
the world (:class:`_research.world.ResearchWorld`), never in the agent.

::

    with ResearchWorld() as world:
        result = sweep(world, langgraph_variants()[0], Path(tmp))
        print(result.summary())

Per kill point, in a fresh directory and a reset world: start the child with ``$SAGAGUARD_CRASH_AT``
naming the point (it must die there, with a real SIGKILL); resume it in a fresh process, again until
it finishes (at most ``max_resumes``); then read the world's counters. Model calls re-paid = the
experiment's model calls minus the clean run's; duplicate charges / emails = charges / emails at the
world minus the clean run's; "same report" = the finished run printed the clean run's report.

The plug-in point: a :class:`Variant`. A framework engineer writes a child script with this protocol
and lists it in a ``variants()`` function of their module, then names the module in :data:`PLUGINS`
(or passes the variants to :func:`sweep` directly):

- the command is ``[*variant.argv, '<config json>']``; the config holds ``dir`` (a fresh directory per
  experiment, the same one for its start and its resumes: keep checkpoints and effect stores there),
  ``action`` (``"start"`` or ``"resume"``), ``topic`` and the world (:func:`world_config`);
- the environment carries ``$SAGAGUARD_CRASH_AT`` (start runs of kill experiments only) and
  ``$SAGAGUARD_RESEARCH_TRACE`` (the clean run only); call :func:`_research.points.reach` at every
  kill point, so the clean run traces them and the start run dies at the chosen one;
- on success it exits 0 and prints, as its last stdout line, a JSON object with at least ``report``
  (the final report text) and ``status`` (``"finished"``); anything else it adds is kept in
  :attr:`Outcome.result`;
- ``Variant.points``: the kill points to sweep; None takes every point the clean run traced;
- ``Variant.guarded=True`` on a sagaguard variant: the full sweep test then asserts the targets
  (:meth:`SweepResult.misses`) at every kill point;
- ``Variant.entry`` (opt-in, e.g. ``"_research.langgraph_child:main"``, plus ``preload``): runs are
  forked from a :class:`_research.zygote.Zygote` that imported the child once, instead of started
  with ``argv``: the same fresh process per run, without 3-5 s of imports each. The entry is what the
  script's ``__main__`` calls, ``entry(*argv[2:], config)``, returning the exit status.

Runs are started one at a time: a zygote per variant, started on its first run and stopped when its
:func:`sweep` ends (:func:`stop_zygotes` stops those started outside a sweep; at exit at the latest).

Kill points named ``enter:<step>`` (reached first thing in each node / step / tool) group the table's
per-phase breakdown (:meth:`SweepResult.by_phase`).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _research.points import TRACE_ENV
from _research.world import TOPIC, ResearchWorld, expected_report
from _research.zygote import Zygote
from sagaguard.idempotency.testing import CRASH_ENV

__all__ = [
    "LANGGRAPH_PRELOAD",
    "PLUGINS",
    "SDK_PRELOAD",
    "Outcome",
    "SweepResult",
    "Variant",
    "all_variants",
    "experiment",
    "langgraph_variants",
    "plugged",
    "stop_zygotes",
    "sweep",
    "world_config",
]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

SDK_PRELOAD = (
    "anyio._backends._asyncio",
    "concurrent.futures.thread",
    "httpcore",
    "httpcore2",
    "jiter",
    "openai.pagination",
    "openai.resources.chat.chat",
    "openai.resources.chat.completions.completions",
    "sqlalchemy.dialects.sqlite",
    "stripe._payment_intent",
    "stripe._payment_intent_service",
    "stripe._stripe_client",
    "stripe._v1_services",
    "truststore",
)
"""What the research children's SDKs import only on first use (the HTTP stack, the chat and payment
resources, SQLite's dialect; ``httpcore2`` and ``truststore`` for the Agents SDK): a zygote imports
them up front so that no run pays for them. Found by diffing ``sys.modules`` around a forked run;
importing them starts no thread."""

LANGGRAPH_PRELOAD = (
    *SDK_PRELOAD,
    "sagaguard.connectors.email",
    "sagaguard.connectors.frameworks.langgraph",
    "sagaguard.connectors.llm",
    "sagaguard.connectors.stripe",
    "sagaguard.idempotency.stores.sql",
    "langchain_core.tracers.run_collector",
    "langchain_core.tracers.stdout",
)
"""The LangGraph child's lazy imports: :data:`SDK_PRELOAD`, what its sagaguard mode imports in
``build``, and LangGraph's run tracers."""

PLUGINS = ("_research.agents_child",)
"""Modules that may define ``variants() -> list[Variant]``; missing ones are skipped."""


@dataclass(frozen=True)
class Variant:
    """One agent under test: how to start its child, and where to kill it.

    Attributes:
        name: shown in the table, ``"<framework> + <mode>"``.
        argv: the child command; the config JSON is appended.
        points: the kill points; None: every point the clean run traced.
        guarded: sagaguard's targets apply (:meth:`SweepResult.misses`): 0 duplicate charges and
            emails, at most 1 re-paid model call per crash, the clean run's report.
        timeout: seconds one child run may take.
        entry: ``"module:function"``: fork each run from a zygote (:mod:`_research.zygote`) and call
            ``function(*argv[2:], config)`` in it; None: start ``argv`` with subprocess.
        preload: modules the zygote imports besides the entry's (those the child imports lazily).
    """

    name: str
    argv: tuple[str, ...]
    points: tuple[str, ...] | None = None
    guarded: bool = False
    timeout: float = 180.0
    entry: str | None = None
    preload: tuple[str, ...] = ()


@dataclass
class Outcome:
    """What one experiment (or the clean run) did, as the world counted it.

    Attributes:
        point: the kill point (``""`` for the clean run).
        killed: the start run died at the point (False: it finished without reaching it).
        runs: child processes started (the killed one included).
        finished: the last run exited 0 with ``status == "finished"``.
        counters: the world's counters after the experiment.
        result: the last run's JSON line (``report``, ...), empty when none.
        error: the last run's stderr tail when it failed.
    """

    point: str
    killed: bool = False
    runs: int = 0
    finished: bool = False
    counters: dict[str, int] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def report(self) -> str:
        """The final report the run printed (``""`` when it did not finish)."""
        return str(self.result.get("report") or "")


@dataclass
class SweepResult:
    """A clean run and one :class:`Outcome` per kill point."""

    variant: str
    clean: Outcome
    outcomes: list[Outcome]
    guarded: bool = False
    seconds: float = 0.0
    traced: list[str] = field(default_factory=list)
    """Every kill point the clean run reached, in order."""

    def repaid(self, outcome: Outcome) -> int:
        """Model calls the experiment paid beyond the clean run's."""
        return outcome.counters.get("model_calls", 0) - self.clean.counters.get("model_calls", 0)

    def duplicates(self, outcome: Outcome, counter: str) -> int:
        """How many more ``counter`` (``charges``, ``emails``) than the clean run, at least 0."""
        return max(0, outcome.counters.get(counter, 0) - self.clean.counters.get(counter, 0))

    def same_report(self, outcome: Outcome) -> bool:
        """The experiment finished with the clean run's report."""
        return outcome.finished and outcome.report == self.clean.report

    def misses(self, outcome: Outcome) -> list[str]:
        """How ``outcome`` misses sagaguard's targets (empty: it meets them all)."""
        found = []
        if not outcome.killed:
            found.append("the kill point was not reached")
        if self.repaid(outcome) > 1:
            found.append(f"{self.repaid(outcome)} model calls re-paid")
        for counter in ("charges", "emails"):
            if self.duplicates(outcome, counter):
                found.append(f"{self.duplicates(outcome, counter)} duplicate {counter}")
        if not self.same_report(outcome):
            found.append("not the clean run's report" if outcome.finished else f"unfinished: {outcome.error}")
        return found

    def summary(self) -> dict[str, Any]:
        """The row of the docs table: counts over the killed experiments."""
        killed = [o for o in self.outcomes if o.killed]
        repaid = [self.repaid(o) for o in killed]
        return {
            "variant": self.variant,
            "kill_points": len(killed),
            "not_reached": len(self.outcomes) - len(killed),
            "repaid_mean": statistics.fmean(repaid) if repaid else 0.0,
            "repaid_max": max(repaid, default=0),
            "duplicate_charges": sum(self.duplicates(o, "charges") for o in killed),
            "points_with_duplicate_charges": sum(self.duplicates(o, "charges") > 0 for o in killed),
            "duplicate_emails": sum(self.duplicates(o, "emails") for o in killed),
            "points_with_duplicate_emails": sum(self.duplicates(o, "emails") > 0 for o in killed),
            "same_report": sum(self.same_report(o) for o in killed),
            "finished": sum(o.finished for o in killed),
            "parked": sum(o.result.get("email") == "in_doubt" for o in killed),
            "clean_model_calls": self.clean.counters.get("model_calls", 0),
            "seconds": round(self.seconds, 1),
        }

    def phase(self, point: str) -> str:
        """The node (step) a kill point lies in: the last ``enter:<node>`` the clean run reached
        before it (``"before the first node"`` when none, ``"?"`` for a point it never reached)."""
        if point not in self.traced:
            return "?"
        phase = "before the first node"
        for seen in self.traced[: self.traced.index(point) + 1]:
            if seen.startswith("enter:"):
                phase = seen.removeprefix("enter:")
        return phase

    def by_phase(self) -> list[dict[str, Any]]:
        """:meth:`summary`-like counts per :meth:`phase`, in run order."""
        groups: dict[str, list[Outcome]] = {}
        for outcome in self.outcomes:
            groups.setdefault(self.phase(outcome.point), []).append(outcome)
        return [
            {
                "phase": phase,
                "kill_points": len(found),
                "repaid_mean": statistics.fmean(self.repaid(o) for o in found),
                "repaid_max": max(self.repaid(o) for o in found),
                "duplicate_charges": sum(self.duplicates(o, "charges") for o in found),
                "duplicate_emails": sum(self.duplicates(o, "emails") for o in found),
                "same_report": sum(self.same_report(o) for o in found),
            }
            for phase, found in groups.items()
        ]

    def rows(self) -> list[dict[str, Any]]:
        """One dict per kill point: the point and what the world saw."""
        return [
            {
                "point": o.point,
                "killed": o.killed,
                "runs": o.runs,
                "repaid": self.repaid(o),
                "duplicate_charges": self.duplicates(o, "charges"),
                "duplicate_emails": self.duplicates(o, "emails"),
                "same_report": self.same_report(o),
                "email": o.result.get("email"),
                "error": o.error[-300:],
            }
            for o in self.outcomes
        ]


def world_config(world: ResearchWorld) -> dict[str, Any]:
    """What a child needs to reach the world."""
    return {
        "model_base_url": world.model_base_url,
        "tools_url": world.tools_url,
        "stripe_api_base": world.stripe.api_base,
        "stripe_api_key": world.stripe.api_key,
        "smtp_host": world.smtp_host,
        "smtp_port": world.smtp_port,
    }


def _child_env() -> dict[str, str]:
    """The environment every run starts from: ours, without the crash point and trace file."""
    base = {k: v for k, v in os.environ.items() if k not in (CRASH_ENV, TRACE_ENV)}
    path = os.pathsep.join(p for p in (str(ROOT), str(HERE.parent), base.get("PYTHONPATH", "")) if p)
    return {**base, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


_zygotes: dict[Variant, Zygote] = {}


def _zygote(variant: Variant) -> Zygote:
    """The variant's running zygote, started (or restarted, if it died) on demand. Its runs get the
    environment as it was when it started (the subprocess path reads it per run)."""
    assert variant.entry is not None
    running = _zygotes.get(variant)
    if running is None or not running.alive():
        if running is not None:
            running.close()
        script = variant.argv[1] if len(variant.argv) > 1 else ""
        running = _zygotes[variant] = Zygote(variant.entry, variant.preload, env=_child_env(), script=script)
    return running


def stop_zygotes(variant: Variant | None = None) -> None:
    """Stop the zygote of ``variant`` (None: every zygote); the next run starts a new one."""
    for known in [variant] if variant is not None else list(_zygotes):
        running = _zygotes.pop(known, None)
        if running is not None:
            running.close()


atexit.register(stop_zygotes)


@contextmanager
def _zygote_for(variant: Variant) -> Iterator[None]:
    """Within: the variant's zygote stays up; after: it is stopped, unless it was up before."""
    up = variant in _zygotes
    try:
        yield
    finally:
        if not up:
            stop_zygotes(variant)


def _run(
    variant: Variant, config: Mapping[str, Any], env: Mapping[str, str], *, kill_after: float | None = None
) -> subprocess.CompletedProcess[str]:
    """One run of ``variant``; ``kill_after``: SIGKILL it that many seconds after its start (forked
    variants only, :meth:`_research.zygote.Zygote.run`)."""
    if variant.entry is not None:
        return _zygote(variant).run(
            variant.argv[2:], config, env, timeout=variant.timeout, kill_after=kill_after
        )
    if kill_after is not None:
        raise ValueError(f"{variant.name}: a kill at a time needs a forked variant (entry=)")
    return subprocess.run(
        [*variant.argv, json.dumps(dict(config))],
        env={**_child_env(), **env}, capture_output=True, text=True, timeout=variant.timeout, check=False,
    )  # fmt: skip


def _last_json(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    return {}


def _finish(outcome: Outcome, variant: Variant, config: dict[str, Any], max_resumes: int) -> None:
    """Resume in fresh processes until the run finishes (or ``max_resumes`` runs failed)."""
    for _ in range(max_resumes):
        run = _run(variant, {**config, "action": "resume"}, {})
        outcome.runs += 1
        if run.returncode == 0:
            outcome.result = _last_json(run.stdout)
            outcome.finished = outcome.result.get("status") == "finished"
            if outcome.finished:
                return
        outcome.error = f"exit {run.returncode}: {run.stderr[-2000:]}"


def experiment(
    world: ResearchWorld,
    variant: Variant,
    point: str,
    folder: Path,
    *,
    topic: str = TOPIC,
    max_resumes: int = 3,
) -> Outcome:
    """Kill ``variant`` at ``point`` and resume it until it finishes; count at the world.

    The world is reset first, ``folder`` emptied. When the start run finishes without reaching the
    point, the outcome says ``killed=False`` (the point does not exist in this variant).
    """
    world.reset()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = {**world_config(world), "dir": str(folder), "topic": topic}
    outcome = Outcome(point)
    run = _run(variant, {**config, "action": "start"}, {CRASH_ENV: point})
    outcome.runs = 1
    outcome.killed = run.returncode == -signal.SIGKILL and f"SIGKILL at {point} " in run.stderr
    if not outcome.killed:
        outcome.error = f"not killed at {point}: exit {run.returncode}: {run.stderr[-2000:]}"
        outcome.result = _last_json(run.stdout) if run.returncode == 0 else {}
        outcome.counters = world.counters()
        return outcome
    _finish(outcome, variant, config, max_resumes)
    outcome.counters = world.counters()
    return outcome


def clean_run(
    world: ResearchWorld, variant: Variant, folder: Path, *, topic: str = TOPIC
) -> tuple[Outcome, list[str]]:
    """Run ``variant`` once without a crash; its outcome and the kill points it traced, in order.

    Raises:
        RuntimeError: the clean run failed.
    """
    world.reset()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    trace = folder / "trace.txt"
    config = {**world_config(world), "dir": str(folder / "run"), "topic": topic, "action": "start"}
    run = _run(variant, config, {TRACE_ENV: str(trace)})
    outcome = Outcome("", runs=1, counters=world.counters())
    if run.returncode != 0:
        raise RuntimeError(f"{variant.name}: the clean run failed (exit {run.returncode}):\n{run.stderr}")
    outcome.result = _last_json(run.stdout)
    outcome.finished = outcome.result.get("status") == "finished"
    points = trace.read_text().split() if trace.exists() else []
    return outcome, list(dict.fromkeys(points))


def sweep(
    world: ResearchWorld,
    variant: Variant,
    folder: Path,
    *,
    points: Iterable[str] | None = None,
    topic: str = TOPIC,
    progress: Callable[[Outcome], None] | None = None,
    stride: int = 1,
) -> SweepResult:
    """The clean run, then :func:`experiment` at each kill point (``points``, else the variant's,
    else every point the clean run traced); ``stride`` n: at every n-th of them only (the first,
    the (n+1)-th, ...), to trim a sweep to its time budget."""
    started = time.monotonic()
    with _zygote_for(variant):
        clean, traced = clean_run(world, variant, folder / "clean", topic=topic)
        chosen = list(
            points if points is not None else variant.points if variant.points is not None else traced
        )[::stride]
        result = SweepResult(variant.name, clean, [], guarded=variant.guarded, traced=traced)
        for i, point in enumerate(chosen):
            outcome = experiment(world, variant, point, folder / f"p{i:03d}", topic=topic)
            result.outcomes.append(outcome)
            if progress is not None:
                progress(outcome)
    result.seconds = time.monotonic() - started
    return result


def langgraph_variants() -> list[Variant]:
    """LangGraph with sagaguard, and LangGraph's checkpointer alone."""
    child = str(HERE / "langgraph_child.py")
    entry, preload = "_research.langgraph_child:main", LANGGRAPH_PRELOAD
    return [
        Variant(
            "LangGraph + sagaguard", (sys.executable, child, "sagaguard"), guarded=True, entry=entry,
            preload=preload,
        ),
        Variant(
            "LangGraph alone (checkpointer)", (sys.executable, child, "plain"), entry=entry, preload=preload
        ),
    ]  # fmt: skip


def plugged(modules: Iterable[str], function: str) -> list[Any]:
    """What ``function()`` returns in each of ``modules`` that can be imported and defines it, in
    order (a module that is not there is skipped; an import error inside one propagates)."""
    found: list[Any] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        make: Callable[[], Sequence[Any]] | None = getattr(module, function, None)
        if make is not None:
            found.extend(make())
    return found


def all_variants() -> list[Variant]:
    """The LangGraph variants and those of every importable module in :data:`PLUGINS`."""
    return [*langgraph_variants(), *plugged(PLUGINS, "variants")]


def check_clean(result: SweepResult, topic: str = TOPIC) -> None:
    """Raise unless the clean run finished with the expected report.

    Raises:
        AssertionError: it did not.
    """
    assert result.clean.finished, f"{result.variant}: the clean run did not finish: {result.clean.result}"
    assert result.clean.report == expected_report(topic), f"{result.variant}: the clean report differs"
