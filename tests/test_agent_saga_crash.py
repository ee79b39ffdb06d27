"""Agent sagas under real SIGKILLs, counted at the fake API (another process), not in our code.

A trip agent (``tests/_agentsagachild.py``) books a hotel and charges a card, then fails. Killed
after the charge, cancelled through the CLI, its run is undone by a fresh worker process; that
worker killed right after the API applied the refund, the next worker finishes: one booking, one
charge, one refund, one cancellation reach the API. The same when the kill lands in the agent's own
compensation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from sagaguard.connectors.testing.http_server import LocalIdempotentApi
from sagaguard.saga import SagaState
from sagaguard.saga.journals import open_journal

pytestmark = pytest.mark.timeout(240)  # several fresh processes each, on a shared machine

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_agentsagachild.py"


def _env(api: LocalIdempotentApi, db: str, marks: Path, kill: str = "") -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), str(CHILD.parent), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "AGENT_API": api.url,
        "AGENT_DB": db, "AGENT_KILL": kill, "AGENT_MARKS": str(marks), "SAGAGUARD_STORE": db,
    }  # fmt: skip


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90, check=False)


_CLI = "import sys; from sagaguard.idempotency.cli import main; sys.exit(main(sys.argv[1:]))"


def _cli(*args: str) -> list[str]:
    """The ``sagaguard`` command line, run by this interpreter."""
    return [sys.executable, "-c", _CLI, *args]


def _applied(api: LocalIdempotentApi) -> Counter[str]:
    found = httpx.get(f"{api.url}/resources", timeout=10).json()["resources"]
    return Counter(resource["path"] for resource in found)


def worker_until_done(
    env: dict[str, str],
    db: str,
    *,
    kill_expected: bool,
    app: str = "_agentsagachild:registry",
    run_id: str = "thread-1",
) -> int:
    """Run ``sagaguard sagas worker --once`` in fresh processes until the run ``run_id`` has ended;
    returns how many passes it took (a killed one included)."""
    argv = [*_cli("sagas", "worker", "--app", app, "--journal", db), "--once"]  # the default lease
    journal = open_journal(db)
    try:
        for passes in range(1, 61):
            done = _run(argv, env)
            if kill_expected and done.returncode == -signal.SIGKILL:
                kill_expected = False
                continue
            assert done.returncode == 0, done.stdout + done.stderr
            found = journal.load(run_id)
            assert found is not None
            if found.saga.state not in (SagaState.RUNNING, SagaState.COMPENSATING):
                assert not kill_expected, "the worker was never killed in its compensation"
                return passes
            # Not a threshold: the loop polls until the run has ended (a dead process's run and
            # undo claim are taken over at once on this host, so one pass normally does).
            time.sleep(0.5)
        raise AssertionError("the run never ended")
    finally:
        journal.close()


def _charge_key(db: str) -> str:
    from sagaguard.idempotency import Guard, open_store
    from sagaguard.idempotency.keys import derive_explicit_key

    store = open_store(db)
    try:
        return derive_explicit_key(Guard(store).namespace, "thread-1/call-2", "agent.tool.charge")
    finally:
        store.close()


@pytest.fixture
def api() -> Any:
    with LocalIdempotentApi() as server:
        yield server


def test_agent_killed_then_cancelled_by_the_cli_is_undone_once_by_a_worker_killed_mid_undo(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path}/agent.db"
    agent = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path, "after_charge"))
    assert agent.returncode == -signal.SIGKILL, agent.stderr
    assert _applied(api) == {"/bookings": 1, "/charges": 1}
    cancelled = _run(_cli("sagas", "cancel", "thread-1", "--journal", db), _env(api, db, tmp_path))
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    passes = worker_until_done(_env(api, db, tmp_path, "in_refund"), db, kill_expected=True)
    # The default leases (30 s run, 60 s worker, 5 s effect): each pass takes the dead process's
    # run over at once (the killed agent's, then the killed worker's), none waits for a lease.
    assert passes == 2
    journal = open_journal(db)
    try:
        found = journal.load("thread-1")
        assert found is not None and found.saga.state is SagaState.COMPENSATED
    finally:
        journal.close()
    assert (tmp_path / "killed-in_refund").exists()
    assert _applied(api) == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}


def test_agent_killed_in_its_own_compensation_is_finished_by_a_worker(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path}/agent.db"
    agent = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path, "in_refund"))
    assert agent.returncode == -signal.SIGKILL, agent.stderr
    assert _applied(api) == {"/bookings": 1, "/charges": 1, "/refunds": 1}
    assert worker_until_done(_env(api, db, tmp_path), db, kill_expected=False) == 1  # at once
    assert _applied(api) == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}


def test_agent_killed_in_its_own_compensation_and_restarted_at_once_finishes_the_undo(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    """A supervisor restarting the agent at once, with the default 30 s run lease: the restarted
    agent takes its dead predecessor's run over (same host, holder dead) and finishes the undo
    itself, never running forward; each call undone once at the API."""
    db = f"sqlite:///{tmp_path}/agent.db"
    agent = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path, "in_refund"))
    assert agent.returncode == -signal.SIGKILL, agent.stderr
    again = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path, "in_refund"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout) == {"state": "compensated", "reopened": True}
    assert _applied(api) == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}


def test_agent_killed_mid_run_and_restarted_at_once_resumes_the_run(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    """Killed after the charge, restarted at once: the run resumes (its two calls replayed by the
    guard), fails as before and undoes them; nothing reaches the API twice."""
    db = f"sqlite:///{tmp_path}/agent.db"
    agent = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path, "after_charge"))
    assert agent.returncode == -signal.SIGKILL, agent.stderr
    again = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path, "after_charge"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout) == {"state": "compensated"}
    assert _applied(api) == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}


def test_an_exclusive_run_killed_after_it_completed_gives_its_answer_when_restarted(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    """Issue 26, item 6, in the engines' mode (``exclusive=True``): killed after the run completed,
    before the program saved its answer; the restarted program opens the run exclusively again and
    gets its answer (the booking, replayed by the guard), and nothing reaches the API again. Before,
    the open raised ``AgentRunEnded`` ("completed") on every restart."""
    db = f"sqlite:///{tmp_path}/agent.db"
    env = {**_env(api, db, tmp_path, "completed"), "AGENT_FLIGHT": "ok", "AGENT_EXCLUSIVE": "1"}
    agent = _run([sys.executable, str(CHILD)], env)
    assert agent.returncode == -signal.SIGKILL, agent.stdout + agent.stderr
    assert _applied(api) == {"/bookings": 1, "/charges": 1}
    again = _run([sys.executable, str(CHILD)], env)
    assert again.returncode == 0, again.stdout + again.stderr
    [booking] = [r for r in httpx.get(f"{api.url}/resources", timeout=10).json()["resources"]
                 if r["path"] == "/bookings"]  # fmt: skip
    assert json.loads(again.stdout) == {"state": "completed", "replayed": True, "answer": booking}
    assert _applied(api) == {"/bookings": 1, "/charges": 1}  # nothing again, nothing undone


def test_agent_that_fails_undoes_its_calls_once_in_its_own_process(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path}/agent.db"
    agent = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path))
    assert agent.returncode == 0, agent.stderr
    assert '"state": "compensated"' in agent.stdout
    assert _applied(api) == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}


def test_agent_restarted_on_another_host_leaves_the_run_to_its_lease(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    """The same kill, the restart on "another host" (``$SAGAGUARD_HOST_ID``): a holder elsewhere
    is never judged dead, so the run stays the dead process's until its lease runs out."""
    db = f"sqlite:///{tmp_path}/agent.db"
    agent = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path, "in_refund"))
    assert agent.returncode == -signal.SIGKILL, agent.stderr
    elsewhere = {**_env(api, db, tmp_path, "in_refund"), "SAGAGUARD_HOST_ID": "another-machine"}
    again = _run([sys.executable, str(CHILD)], elsewhere)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout) == {"state": "compensating", "reopened": True}
    assert _applied(api) == {"/bookings": 1, "/charges": 1, "/refunds": 1}


