"""sagaguard.connectors.frameworks.crewai on a real CrewAI crew, restored with ``Crew.from_checkpoint`` after
a real SIGKILL.

CrewAI needs openai<3 and this environment has openai>=3 (openai-agents), so the crews run in
children under ``.venv-crewai/bin/python`` (``tests/_crewaichild.py``; ``make test`` builds that
environment). What is asserted is what two services in other processes counted: the charges and
reads (:class:`CounterService`) and the model calls (:class:`LocalChatModel`, CrewAI's own OpenAI
client pointed at it). A CrewAI import costs seconds of CPU, so one child imports it once and forks
a fresh process for each step (each SIGKILL kills one step's process).

Without the CrewAI environment the tests skip, saying why; under ``CI=true`` they fail instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _crewenv import OFFLINE
from conftest import require_service

from sagaguard.connectors.testing import LocalChatModel
from sagaguard.idempotency.testing import CRASH_ENV, CounterService

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "_crewaichild.py"
EXAMPLE = ROOT / "docs" / "examples" / "crewai_crew.py"
CREW_PYTHON = Path(os.environ.get("SAGAGUARD_CREWAI_PYTHON", ROOT / ".venv-crewai" / "bin" / "python"))

pytestmark = pytest.mark.timeout(300)


def crewai_problem() -> str | None:
    """Why the CrewAI environment cannot be used, or None. Looks at files only (importing crewai
    takes seconds)."""
    if not CREW_PYTHON.exists():
        return f"{CREW_PYTHON} does not exist (make test builds it with pip install -e '.[crewai]')"
    found = list(CREW_PYTHON.parent.parent.glob("lib/python*/site-packages/crewai/__init__.py"))
    if not found:
        return f"crewai is not installed in {CREW_PYTHON.parent.parent}"
    return None


@pytest.fixture(scope="module")
def crew_python() -> Path:
    require_service("The CrewAI environment", crewai_problem())
    return CREW_PYTHON


def child_env(crash: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV} | OFFLINE
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    if crash:
        env[CRASH_ENV] = crash
    return env


@dataclass(kw_only=True)
class ChildLines:
    """What a CrewAI test's child printed (a JSON object a line, each with its ``step``) and how it
    exited; a child that did not exit 0 fails the test with its output."""

    run: str
    done: subprocess.CompletedProcess[str]
    lines: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        output = f"exit {self.done.returncode}:\n{self.done.stdout}\n{self.done.stderr[-6000:]}"
        assert self.done.returncode == 0, output
        self.lines = [json.loads(line) for line in self.done.stdout.splitlines() if line.startswith("{")]

    def ended(self, step: int) -> dict[str, Any]:
        """``exit`` (None when killed) and ``signal`` of the step's process."""
        return next(line for line in self.lines if line["step"] == step and "signal" in line)


@dataclass(kw_only=True)
class Steps(ChildLines):
    """What the child printed, by step: its kickoff reports and how its process ended."""

    def reports(self, step: int, mode: str) -> list[dict[str, Any]]:
        """The step's kickoff reports for the crew of ``mode``, after checking the step exited 0."""
        assert self.ended(step) == {"step": step, "exit": 0, "signal": 0}, self.done.stderr[-4000:]
        return [line for line in self.lines if line["step"] == step and line.get("mode") == mode]

    def counts(self, service: CounterService, step: int, mode: str) -> tuple[int, int]:
        """(reads, charges) the service counted for the crew of ``mode`` in ``step``'s run."""
        run = f"{self.run}-{step}-{mode}"
        return service.count(f"lookup:{run}"), service.count(f"pay:{run}")


REPLAY, SAGAGUARD_START, SAGAGUARD_RESUME, PLAIN_START, PLAIN_RESUME, ASYNC_REPLAY, UNITS = range(7)


@pytest.fixture(scope="module")
def service() -> Iterator[CounterService]:
    with CounterService() as running:
        yield running


