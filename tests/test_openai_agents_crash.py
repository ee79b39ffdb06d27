"""A real SIGKILL inside an agent's tool, after its charge reached the service and before its record.

``tests/_agentschild.py`` runs an OpenAI Agents SDK agent (the real SDK, a scripted model) whose
``refund`` tool POSTs a charge to a :class:`CounterService` under the effect's provider key as
``Idempotency-Key``. The first child dies right after the POST. A fresh process reruns the same run
key on the same SQLite file: the model's first answer is replayed (same tool call id, not paid
again), the in-doubt tool call is re-sent under the same key and absorbed by the service, and the run
finishes. The service saw one charge.
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

CHILD = Path(__file__).resolve().parent / "_agentschild.py"
ROOT = CHILD.parent.parent

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def service() -> Iterator[CounterService]:
    with CounterService() as running:
        yield running


def run_child(config: dict[str, Any], crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    env.pop(CRASH_ENV, None)
    if crash_at is not None:
        env[CRASH_ENV] = crash_at
    return subprocess.run(
        [sys.executable, str(CHILD), json.dumps(config)],
        capture_output=True, text=True, env=env, timeout=90, check=False,
    )  # fmt: skip


def report(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_sigkill_after_the_tool_effect_then_rerun_charges_once_and_replays_the_model(
    service: CounterService, tmp_path: Path
) -> None:
    order = f"order-{uuid.uuid4().hex[:10]}"
    config = {
        "store": f"sqlite:///{tmp_path / 'agents.db'}",
        "service": service.url,
        "run_key": f"ticket/{order}/turn-1",
        "order": order,
    }

    killed = run_child(config, crash_at="after_effect")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "SIGKILL at after_effect" in killed.stderr
    assert service.count(order) == 1  # the charge went out; its record did not

    rerun = report(run_child(config))
    assert service.count(order) == 1  # re-sent under the same Idempotency-Key: absorbed
    assert rerun["output"].startswith(f"done: refunded {order}")
    assert rerun["call_ids"] == []  # the model was not asked for the tool call again: replayed
    assert (rerun["paid"], rerun["saved"]) == (1, 1)  # only the answer after the tool was paid

    again = report(run_child(config))  # the run finished: everything replays
    assert again["output"] == rerun["output"]
    assert (again["paid"], again["saved"]) == (0, 2)
    assert service.count(order) == 1
