"""The failing research agent, killed (issue 16, point 9): it books a reviewer and pays, then its
``publish`` tool fails; its tool calls are undone as an agent saga (refund, cancellation). Killed
anywhere in the run or in its compensation, resumed at once in a fresh process, swept by the worker
API, and counted at the world: the local Stripe (charges, refunds, what is left unrefunded) and the
review desk (bookings, cancellations, a cancellation of a booking already cancelled).

The suite kills LangGraph with sagaguard (the Agents SDK's ``SagaTurn`` only under ``-m sweep``) at
three named points: between the charge and its record (forward), after Stripe refunded and before
the undo's record (inside an undo), and between the two undos. The full sweep (``-m sweep``: every
point from the failing tool on, the whole compensation, every other point of the run before it, and
seeded random kill times, per framework; and each framework alone, the contrast) asserts the
targets at every kill; ``bench/research_failing.py`` kills at every point and writes its table into
docs/frameworks/research_agent.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _research.failing import (
    Failing,
    clean_failing_run,
    failing_variants,
    summarize,
    sweep_points,
    undo_experiment,
)
from _research.resume import kill_times
from _research.sweep import stop_zygotes
from _research.world import ResearchWorld

pytestmark = pytest.mark.timeout(300)

VARIANTS = failing_variants()
GUARDED = [v for v in VARIANTS if v.variant.guarded]
PLAIN = [v for v in VARIANTS if not v.variant.guarded]
LANGGRAPH = next(v for v in GUARDED if v.name == "LangGraph + sagaguard")
CLEAN = {"charges": 1, "bookings": 1, "refunds": 1, "cancellations": 1}
"""What a run that fails and is undone leaves at the world: one of each (the clean run, asserted in
the full sweep)."""
NAMED = {
    "charge_applied": "forward: Stripe charged, nothing recorded the charge yet",
    "refund_applied": "in the refund undo: Stripe refunded, nothing recorded the refund yet",
    "saga_commit#6": "between the undos: the refund's step committed COMPENSATED, the cancellation not begun",
}
"""The suite's kill points for LangGraph (the full sweep kills at every point)."""
SEED = int(os.environ.get("SAGAGUARD_RESEARCH_SEED", "16"))
"""The random kill times' seed (``$SAGAGUARD_RESEARCH_SEED``; said in every failure message)."""
RANDOM_KILLS = 2
"""Random kill times per sagaguard variant under ``-m sweep`` (trimmed to its budget)."""
FORWARD_STRIDE = 2
"""Under ``-m sweep``, every other point of the run from the booking to the failing tool (each
effect has several points in a row; the bench kills at every one), and every point from the
failing tool on: the failure and the whole compensation."""


@pytest.fixture(scope="module")
def world() -> Iterator[ResearchWorld]:
    with ResearchWorld() as running:
        yield running
    stop_zygotes()


@pytest.mark.parametrize("point", list(NAMED))
def test_a_failing_langgraph_agent_killed_is_undone_once(
    point: str, world: ResearchWorld, tmp_path: Path
) -> None:
    """Killed at ``point``, resumed at once, swept: one booking, one charge, one refund, one
    cancellation at the world, nothing left in place, the run's saga COMPENSATED."""
    done = undo_experiment(world, LANGGRAPH.variant, tmp_path, point=point)
    assert done.killed, done.error
    assert done.misses(CLEAN) == [], NAMED[point]
    assert {k: done.counters[k] for k in CLEAN} == CLEAN
    assert done.counters["cancellations_repeated"] == 0
    assert done.left == {"charges": 0, "bookings": 0}
    assert done.saga == "compensated"
    if point == "refund_applied":  # killed inside an undo, its 30 s lease live: the resume at once
        # took the dead process's run over and finished the undo on opening it (never waited)
        assert done.statuses[0] == "ended", done.statuses


# ------------------------------------------------------------------------------ the full sweep


def _where(failing: Failing, seed: int) -> str:
    return f"{failing.name}, seed {seed}"


@pytest.mark.sweep
@pytest.mark.skipif("'sweep' not in config.getoption('markexpr')", reason="the full sweep runs with -m sweep")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("failing", GUARDED, ids=lambda v: v.name)
def test_failing_sweep(failing: Failing, world: ResearchWorld, tmp_path: Path) -> None:
    """Every kill point from the first call with an undo (the booking, the charge, the failing tool,
    each undo and the commits between them), a few before it, and seeded random kill times: 0
    duplicate effects, 0 duplicate undos, nothing left in place, nothing stuck after the worker's
    sweep, nobody needed."""
    clean, traced, longest = clean_failing_run(world, failing.variant, tmp_path / "clean")
    assert {k: clean[k] for k in CLEAN} == CLEAN
    points = failing.points(traced, forward_stride=FORWARD_STRIDE)
    assert len(points) >= 25 and any(p.startswith("enter:undo:") for p in points)
    variant = failing.variant
    runs = [undo_experiment(world, variant, tmp_path / f"n{i}", point=p) for i, p in enumerate(points)]
    for i, delay in enumerate(kill_times(SEED, RANDOM_KILLS, longest)):
        runs.append(undo_experiment(world, variant, tmp_path / f"r{i}", kill_after=delay))
    where = _where(failing, SEED)
    assert [r.kill for r in runs[: len(points)] if not r.killed] == [], where
    assert {r.kill: m for r in runs if r.killed and (m := r.misses(clean))} == {}, where
    row = summarize(failing.name, clean, runs, guarded=True)
    assert (row["duplicate_charges"], row["duplicate_refunds"], row["stuck"]) == (0, 0, 0), where


@pytest.mark.sweep
@pytest.mark.skipif("'sweep' not in config.getoption('markexpr')", reason="the full sweep runs with -m sweep")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("failing", PLAIN, ids=lambda v: v.name)
def test_the_checkpointer_alone_leaves_the_charge_in_place(
    failing: Failing, world: ResearchWorld, tmp_path: Path
) -> None:
    """The contrast (reported, not a target): the framework's checkpointer alone undoes nothing,
    and a kill between an effect and the checkpoint does it twice. Killed at every third point from
    the answer asking for the booking on."""
    clean, traced, _ = clean_failing_run(world, failing.variant, tmp_path / "clean")
    assert (clean["charges"], clean["refunds"], clean["bookings"], clean["cancellations"]) == (1, 0, 1, 0)
    points = sweep_points(traced, (), failing.start, failing.fails_at)[::3]
    variant = failing.variant
    runs = [undo_experiment(world, variant, tmp_path / f"n{i}", point=p) for i, p in enumerate(points)]
    killed = [r for r in runs if r.killed]
    assert killed and all(r.left["charges"] + r.left["bookings"] > 0 for r in killed)
    row = summarize(failing.name, clean, runs, guarded=False)
    assert row["duplicate_charges"] + row["duplicate_bookings"] > 0
