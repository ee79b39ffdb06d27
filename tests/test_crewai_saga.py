"""CrewAI in an agent saga: a real crew's declared tool calls undone in reverse, each once, when its
kickoff fails, is rejected by a human, is cancelled, or is killed and then restored or cancelled.

The crew (``tests/_crewaisagachild.py``, run by ``.venv-crewai/bin/python``: CrewAI needs openai<3)
books a hotel at a local HTTP API and charges a card through the real ``stripe`` SDK at the local
Stripe, then books a flight. What is asserted is what those servers (other processes) applied,
per trip: bookings, cancellations, charges, refunds. One child imports CrewAI once and forks a fresh
process per scenario; the worker that finishes a killed run is ``sagaguard sagas worker`` in the
main environment, which has no CrewAI: it runs the same undos (``tests/_crewaisaga.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import stripe
from test_agent_saga_crash import _cli, _run, worker_until_done
from test_crewai import ChildLines, child_env, crew_python  # noqa: F401 - the fixture, shared

from sagaguard.connectors.testing import LocalChatModel, LocalIdempotentApi, LocalStripe
from sagaguard.saga import SagaState
from sagaguard.saga.journals import open_journal

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "_crewaisagachild.py"

pytestmark = pytest.mark.timeout(300)

FAIL, LEAVE, COMPLETE, REJECT, CANCEL, ASYNC, VANISH, PIVOT, ARUN = range(9)  # one fork each
KILLED, RESUMED, ORPHANED, EXAMPLE = range(9, 13)
LOST, RESTARTED, SWALLOWED = range(13, 16)
EXAMPLE_FILE = ROOT / "docs" / "examples" / "crewai_saga.py"


@dataclass
class Servers:
    api: LocalIdempotentApi
    stripe: LocalStripe

    def trip(self, run: str) -> dict[str, int]:
        """What the servers applied for the trip ``run``: bookings, cancellations, charges, refunds."""
        resources = httpx.get(f"{self.api.url}/resources", timeout=10).json()["resources"]
        bookings = {r["id"] for r in resources if r["path"] == "/bookings" and r["body"]["hotel"] == run}
        cancels = [r["body"]["booking"] for r in resources if r["path"] == "/cancellations"]
        sdk = stripe.StripeClient(
            self.stripe.api_key, base_addresses={"api": self.stripe.api_base}, max_network_retries=0
        )
        intents = sdk.v1.payment_intents.list({"limit": 100}).data
        refunds = sdk.v1.refunds.list({"limit": 100}).data
        return {
            "bookings": len(bookings),
            "cancellations": sum(1 for booking in cancels if booking in bookings),
            "charges": sum(1 for i in intents if _trip_of(i) == run and i.status == "succeeded"),
            "refunds": sum(1 for r in refunds if _trip_of(r) == run),
        }


def _trip_of(found: Any) -> Any:
    return found.metadata.to_dict().get("run")


ONE_EACH = {"bookings": 1, "cancellations": 1, "charges": 1, "refunds": 1}
KEPT = {"bookings": 1, "cancellations": 0, "charges": 1, "refunds": 0}


@dataclass(kw_only=True)
class Played(ChildLines):
    """What the child printed: one report per kickoff, and how each step's process ended."""

    folder: Path

    def trip(self, step: int) -> str:
        return f"{self.run}-{step}"

    def report(self, step: int) -> dict[str, Any]:
        assert self.ended(step) == {"step": step, "exit": 0, "signal": 0}, self.done.stderr[-6000:]
        return next(line for line in self.lines if line["step"] == step and "run" in line)

    def db(self, step: int) -> str:
        return f"sqlite:///{self.folder / str(step) / 'agent.db'}"


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    with LocalIdempotentApi() as api, LocalStripe() as local_stripe:  # their own processes
        yield Servers(api, local_stripe)


