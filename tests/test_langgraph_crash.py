"""A real LangGraph agent (SqliteSaver checkpoints, SqlStore effects) SIGKILLed mid-turn, resumed.

The child (``tests/_langgraphchild.py``) runs the ReAct loop with a scripted model that counts its
calls at a :class:`CounterService` in another process, and a ``pay`` tool that charges there. It is
killed (a) inside the tool after the charge reached the service, before anything recorded it, or
(b) inside the model node after the model answered, before the checkpoint. A fresh process resumes
from the checkpoint with ``graph.invoke(None, config)`` on the same ``thread_id``. What is asserted is
what the service counted. The contrast: the checkpointer alone charges twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sagaguard.idempotency.testing import CRASH_ENV, CounterService

CHILD = Path(__file__).resolve().parent / "_langgraphchild.py"
ROOT = CHILD.parent.parent

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def service() -> Iterator[CounterService]:
    with CounterService() as running:
        yield running


def child(
    folder: Path, service: CounterService, thread: str, mode: str, action: str, *, crash: str | None = None
) -> subprocess.CompletedProcess[str]:
    config = {"dir": str(folder), "service": service.url, "thread": thread, "mode": mode, "action": action}
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(CHILD.parent)])
    if crash:
        env[CRASH_ENV] = crash
    return subprocess.run(
        [sys.executable, str(CHILD), json.dumps(config)],
        env=env, capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip


def killed(run: subprocess.CompletedProcess[str], point: str) -> None:
    assert run.returncode == -signal.SIGKILL, f"exit {run.returncode}:\n{run.stdout}\n{run.stderr}"
    assert f"SIGKILL at {point}" in run.stderr


def report(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stdout}\n{run.stderr}"
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def crash_and_resume(
    tmp_path: Path, service: CounterService, mode: str, point: str
) -> tuple[str, dict[str, Any]]:
    thread = f"t-{uuid.uuid4().hex[:10]}"
    killed(child(tmp_path, service, thread, mode, "start", crash=point), point)
    return thread, report(child(tmp_path, service, thread, mode, "resume"))


def test_kill_inside_the_tool_after_the_charge_charges_once(tmp_path: Path, service: CounterService) -> None:
    thread, done = crash_and_resume(tmp_path, service, "sagaguard", "after_effect")
    assert service.count(f"tool:{thread}") == 1  # the resumed tool call was reconciled, not re-run
    assert service.count(f"model:{thread}") == 2  # the tool-calling answer, then "done"
    assert done["final"] == "done"
    assert done["answered"] == done["call_ids"]


def test_without_sagaguard_the_checkpointer_alone_charges_twice(
    tmp_path: Path, service: CounterService
) -> None:
    """The contrast: the ToolNode task re-runs from its first line, so the charge is made again."""
    thread, done = crash_and_resume(tmp_path, service, "plain", "after_effect")
    assert service.count(f"tool:{thread}") == 2
    assert done["final"] == "done"


def test_kill_in_the_model_node_replays_the_answer_with_the_same_tool_call_ids(
    tmp_path: Path, service: CounterService
) -> None:
    thread = f"t-{uuid.uuid4().hex[:10]}"
    killed(child(tmp_path, service, thread, "sagaguard", "start", crash="after_model"), "after_model")
    paid_before = service.count(f"model:{thread}")
    recorded = [c.provider_key for c in service.charges(key=f"model:{thread}")]
    done = report(child(tmp_path, service, thread, "sagaguard", "resume"))
    assert paid_before == 1
    # The resumed model node got the journaled answer: not paid again; then one call for "done".
    assert service.count(f"model:{thread}") == 2
    assert service.count(f"tool:{thread}") == 1
    # The ids the model answered with in the killed process are the ids the resumed run followed.
    assert done["call_ids"] == recorded[0].split(",")
    assert done["answered"] == done["call_ids"]


def test_kill_in_the_model_node_without_the_journal_gets_new_tool_call_ids(
    tmp_path: Path, service: CounterService
) -> None:
    """The contrast: the model is asked again (paid twice) and answers with other ids."""
    thread = f"t-{uuid.uuid4().hex[:10]}"
    killed(child(tmp_path, service, thread, "plain", "start", crash="after_model"), "after_model")
    lost = [c.provider_key for c in service.charges(key=f"model:{thread}")]
    done = report(child(tmp_path, service, thread, "plain", "resume"))
    assert service.count(f"model:{thread}") == 3  # the lost answer, its re-ask, then "done"
    assert done["call_ids"] != lost[0].split(",")  # the resumed run follows other tool call ids