def test_a_dead_run_cancelled_leaves_no_claim_in_progress_or_in_doubt(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    """Killed inside the charge (the API charged, the claim still in progress), cancelled through
    the CLI and undone by the worker: the charge's record is settled by its undo (``CallUndone``),
    so ``effects list`` shows nothing in progress or in doubt (on main: "in progress, expired")."""
    db = f"sqlite:///{tmp_path}/agent.db"
    agent = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path, "in_charge"))
    assert agent.returncode == -signal.SIGKILL, agent.stderr
    assert _applied(api) == {"/bookings": 1, "/charges": 1}
    cancelled = _run(_cli("sagas", "cancel", "thread-1", "--store", db), _env(api, db, tmp_path))
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert worker_until_done(_env(api, db, tmp_path), db, kill_expected=False) == 1
    assert _applied(api) == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}
    listed = _run(_cli("effects", "list", "--store", db, "--json"), _env(api, db, tmp_path))
    assert listed.returncode == 0, listed.stdout + listed.stderr
    states = {record["name"]: record["state"] for record in json.loads(listed.stdout)}
    assert states["agent.tool.charge"] == "failed"  # settled: undone while its outcome was unknown
    assert not {"in_progress", "in_doubt"} & set(states.values()), states
    shown = _run(_cli("effects", "show", _charge_key(db), "--store", db), _env(api, db, tmp_path))
    assert "CallUndone" in shown.stdout, shown.stdout