@pytest.fixture(scope="module")
def played(crew_python: Path, servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Played:  # noqa: F811
    folder, run = tmp_path_factory.mktemp("crew-sagas"), f"t{uuid.uuid4().hex[:6]}"

    def spec(index: int, **more: Any) -> dict[str, Any]:
        # A kill and its resume share a folder (journal, effects, checkpoints) and a trip.
        name = RESUMED - 1 if index == RESUMED else index
        # A restart that could not restore shares the killed crew's folder (its journal), under a
        # trip of its own (the servers' counts tell the two kickoffs apart).
        home = LOST if index == RESTARTED else name
        return {"dir": str(folder / str(home)), "run": f"{run}-{name}", "action": "start", **more}

    plan = [
        spec(FAIL, flight="fail", again=True),
        spec(LEAVE, flight="fail", leave=True),
        spec(COMPLETE, flight="ok", approve=True),
        spec(REJECT, flight="ok", approve="too expensive"),
        spec(CANCEL, flight="ok", cancel=True),
        spec(ASYNC, flight="fail", **{"async": True}),
        spec(VANISH, flight="vanish"),
        spec(PIVOT, flight="fail", pivot=True),
        spec(ARUN, action="arun"),
        spec(KILLED, flight="fail", crash="before_flight"),
        spec(RESUMED, action="resume", crash="in_refund"),
        spec(ORPHANED, flight="fail", crash="before_flight"),
        spec(EXAMPLE, action="example", example=str(EXAMPLE_FILE)),
        spec(LOST, flight="ok", lost=True, crash="in_charge"),
        spec(RESTARTED, flight="ok", lost=True),
        spec(SWALLOWED, flight="fail", model_sees_errors=True),
    ]
    with LocalChatModel() as model:
        config = {"model": model.base_url, "api": servers.api.url, "stripe": servers.stripe.api_base,
                  "steps": plan}  # fmt: skip
        done = subprocess.run(
            [str(crew_python), str(CHILD), json.dumps(config)], env=child_env(), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=280, check=False,
        )  # fmt: skip
    return Played(run=run, folder=folder, done=done)


def _tools(report: dict[str, Any]) -> list[tuple[str, str]]:
    return [(row["name"], row["state"]) for row in report["rows"] if row["name"].startswith("tool.")]


def test_a_crew_whose_tool_fails_undoes_its_booking_and_charge_once(played: Played, servers: Servers) -> None:
    report = played.report(FAIL)
    assert report["raised"] == "ToolExecutionFailedError"  # tool_failure_policy="raise"
    assert report["run_id"] and report["state"] == "compensated"
    assert _tools(report) == [("tool.book_hotel.0", "compensated"), ("tool.charge.1", "compensated")]
    assert servers.trip(played.trip(FAIL)) == ONE_EACH
    # The undos got the calls' arguments by name (defaults included) and the tools' own output.
    book, charge = (row["call"] for row in report["rows"][:2])
    assert book["arguments"] == {"nights": 2}
    assert book["result"]["body"] == {"hotel": played.trip(FAIL), "nights": 2}
    assert charge["arguments"] == {"amount": 4200} and charge["result"]["id"].startswith("pi_")


def test_a_crew_whose_run_was_undone_refuses_to_kick_off_again_from_its_checkpoint(
    played: Played, servers: Servers
) -> None:
    assert played.report(FAIL)["again"] == "AgentRunEnded"
    assert servers.trip(played.trip(FAIL)) == ONE_EACH  # nothing ran again


def test_on_failure_leave_parks_the_failed_kickoff_for_an_operator(played: Played, servers: Servers) -> None:
    report = played.report(LEAVE)
    assert (report["raised"], report["state"]) == ("ToolExecutionFailedError", "needs_attention")
    assert servers.trip(played.trip(LEAVE)) == KEPT


def test_a_kickoff_that_completes_keeps_its_effects(played: Played, servers: Servers) -> None:
    report = played.report(COMPLETE)
    assert (report["raised"], report["state"]) == (None, "completed")  # approved at the pay task
    assert _tools(report) == [("tool.book_hotel.0", "succeeded"), ("tool.charge.1", "succeeded")]
    assert servers.trip(played.trip(COMPLETE)) == KEPT


def test_a_human_who_rejects_at_the_guardrail_undoes_the_kickoff(played: Played, servers: Servers) -> None:
    report = played.report(REJECT)
    assert (report["raised"], report["reason"]) == ("KickoffRejected", "too expensive")
    assert report["state"] == "compensated"
    assert servers.trip(played.trip(REJECT)) == ONE_EACH


def test_a_kickoff_cancelled_while_it_runs_stops_at_its_next_step_and_undoes_itself(
    played: Played, servers: Servers
) -> None:
    report = played.report(CANCEL)
    assert (report["raised"], report["state"]) == ("AgentRunCancelled", "compensated")
    # Cancelled once booked: the charge never ran; the booking was cancelled.
    booked_only = {"bookings": 1, "cancellations": 1, "charges": 0, "refunds": 0}
    assert servers.trip(played.trip(CANCEL)) == booked_only


def test_akickoff_undoes_its_steps_too(played: Played, servers: Servers) -> None:
    report = played.report(ASYNC)
    assert (report["raised"], report["state"]) == ("ToolExecutionFailedError", "compensated")
    assert servers.trip(played.trip(ASYNC)) == ONE_EACH


def test_the_adapters_reject_undoes_a_run_left_open(played: Played, servers: Servers) -> None:
    """The kickoff's process stopped as a crash does (its run left RUNNING); a human rejects it
    through ``CrewSaga.reject`` (from any process)."""
    report = played.report(VANISH)
    assert (report["raised"], report["rejected"]) == ("Vanished", "compensated")
    assert report["state"] == "compensated"
    assert servers.trip(played.trip(VANISH)) == ONE_EACH


def test_a_charge_declared_the_pivot_stops_the_undo_there(played: Played, servers: Servers) -> None:
    """``changes_world(pivot=True)`` by name at the adapter: after the charge the run only goes
    forward, so the failure after it undoes nothing before it."""
    report = played.report(PIVOT)
    assert report["raised"] == "ToolExecutionFailedError"
    assert _tools(report) == [("tool.book_hotel.0", "succeeded"), ("tool.charge.1", "succeeded")]
    assert servers.trip(played.trip(PIVOT)) == KEPT


def test_a_declared_tools_async_body_is_a_step_too(played: Played, servers: Servers) -> None:
    """``await tool.arun()`` in ``async with runner.run(...)``: registered, run, then undone."""
    report = played.report(ARUN)
    assert (report["raised"], report["state"]) == ("RuntimeError", "compensated")
    assert _tools(report) == [("tool.book_hotel_async.0", "compensated")]
    assert report["rows"][0]["call"]["arguments"] == {"nights": 3}
    trip = servers.trip(played.trip(ARUN))
    assert (trip["bookings"], trip["cancellations"]) == (1, 1)


def _worker_env(servers: Servers, played: Played, step: int, crash: str = "") -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ, "PYTHONPATH": path, "SAGAGUARD_STORE": played.db(step), "CREW_API": servers.api.url,
        "CREW_STRIPE": servers.stripe.api_base, "CREW_MARKS": str(played.folder / str(step)),
        "SAGAGUARD_CRASH_AT": crash,
    }  # fmt: skip


