"""The research agent resumed at once (issue 14): SIGKILL, then a supervisor's restart in a fresh
process with Guard's default options, as the framework pages show ``Guard(store)``.

A supervisor (systemd, Kubernetes, a retry loop) restarts a dead agent at once. The killed process
held claims (a model call in flight); on the same host its successor must take them over at once:
no ``AlreadyInProgress`` while a dead process's lease runs out, and the run finishes on the first
restart, with nothing charged or emailed twice (``tests/_research/resume.py`` counts at the world).

The suite kills each framework once, where a claim is held; the full supervised sweep (named and
seeded random kill times per framework, and the parallel tool-call variant) runs with ``-m sweep``,
and ``python tests/_research/resume.py`` writes its table into docs/frameworks/research_agent.md.
Restarts are counted, never timed: wall-clock figures go to the docs table only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _research.resume import (
    NAMED,
    NAMED_FANOUT,
    Resumed,
    clean_resume_run,
    fanout_variant,
    kill_times,
    resume_variants,
    summarize,
    supervise,
)
from _research.sweep import Variant, stop_zygotes
from _research.world import ResearchWorld

pytestmark = pytest.mark.timeout(300)

HELD = {
    "LangGraph + sagaguard": "model_answered#7",
    "OpenAI Agents SDK + sagaguard": "model_answered#59",
}
"""Per framework, a kill while a journaled model call is claimed and its answer not recorded: the
LangGraph summarize node's 7th answer, the Agents SDK loop's answer asking for the 13th claim check."""
RANDOM_KILLS = {"LangGraph + sagaguard": 8, "OpenAI Agents SDK + sagaguard": 6}
"""Random kill times per framework under ``-m sweep`` (trimmed to its budget: an Agents SDK run, its
restarts included, takes several times a LangGraph run's)."""
SEED = int(os.environ.get("SAGAGUARD_RESEARCH_SEED", "14"))
"""The random kill times' seed (``$SAGAGUARD_RESEARCH_SEED``; said in every failure message)."""


@pytest.fixture(scope="module")
def world() -> Iterator[ResearchWorld]:
    with ResearchWorld() as running:
        yield running
    stop_zygotes()


@pytest.mark.parametrize("variant", resume_variants(), ids=lambda v: v.name)
def test_a_same_host_resume_at_once_takes_over_and_finishes(
    variant: Variant, world: ResearchWorld, tmp_path: Path
) -> None:
    """Killed holding a model call's claim, restarted at once: the first restart finishes."""
    done = supervise(world, variant, tmp_path, point=HELD[variant.name], max_resumes=2)
    assert done.killed
    assert done.in_flight >= 1  # the dead process held a claim the restart had to take over
    assert (done.failures, done.finished) == ([], True), done.error
    assert (done.counters["charges"], done.counters["emails"]) == (1, 1)
    assert done.parked == []
    assert not done.operator


@pytest.mark.parametrize("variant", resume_variants(), ids=lambda v: v.name)
def test_a_resume_on_another_host_waits_out_the_lease_and_finishes(
    variant: Variant, world: ResearchWorld, tmp_path: Path
) -> None:
    """Restarted at once as "another host" (``$SAGAGUARD_HOST_ID``): the dead holder cannot be
    probed, so the restart waits for its claim's lease (5 s by default, within the default wait of
    10 s) and the first restart still finishes, with nothing charged or emailed twice."""
    done = supervise(
        world, variant, tmp_path, point=HELD[variant.name], max_resumes=2,
        resume_env={"SAGAGUARD_HOST_ID": "another-host"},
    )  # fmt: skip
    assert done.killed
    assert done.in_flight >= 1
    assert (done.failures, done.finished) == ([], True), done.error
    assert (done.counters["charges"], done.counters["emails"]) == (1, 1)
    assert done.parked == []


# ------------------------------------------------------------------------------ the full sweep


def _check(clean: dict[str, int], runs: list[Resumed], seed: int) -> dict[str, object]:
    row = summarize("", clean, runs)
    killed = [r for r in runs if r.killed]
    where = f"seed {seed}"
    assert killed, where
    assert {r.kill: r.failures for r in killed if r.failures} == {}, where
    assert (row["duplicate_charges"], row["duplicate_emails"]) == (0, 0), where
    assert row["finished"] == len(killed), where
    # Only an email whose delivery the kill left in doubt (no reconciler can ask SMTP) may need an
    # operator, and the agent finishes all the same.
    assert [op for op in row["operator"] if set(op["parked"]) - {"email.send"} or not op["finished"]] == []
    # At most one re-paid model call per call in flight at the kill.
    assert row["repaid_over_in_flight"] == 0, where
    return row


@pytest.mark.sweep
@pytest.mark.skipif("'sweep' not in config.getoption('markexpr')", reason="the full sweep runs with -m sweep")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("variant", resume_variants(), ids=lambda v: v.name)
def test_supervised_sweep(variant: Variant, world: ResearchWorld, tmp_path: Path) -> None:
    """Named kill points and seeded random kill times, each restarted at once until it finishes."""
    clean, longest = clean_resume_run(world, variant, tmp_path / "clean")
    runs = [supervise(world, variant, tmp_path / f"n{i}", point=p) for i, p in enumerate(NAMED[variant.name])]
    for i, delay in enumerate(kill_times(SEED, RANDOM_KILLS[variant.name], longest)):
        runs.append(supervise(world, variant, tmp_path / f"r{i}", kill_after=delay))
    _check(clean, runs, SEED)


@pytest.mark.sweep
@pytest.mark.skipif("'sweep' not in config.getoption('markexpr')", reason="the full sweep runs with -m sweep")
@pytest.mark.timeout(1800)
def test_parallel_model_calls_are_repaid_at_most_once_each(world: ResearchWorld, tmp_path: Path) -> None:
    """Model calls made from parallel tool calls, killed at random: at most one re-paid per call in
    flight at the kill (several may be in flight at once)."""
    variant = fanout_variant()
    clean, longest = clean_resume_run(world, variant, tmp_path / "clean")
    runs = [supervise(world, variant, tmp_path / f"n{i}", point=p) for i, p in enumerate(NAMED_FANOUT)]
    for i, delay in enumerate(kill_times(SEED + 100, 4, longest)):
        runs.append(supervise(world, variant, tmp_path / f"r{i}", kill_after=delay))
    _check(clean, runs, SEED + 100)
    # Killed inside a fan-out, more than one call was in flight (the claim is per call, not per kill).
    assert max(r.in_flight for r in runs[: len(NAMED_FANOUT)]) > 1
