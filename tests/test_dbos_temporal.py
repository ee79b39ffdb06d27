"""Durable-execution engines: guarded effects scoped to a Temporal activity or a DBOS step.

Temporal runs in ``temporalio.testing.ActivityEnvironment``: an activity run again with the same info
(another attempt) replays its effects; another activity id runs them again.

DBOS runs for real on SQLite, in child processes (DBOS is a process-wide singleton): the first child
starts a workflow whose step makes two guarded effects and is SIGKILLed inside the step, after them,
before DBOS records the step's output. The second child launches DBOS, which recovers the pending
workflow and re-runs the step from its first line under the same workflow id and step id: the effects
replay, the file they append to has each line once. Run as a script, this file is that child.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.testing import ActivityEnvironment

from sagaguard.connectors.frameworks.dbos import dbos_scope
from sagaguard.connectors.frameworks.temporal import activity_scope, activity_scope_id, temporal_scoped
from sagaguard.idempotency import ConfigurationError, Guard, MemoryStore, open_store

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------------- Temporal


class Mailer:
    def __init__(self, guard: Guard) -> None:
        self.sent: list[str] = []

        @guard.effect("mail.send")
        async def send(to: str) -> str:
            self.sent.append(to)
            return f"sent #{len(self.sent)}"

        @activity.defn
        @temporal_scoped
        async def notify(to: str) -> list[str]:
            return [await send(to), await send(f"cc:{to}")]

        self.notify = notify


def env_with(**changes: Any) -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(ActivityEnvironment.default_info(), **changes)
    return env


def test_temporal_an_activity_retried_replays_its_effects() -> None:
    mailer = Mailer(Guard(MemoryStore()))
    first = asyncio.run(env_with(attempt=1).run(mailer.notify, "a@example.com"))
    again = asyncio.run(env_with(attempt=2).run(mailer.notify, "a@example.com"))  # a retry
    assert again == first == ["sent #1", "sent #2"]
    assert mailer.sent == ["a@example.com", "cc:a@example.com"]


def test_temporal_another_activity_id_or_run_executes_again() -> None:
    mailer = Mailer(Guard(MemoryStore()))
    asyncio.run(env_with(activity_id="1").run(mailer.notify, "a@example.com"))
    asyncio.run(env_with(activity_id="2").run(mailer.notify, "a@example.com"))
    asyncio.run(env_with(activity_id="2", workflow_run_id="run-2").run(mailer.notify, "a@example.com"))
    assert len(mailer.sent) == 6


def test_temporal_scope_of_sync_activities_and_outside_one() -> None:
    def which() -> str:
        with activity_scope() as unit:
            return unit.id

    scope_id = env_with(activity_id="7").run(which)
    assert json.loads(scope_id) == ["temporal", "default", "test-run", "7"]
    with pytest.raises(ConfigurationError):
        activity_scope_id()
    with pytest.raises(ConfigurationError):
        env_with(workflow_run_id=None).run(which)


def test_dbos_scope_outside_a_step_is_refused() -> None:
    with pytest.raises(ConfigurationError), dbos_scope():
        pass


# ------------------------------------------------------------------------------------------ DBOS

WORKFLOW_ID = "order-42-notify"


def dbos_child(workdir: Path, crash: bool) -> int:
    """Start (``crash``) or recover the workflow; print the step's result as JSON."""
    from dbos import DBOS, SetWorkflowID

    from sagaguard.connectors.frameworks.dbos import dbos_scoped

    store = open_store(f"sqlite:///{workdir / 'effects.db'}")
    guard = Guard(store, lease=0.5, wait=20.0)
    log = workdir / "sent.log"

    @guard.effect("mail.send")
    def send(to: str) -> str:
        with log.open("a") as out:
            out.write(to + "\n")
        return f"sent to {to}"

    @DBOS.step()
    @dbos_scoped
    def notify_step(to: str) -> list[str]:
        with (workdir / "step_runs.log").open("a") as out:
            out.write(f"{DBOS.workflow_id} {DBOS.step_id}\n")
        results = [send(to), send(f"cc:{to}")]
        if crash:  # both effects done and recorded, the step's output not: DBOS re-runs the step
            os.kill(os.getpid(), signal.SIGKILL)
        return results

    @DBOS.workflow()
    def notify(to: str) -> list[str]:
        return notify_step(to)

    DBOS(config={"name": "sagaguard-test", "system_database_url": f"sqlite:///{workdir / 'dbos.sqlite'}"})
    DBOS.launch()
    try:
        if crash:
            with SetWorkflowID(WORKFLOW_ID):
                notify("a@example.com")
            return 1  # not reached
        result: list[str] = DBOS.retrieve_workflow(WORKFLOW_ID).get_result()  # recovered at launch
        print(json.dumps(result), flush=True)
        return 0
    finally:
        DBOS.destroy()
        guard.close()
        store.close()


def run_dbos_child(workdir: Path, crash: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run(
        [sys.executable, __file__, str(workdir), "crash" if crash else "recover"],
        capture_output=True, text=True, env=env, timeout=90, check=False,
    )  # fmt: skip


def test_dbos_a_step_re_run_after_sigkill_replays_its_effects(tmp_path: Path) -> None:
    killed = run_dbos_child(tmp_path, crash=True)
    assert killed.returncode == -signal.SIGKILL, f"{killed.stdout}\n{killed.stderr}"
    sent = tmp_path / "sent.log"
    assert sent.read_text().splitlines() == ["a@example.com", "cc:a@example.com"]

    recovered = run_dbos_child(tmp_path, crash=False)
    assert recovered.returncode == 0, f"{recovered.stdout}\n{recovered.stderr}"
    assert json.loads(recovered.stdout.strip().splitlines()[-1]) == [
        "sent to a@example.com",
        "sent to cc:a@example.com",
    ]
    assert sent.read_text().splitlines() == ["a@example.com", "cc:a@example.com"]  # nothing twice
    runs = (tmp_path / "step_runs.log").read_text().splitlines()
    assert len(runs) == 2 and runs[0] == runs[1]  # the step did run again, as the same step


if __name__ == "__main__":
    sys.exit(dbos_child(Path(sys.argv[1]), sys.argv[2] == "crash"))