def _run_id(db: str) -> str:
    journal = open_journal(db)
    try:
        [record] = journal.list()
        return record.saga_id
    finally:
        journal.close()


def _state(db: str, run_id: str) -> SagaState:
    journal = open_journal(db)
    try:
        found = journal.load(run_id)
        assert found is not None
        return found.saga.state
    finally:
        journal.close()


def test_killed_after_the_charge_restored_from_its_checkpoint_killed_mid_undo_then_finished_once(
    played: Played, servers: Servers
) -> None:
    """SIGKILL in the next tool after the charge; ``Crew.from_checkpoint`` in a fresh process: the
    flight fails, the kickoff compensates, and that process is SIGKILLed right after Stripe applied
    the refund; ``sagaguard sagas worker`` (fresh processes) finishes: one of each at the servers."""
    trip = played.trip(KILLED)
    assert played.ended(KILLED)["signal"] == signal.SIGKILL
    assert played.ended(RESUMED)["signal"] == signal.SIGKILL
    assert "SIGKILL at before_flight" in played.done.stderr and "SIGKILL at in_refund" in played.done.stderr
    assert servers.trip(trip) == {"bookings": 1, "cancellations": 0, "charges": 1, "refunds": 1}
    db = played.db(KILLED)
    run_id = _run_id(db)
    assert _state(db, run_id) is SagaState.COMPENSATING
    env = _worker_env(servers, played, KILLED)
    worker_until_done(env, db, kill_expected=False, app="_crewaisaga:registry", run_id=run_id)
    assert _state(db, run_id) is SagaState.COMPENSATED
    assert servers.trip(trip) == ONE_EACH


def test_killed_after_the_charge_then_cancelled_by_the_cli_is_undone_once_by_a_worker_killed_mid_undo(
    played: Played, servers: Servers
) -> None:
    trip = played.trip(ORPHANED)
    assert played.ended(ORPHANED)["signal"] == signal.SIGKILL
    assert servers.trip(trip) == {"bookings": 1, "cancellations": 0, "charges": 1, "refunds": 0}
    db = played.db(ORPHANED)
    run_id = _run_id(db)
    cancelled = _run(_cli("sagas", "cancel", run_id, "--journal", db), _worker_env(servers, played, 0))
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    env = _worker_env(servers, played, ORPHANED, crash="in_refund")
    worker_until_done(env, db, kill_expected=True, app="_crewaisaga:registry", run_id=run_id)
    assert (played.folder / str(ORPHANED) / "killed-in_refund").exists()
    assert _state(db, run_id) is SagaState.COMPENSATED
    assert servers.trip(trip) == ONE_EACH


