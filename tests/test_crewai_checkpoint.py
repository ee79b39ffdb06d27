"""A protected crew killed inside its FIRST task is restored from the checkpoint of that task's start:
CrewGuard.protect makes each task wait, at its start, for the checkpoint CrewAI writes on its event
bus's threads (``connectors/frameworks/_crewai_checkpoint.py``).

Without that wait the checkpoint is written while the task runs, and now and then not at all
(CrewAI serialises the kickoff's event record while the kickoff adds to it); a crash in the first
task then leaves nothing to restore, the restart is a new kickoff with new keys, and the charge
is made twice. That loss is rare and load-dependent (the figures: docs/frameworks/crewai.md), so
what is asserted here is what the wait makes certain and what the loss needs to be absent: the
checkpoint of the running task's start is on disk when the task's step starts (looked at by a
``pre_step`` hook of the child's own, after the adapter's) and when its tool is first called.
Without the wait the first look finds nothing on nearly every run (28 of 30 measured); with it,
both always find the file, whatever the load.

The crews run in children under ``.venv-crewai/bin/python`` (``tests/_crewaifirstcheckpoint.py``),
with the machine's cores kept busy by CPU hogs the test starts and stops, killed by a real SIGKILL
inside the first task's tool after the charge reached the counting service.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _crewenv import busy_cores
from test_crewai import ChildLines, child_env, crew_python  # noqa: F401 - the fixture, shared

from sagaguard.connectors.testing import LocalChatModel
from sagaguard.idempotency.testing import CounterService

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "_crewaifirstcheckpoint.py"

pytestmark = pytest.mark.timeout(400)

HOOKS, START, RESUME, ASTART, ARESUME = range(5)


@dataclass(kw_only=True)
class Played(ChildLines):
    """What the child printed, by step: its looks, kickoffs, hook counts and how each step ended."""

    folder: Path

    def of(self, step: int, kind: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["step"] == step and kind in line]

    def looks(self, step: int) -> list[tuple[str, str, bool]]:
        """(where, task, on disk) of each look the step made, in order."""
        return [(line["look"], line["task"], line["on_disk"]) for line in self.of(step, "look")]


def hogs() -> int:
    """One CPU hog per core this process may run on (at most 4): the crews run on a busy machine."""
    return min(len(os.sched_getaffinity(0)), 4)


@pytest.fixture(scope="module")
def service() -> Iterator[CounterService]:
    with CounterService() as running:
        yield running


@pytest.fixture(scope="module")
def played(crew_python: Path, service: CounterService, tmp_path_factory: pytest.TempPathFactory) -> Played:  # noqa: F811
    folder, run = tmp_path_factory.mktemp("crew-first"), f"f{uuid.uuid4().hex[:6]}"

    def spec(action: str, name: str, **more: Any) -> dict[str, Any]:
        # A kill and its restart share a folder (checkpoints, effects) and a name (the counts).
        return {"dir": str(folder / name), "run": f"{run}-{name}", "action": action, **more}

    plan = [
        spec("hooks", "hooks"),
        spec("start", "sync", crash="after_effect"),
        spec("resume", "sync"),
        spec("start", "async", crash="after_effect", **{"async": True}),
        spec("resume", "async", **{"async": True}),
    ]
    with busy_cores(hogs()), LocalChatModel() as model:  # one server: a checkpoint keeps its base_url
        config = {"service": service.url, "model": model.base_url, "steps": plan}
        done = subprocess.run(
            [str(crew_python), str(CHILD), json.dumps(config)], env=child_env(), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=360, check=False,
        )  # fmt: skip
    return Played(run=run, folder=folder, done=done)


@pytest.mark.parametrize("start", [START, ASTART], ids=["kickoff", "akickoff"])
def test_the_first_tasks_checkpoint_is_on_disk_before_its_first_step(played: Played, start: int) -> None:
    assert played.looks(start) == [("step", "pay", True), ("tool", "pay", True)]


@pytest.mark.parametrize(("start", "name"), [(START, "sync"), (ASTART, "async")], ids=["kickoff", "akickoff"])
def test_killed_inside_the_first_task_the_restart_restores_and_charges_once(
    played: Played, service: CounterService, start: int, name: str
) -> None:
    assert played.ended(start) == {"step": start, "exit": None, "signal": signal.SIGKILL}
    assert played.ended(start + 1) == {"step": start + 1, "exit": 0, "signal": 0}, played.done.stderr[-4000:]
    [resumed] = played.of(start + 1, "kickoff")
    assert resumed["restored"]  # the checkpoint of pay's start was there to restore
    # The restored kickoff's first task (pay again) waited for its own checkpoint too.
    assert played.looks(start + 1)[:2] == [("step", "pay", True), ("tool", "pay", True)]
    assert service.count(f"pay:{played.run}-{name}") == 1  # reconciled, not made again
    assert service.count(f"notify:{played.run}-{name}") == 1


def test_the_hook_is_registered_once_and_only_for_a_crew_with_checkpoints(played: Played) -> None:
    [hooks] = played.of(HOOKS, "hooks")
    assert hooks["hooks"] == {
        "unprotected": 0,
        "without_checkpoint": 0,  # CrewAI's no-op fast path for pre_step is kept
        "protected_three_times": 1,
        "after_clear_all_hooks": 1,  # protect registers it again
    }
    assert hooks["waits"] == {"without_checkpoint": [False, False], "checkpointed": [True, True]}


def test_the_mark_stays_out_of_crewais_checkpoints(played: Played) -> None:
    found = sorted((played.folder / "sync" / "checkpoints").rglob("*.json"))
    assert found
    assert not [path.name for path in found if "sagaguard" in path.read_text()]