@pytest.fixture(scope="module")
def steps(crew_python: Path, service: CounterService, tmp_path_factory: pytest.TempPathFactory) -> Steps:
    """Every scenario, in one child that forks a fresh process per step after importing CrewAI once."""
    folder, run = tmp_path_factory.mktemp("crews"), f"r-{uuid.uuid4().hex[:8]}"

    def spec(action: str, mode: str, name: int, crash: str | None = None, **more: Any) -> dict[str, Any]:
        # A crash and its resume share a folder (the checkpoints) and a name (the counts).
        return {"dir": str(folder / str(name)), "run": f"{run}-{name}", "mode": mode, "action": action,
                "crash": crash, **more}  # fmt: skip

    plan = [
        spec("replay", "sagaguard,plain", REPLAY),
        spec("start", "sagaguard", SAGAGUARD_START, crash="after_effect"),
        spec("resume", "sagaguard", SAGAGUARD_START),
        spec("start", "plain", PLAIN_START, crash="after_effect"),
        spec("resume", "plain", PLAIN_START),
        spec("replay", "sagaguard", ASYNC_REPLAY, **{"async": True}),
        spec("units", "sagaguard", UNITS),
    ]
    with LocalChatModel() as model:  # one server: a crew's checkpoint keeps its base_url
        config = {"service": service.url, "model": model.base_url, "steps": plan}
        done = subprocess.run(
            [str(crew_python), str(CHILD), json.dumps(config)], env=child_env(), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
    return Steps(run=run, done=done)


def test_a_clean_run_calls_each_tool_and_model_once(steps: Steps, service: CounterService) -> None:
    clean = steps.reports(REPLAY, "sagaguard")[0]
    # Two tasks, each: the model asks for the task's tool, then answers after the tool's result.
    assert clean["model_calls"] == 4
    assert steps.counts(service, REPLAY, "sagaguard") == (1, 1)  # after the replay too: see below
    assert clean["tasks"] == ["done after 4 messages", "done after 4 messages"]


def test_a_restored_crew_replays_tools_and_model_calls_without_running_them(
    steps: Steps, service: CounterService
) -> None:
    """Restored from its first checkpoint in the same process, the crew runs both tasks again from
    their first step: every model answer comes from the journal, every tool result from its record."""
    clean, again = steps.reports(REPLAY, "sagaguard")
    assert again["kickoff"] == clean["kickoff"]  # the identity the keys are built on survived
    assert again["model_calls"] == 0  # nothing paid for the re-run
    assert steps.counts(service, REPLAY, "sagaguard") == (1, 1)
    assert again["tasks"] == clean["tasks"]


def test_without_sagaguard_a_restored_crew_runs_tools_and_model_again(
    steps: Steps, service: CounterService
) -> None:
    """The contrast: CrewAI's checkpoint restore alone runs the tasks' tools and model calls again."""
    clean, again = steps.reports(REPLAY, "plain")
    reads, charges = steps.counts(service, REPLAY, "plain")
    assert clean["model_calls"] == 4
    assert charges == 2
    # Restored at the first task's start (the plain crew waits for its checkpoints as a protected
    # one does, tests/_crewcheckpoint.py): both tasks run again, lookup and charge.
    assert again["model_calls"] == 4 and reads == 2


def test_akickoff_replays_tools_and_model_calls_too(steps: Steps, service: CounterService) -> None:
    clean, again = steps.reports(ASYNC_REPLAY, "sagaguard")
    assert (clean["model_calls"], again["model_calls"]) == (4, 0)
    assert steps.counts(service, ASYNC_REPLAY, "sagaguard") == (1, 1)


def test_acall_async_tools_and_tool_call_answers_replay_under_a_callers_scope(
    steps: Steps, service: CounterService
) -> None:
    """Outside a crew, in ``with scope(...)``: ``acall``, ``call`` answering tool calls, and a tool
    with an async body, each made by a CrewGuard and again by a fresh one (a re-run)."""
    [report] = steps.reports(UNITS, "units")
    first, again = report["runs"]
    assert (first["paid"], again["paid"]) == (2, 0)
    assert again["text"] == first["text"]
    # The tool calls come back as the provider's own objects, with the first answer's ids.
    assert again["calls"] == first["calls"]
    assert again["call_types"] == ["ChatCompletionMessageFunctionToolCall"]
    assert again["receipt"] == first["receipt"]
    assert service.count(f"apay:{steps.run}-{UNITS}") == 1
    assert report["outside"] == "NoScope"  # neither in a kickoff nor in a scope: refused


def test_sigkill_inside_a_tool_after_the_charge_then_from_checkpoint_charges_once(
    steps: Steps, service: CounterService
) -> None:
    assert steps.ended(SAGAGUARD_START) == {"step": SAGAGUARD_START, "exit": None, "signal": signal.SIGKILL}
    assert "SIGKILL at after_effect" in steps.done.stderr
    [resumed] = steps.reports(SAGAGUARD_RESUME, "sagaguard")
    assert steps.counts(service, SAGAGUARD_START, "sagaguard") == (1, 1)  # reconciled, not made again
    # The restore re-runs pay from its first step; its first model answer comes from the journal:
    # only the answer after the tool's result is paid for.
    assert resumed["model_calls"] == 1
    assert resumed["tasks"] == ["done after 4 messages", "done after 4 messages"]


def test_without_sagaguard_sigkill_then_from_checkpoint_charges_twice(
    steps: Steps, service: CounterService
) -> None:
    assert steps.ended(PLAIN_START)["signal"] == signal.SIGKILL
    [resumed] = steps.reports(PLAIN_RESUME, "plain")
    lookups, charges = steps.counts(service, PLAIN_START, "plain")
    assert charges == 2  # the restored crew ran pay from its start: the customer is charged twice
    # CrewAI's event bus writes checkpoints from its own thread: the newest on disk at the kill was
    # lookup's end (lookup not run again) or, seen on a loaded machine, lookup's start (run again).
    assert lookups in (1, 2)
    assert resumed["model_calls"] == 2 * lookups  # and asked the model again, two calls per task


def test_the_docs_example_runs_in_the_crewai_environment(crew_python: Path, tmp_path: Path) -> None:
    """docs/examples/crewai_crew.py needs crewai, so test_docs_examples (main environment) only sees
    it skip itself; here it runs for real."""
    done = subprocess.run(
        [str(crew_python), str(EXAMPLE)], cwd=tmp_path, stdin=subprocess.DEVNULL,
        env={**child_env(), "CREWAI_STORAGE_DIR": str(tmp_path)},
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    assert "charges at the service: 1" in done.stdout
    assert "model calls paid by the restored crew: 0" in done.stdout