def test_the_docs_example_runs_in_the_crewai_environment(played: Played) -> None:
    """docs/examples/crewai_saga.py needs crewai: test_docs_examples (main environment) only sees it
    skip itself; here it runs for real (its own asserts check the undos and the saga's state)."""
    assert played.report(EXAMPLE)["example"] == "ran"
    assert "['book Ritz', 'charge 420', 'refund 420', 'cancel bk-Ritz']" in played.done.stdout


def test_public_api_is_locked(played: Played) -> None:
    """sagaguard.connectors.frameworks.crewai_saga's public names (read in the CrewAI environment)."""
    exports = ["ABANDON_AFTER", "CrewSaga", "KickoffRejected", "tool_output"]
    assert played.report(EXAMPLE)["exports"] == exports


def _recover(db: str, servers: Servers, monkeypatch: pytest.MonkeyPatch, clock: Any = time.time) -> Any:
    """The worker's pass, in this process (no CrewAI here: the undos are ``_crewaisaga``'s)."""
    import _crewaisaga

    from sagaguard.idempotency import Guard, open_store
    from sagaguard.saga import recover

    monkeypatch.setenv("CREW_API", servers.api.url)
    monkeypatch.setenv("CREW_STRIPE", servers.stripe.api_base)
    journal, store = open_journal(db, clock=clock), open_store(db)
    try:
        return recover(journal, Guard(store), _crewaisaga.registry, sleep=lambda _s: None)
    finally:
        store.close()
        journal.close()


def test_a_crew_killed_in_its_charge_then_restarted_without_its_checkpoint_is_undone_past_its_deadline(
    played: Played, servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26, items 10 and 12. SIGKILLed right after Stripe applied the charge made inside the
    tool's body (its answer lost), the crew is started again without restoring a checkpoint: a new
    kickoff, a new saga, which completes. The first saga is not left running with its booking and
    its charge: ``CrewSaga`` records a bounded abandon deadline (``ABANDON_AFTER``) with each run,
    so the worker (which has no setting for it) parks the dead kickoff and, once the deadline has
    passed on the journal's clock, undoes it; its undo finds the lost charge by
    ``provider_key("payments.charge")`` (``undoing().key`` is the body's scope, ``{run}/{call}``,
    as on every framework) and refunds it. Nothing of the second kickoff is undone."""
    assert played.ended(LOST)["signal"] == signal.SIGKILL
    assert played.report(RESTARTED)["state"] == "completed"
    old, new = played.trip(LOST), played.trip(RESTARTED)
    assert servers.trip(old) == KEPT and servers.trip(new) == KEPT
    db = played.db(LOST)
    journal = open_journal(db)
    try:
        [stale] = [r.saga_id for r in journal.list() if r.state is SagaState.RUNNING]
    finally:
        journal.close()
    later = [0.0]

    def clock() -> float:
        return time.time() + later[0]

    first = _recover(db, servers, monkeypatch, clock)
    assert first.outcomes[stale].state is SagaState.WAITING  # parked: its kickoff may come back
    later[0] = 601.0  # CrewSaga's default deadline (600 s) has passed, on the journal's clock
    assert _recover(db, servers, monkeypatch, clock).outcomes[stale].state is SagaState.COMPENSATED
    assert servers.trip(old) == ONE_EACH
    assert servers.trip(new) == KEPT


def test_a_declared_tools_failure_handed_to_the_model_still_undoes_the_kickoff(
    played: Played, servers: Servers
) -> None:
    """Issue 26, item 11 on CrewAI: with CrewAI's default tool failure policy the flight's error
    goes to the model, which answers, and the kickoff would complete. The flight is declared, so
    its failure is a failed step and the run is failing: when the kickoff returns, its run is
    undone (the booking and the charge, once each; the flight's undo finds nothing to cancel) and
    ``kickoff`` raises the flight's failure. Before, the kickoff completed and kept everything."""
    report = played.report(SWALLOWED)
    # Declared without permanent=, the flight's RuntimeError leaves it in doubt (maybe applied).
    assert report["raised"] == "OutcomeUnknown" and "no seats to Oslo" in report["reason"]
    assert report["state"] == "compensated"
    assert [state for name, state in _tools(report) if name.startswith("tool.book_flight.")] != ["succeeded"]
    assert servers.trip(played.trip(SWALLOWED)) == ONE_EACH
