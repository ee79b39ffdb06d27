"""DBOS workflows as agent sagas, for real: DBOS on SQLite in child processes, real SIGKILLs.

The trip agent (``tests/_dbossagachild.py``, world in ``tests/_enginesagaworld.py``) books a hotel
at a local HTTP API, charges through the real ``stripe`` SDK at the local Stripe server, then its
flight tool fails. What is asserted is what those servers saw (counted in their own processes):
one booking, one charge, and after the failure one refund and one cancellation, whatever was
killed. Killed after the charge (DBOS has not recorded the step), DBOS recovery in a fresh process
re-runs the step, which replays the charge, and the run is undone; killed in the middle of its
compensation (the refund reached Stripe), DBOS recovery re-runs the workflow, whose end step
waits out the dead holder's run lease, takes the compensation over and finishes it. A run that
completes keeps its effects; ``sagaguard sagas cancel`` undoes a run whose process is gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import _enginesagakit as kit
import pytest
from _enginesagakit import Services

from sagaguard.saga.records import SagaState, StepState

pytestmark = pytest.mark.timeout(240)  # several fresh DBOS processes each, on a shared machine

CHILD = str(Path(__file__).resolve().parent / "_dbossagachild.py")
RUN = "trip-1"
UNDONE = Counter({"bookings": 1, "charges": 1, "refunds": 1, "cancellations": 1})


def child(mode: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the DBOS child: ``start`` the workflow, or ``recover`` what a killed one left."""
    return kit.run([sys.executable, CHILD, mode], env)


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    with kit.started_services() as found:
        yield found


@pytest.fixture(autouse=True)
def _fresh(services: Services) -> None:
    services.reset()


def test_dbos_worker_killed_after_the_charge_is_recovered_and_undoes_each_call_once(
    services: Services, tmp_path: Path
) -> None:
    kit.killed(child("start", kit.child_env(services, tmp_path, kill="after_charge")))
    assert services.seen() == {"bookings": 1, "charges": 1}
    out = json.loads(kit.ok(child("recover", kit.child_env(services, tmp_path))))
    assert "no seats left" in out["error"]
    assert services.seen() == UNDONE
    found = kit.snapshot(tmp_path, RUN)
    assert found.saga.state is SagaState.COMPENSATED
    tools = [row for row in found.steps if row.name.startswith("tool.")]
    assert [row.name.split(".")[1] for row in tools] == ["book_hotel_step", "charge"]
    assert {row.state for row in tools} == {StepState.COMPENSATED}


def test_dbos_worker_killed_in_the_compensation_is_finished_by_dbos_recovery(
    services: Services, tmp_path: Path
) -> None:
    kit.killed(child("start", kit.child_env(services, tmp_path, kill="in_refund")))
    assert services.seen() == {"bookings": 1, "charges": 1, "refunds": 1}
    assert kit.snapshot(tmp_path, RUN).saga.state is SagaState.COMPENSATING
    out = json.loads(kit.ok(child("recover", kit.child_env(services, tmp_path))))
    assert "no seats left" in out["error"]
    assert services.seen() == UNDONE
    assert kit.snapshot(tmp_path, RUN).saga.state is SagaState.COMPENSATED


def test_dbos_a_completed_run_keeps_its_effects(services: Services, tmp_path: Path) -> None:
    out = json.loads(kit.ok(child("start", kit.child_env(services, tmp_path, mode="complete"))))
    assert out == {"result": "flight-1"}
    assert services.seen() == {"bookings": 1, "charges": 1}
    assert kit.snapshot(tmp_path, RUN).saga.state is SagaState.COMPLETED


@pytest.mark.slow
@pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow (suite budget)")
def test_dbos_run_killed_then_cancelled_by_the_cli_is_undone_by_the_worker(
    services: Services, tmp_path: Path
) -> None:
    kit.killed(child("start", kit.child_env(services, tmp_path, kill="after_charge")))
    env = kit.child_env(services, tmp_path)
    kit.ok(kit.run(kit.cli("sagas", "cancel", RUN, "--journal", kit.db_url(tmp_path)), env))
    found = kit.worker_until_ended(env, tmp_path, RUN)
    assert found.saga.state is SagaState.COMPENSATED
    assert services.seen() == {"bookings": 1, "charges": 1, "refunds": 1, "cancellations": 1}
    # DBOS recovers the workflow afterwards: its next tool step is refused, nothing runs again.
    out = json.loads(kit.ok(child("recover", env)))
    assert "AgentRunStopped" in out["error"] or "cancelled" in out["error"]
    assert services.seen() == UNDONE


def test_dbos_cancelling_the_workflow_undoes_its_run(services: Services, tmp_path: Path) -> None:
    out = json.loads(kit.ok(child("cancel", kit.child_env(services, tmp_path))))
    assert out == {"state": "compensated"}
    assert services.seen() == UNDONE
    found = kit.snapshot(tmp_path, RUN)
    assert "cancelled" in (found.saga.error or "")
