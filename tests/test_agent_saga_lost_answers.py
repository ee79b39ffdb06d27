"""Issue 26, items 10 and 11: an undo finds the effect of a call whose answer was lost by the key
its body ran under, on every framework; a declared tool's failure is a failed step whatever the
framework does with the exception, and a pivot's in-doubt email is never sent again.

Each framework's child (a real process, SIGKILLed right after the counting API applied the charge,
before the tool returned) runs the world of ``tests/_undokey.py``; the run is then cancelled and
recovered here (its dead holder is taken over at once on this host), and what the API applied is
counted: the charge's undo finds the charge only by ``provider_key("payments.charge")``, i.e. only
when ``undoing().key`` is the scope the body ran in. These four kills (Agents SDK, LangGraph, DBOS,
Temporal against a real dev server) run behind ``slow`` (their processes cost seconds of the
default suite's budget); the default suite checks the same identity in-process on every adapter
(``undo_key_is_scope`` in tests/test_toolcall_conformance.py) and under a real kill on CrewAI, the
adapter that broke it. CrewAI's case is in tests/test_crewai_saga.py (its own environment).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _undokey as world
import pytest
from test_temporal_saga import temporal  # noqa: F401 - the fixture (a dev server), shared

from sagaguard.connectors.testing.http_server import LocalIdempotentApi
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga import SagaState, cancel, recover
from sagaguard.saga.journals import open_journal

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[LocalIdempotentApi]:
    with LocalIdempotentApi() as server:
        world.configure(api=server.url, marks=str(tmp_path), kill="")
        yield server


def _child(script: Path, *args: str, api: LocalIdempotentApi, db: str, marks: Path, kill: str) -> Any:
    path = os.pathsep.join(p for p in (str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "AGENT_API": api.url, "AGENT_KILL": kill,
        "AGENT_MARKS": str(marks), "SAGAGUARD_STORE": db, "AGENT_SESSION": "conv-1",
    }  # fmt: skip
    return subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=90, check=False
    )


def _undo_by_the_worker(db: str, run_id: str) -> SagaState:
    """Cancel the killed run and recover it here, as ``sagas cancel`` and the worker would."""
    journal, store = open_journal(db), open_store(db)
    try:
        cancel(journal, run_id, reason="the agent died")
        report = recover(journal, Guard(store), world.registry, sleep=lambda _s: None)
        return report.outcomes[run_id].state
    finally:
        store.close()
        journal.close()


def _counts() -> dict[str, int]:
    return {path: len(found) for path, found in world.applied().items()}


def _refunded_the_charge() -> bool:
    found = world.applied()
    charged = {r["id"] for r in found.get("/charges", [])}
    return bool(charged) and {r["body"]["charge"] for r in found.get("/refunds", [])} == charged


@pytest.mark.slow  # the default suite has this row in-process (test_toolcall_conformance)
def test_agents_sdk_a_charge_whose_answer_was_lost_is_refunded_by_its_provider_key(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path}/agent.db"
    done = _child(TESTS / "_undokeysdk.py", "lost", api=api, db=db, marks=tmp_path, kill="in_charge")
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert _counts() == {"/bookings": 1, "/charges": 1}
    assert _undo_by_the_worker(db, "conv-1/turn-1") is SagaState.COMPENSATED
    assert _counts() == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}
    assert _refunded_the_charge()


@pytest.mark.slow  # the default suite has this row in-process (test_toolcall_conformance)
def test_langgraph_a_charge_whose_answer_was_lost_is_refunded_by_its_provider_key(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path}/agent.db"
    done = _child(TESTS / "_undokeygraph.py", api=api, db=db, marks=tmp_path, kill="in_charge")
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert _counts() == {"/bookings": 1, "/charges": 1}
    assert _undo_by_the_worker(db, "thread-1") is SagaState.COMPENSATED
    assert _counts() == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}
    assert _refunded_the_charge()


@pytest.mark.slow  # DBOS's launch in a fresh process costs seconds
def test_dbos_a_charge_whose_answer_was_lost_is_refunded_by_its_provider_key(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path}/agent.db"
    done = _child(TESTS / "_undokeydbos.py", api=api, db=db, marks=tmp_path, kill="in_charge")
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert _counts() == {"/bookings": 1, "/charges": 1}
    assert _undo_by_the_worker(db, "trip-1") is SagaState.COMPENSATED
    assert _counts() == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}
    assert _refunded_the_charge()


@pytest.mark.slow  # a Temporal dev server and a worker process cost seconds
def test_temporal_a_charge_whose_answer_was_lost_is_refunded_by_its_provider_key(
    api: LocalIdempotentApi, tmp_path: Path, temporal: str  # noqa: F811 - the shared fixture
) -> None:
    """The worker is SIGKILLed inside the charge activity (the charge applied, its answer lost);
    the run, keyed on the workflow id, is cancelled and recovered here."""
    db, run_id = f"sqlite:///{tmp_path}/agent.db", f"trip-{uuid.uuid4().hex[:12]}"
    argv = (temporal, f"q-{uuid.uuid4().hex}", run_id)
    done = _child(TESTS / "_undokeytemporal.py", *argv, api=api, db=db, marks=tmp_path, kill="in_charge")
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert _counts() == {"/bookings": 1, "/charges": 1}
    assert _undo_by_the_worker(db, run_id) is SagaState.COMPENSATED
    assert _counts() == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}
    assert _refunded_the_charge()


def test_agents_sdk_a_pivot_killed_after_its_email_needs_attention_and_never_sends_it_again(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    """Killed right after the API took the email; the resumed turn finds the email in doubt: the
    failure ends the turn (it is not text for the model, which would ask again under a new call
    id), and the run waits for an operator with the booking kept (the pivot may have happened)."""
    db = f"sqlite:///{tmp_path}/agent.db"
    done = _child(TESTS / "_undokeysdk.py", "pivot", api=api, db=db, marks=tmp_path, kill="in_email")
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    import _undokeysdk as sdk

    world.configure(kill="in_email")  # once: its mark is there, so the turn goes on here
    report = asyncio.run(sdk.play("pivot", db, tmp_path, "conv-1"))
    # The SDK raises UserError from the tool's exception (failure_error_function=None).
    assert report == {
        "raised": "UserError",
        "cause": "OutcomeUnknown",
        "run_id": "conv-1/turn-1",
        "state": "needs_attention",
    }
    assert _counts() == {"/bookings": 1, "/emails": 1}


def test_agents_sdk_a_declared_tools_failure_is_a_failed_step_and_ends_the_turn(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    """The tools keep the SDK's default ``failure_error_function``: the flight's ``NoSeats`` still
    ends the turn (it is undone: the hotel cancelled), its step is not recorded as a success, and
    the confirmation email is never sent."""
    import _undokeysdk as sdk

    db = f"sqlite:///{tmp_path}/agent.db"
    report = asyncio.run(sdk.play("fails", db, tmp_path, "conv-2"))
    assert report == {
        "raised": "UserError",
        "cause": "NoSeats",
        "run_id": "conv-2/turn-1",
        "state": "compensated",
    }
    assert _counts() == {"/bookings": 1, "/cancellations": 1}
    journal = open_journal(db)
    try:
        found = journal.load("conv-2/turn-1")
        assert found is not None
        flights = [row for row in found.steps if row.name.startswith("tool.book_flight.")]
        assert len(flights) == 1 and flights[0].state.value != "succeeded"
    finally:
        journal.close()


def test_langgraph_a_failure_the_framework_turns_into_a_message_still_ends_the_run_failed(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    """``ToolNode(handle_tool_errors=True)`` turns the flight's ``NoSeats`` into an error message
    inside the step: the step raises ``ToolFailed`` (never a success; the message is all that is
    known, so the call is in doubt, maybe applied), ``ToolNode`` hands that to the model, which goes
    on and asks for the confirmation email (the pivot): that new step is refused (the run is
    failing), and leaving the block undoes the run (the hotel cancelled, the flight's undo run as
    for any call that may have applied) and raises the step's failure. Before, the run completed
    with the flight's error recorded as its result and the email sent."""
    from _agentsagagraph import ScriptedModel
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from sagaguard.connectors.declare import changes_world
    from sagaguard.connectors.frameworks.langgraph import ToolFailed, ToolGuard
    from sagaguard.idempotency.errors import OutcomeUnknown
    from sagaguard.saga.agent import AgentRunner

    db = f"sqlite:///{tmp_path}/agent.db"
    guard = Guard(open_store(db))

    @tool
    @changes_world(undo="cancel_booking", policy="at_least_once")
    def book_hotel(hotel: str) -> dict[str, Any]:
        """Book a hotel."""
        return world.book_hotel(hotel)

    @tool
    @changes_world(undo="cancel_flight", policy="at_least_once", permanent=(world.NoSeats,))
    def book_flight(to: str) -> dict[str, Any]:
        """Book a flight."""
        return world.book_flight(to)

    @tool
    @changes_world(pivot=True, policy="at_least_once")
    def send_email(to: str) -> dict[str, Any]:
        """Send the confirmation."""
        return world.send_email(guard, to)

    script = [
        [{"name": "book_hotel", "args": {"hotel": "ritz"}}],
        [{"name": "book_flight", "args": {"to": "Oslo"}}],
        [{"name": "send_email", "args": {"to": "ann@example.com"}}],
    ]
    model = ScriptedModel(script=script)
    tools = ToolGuard(guard, saga=True)
    node = ToolNode(
        [book_hotel, book_flight, send_email], wrap_tool_call=tools.wrap_tool_call, handle_tool_errors=True
    )
    builder = StateGraph(MessagesState)
    builder.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", node)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    graph = builder.compile()
    runner = AgentRunner(open_journal(db), guard, sleep=lambda _s: None)
    try:
        with pytest.raises(OutcomeUnknown) as raised, runner.run(world.trip, "thread-2") as run:
            graph.invoke(
                {"messages": [HumanMessage("book my trip")]}, {"configurable": {"thread_id": "thread-2"}}
            )
    finally:
        runner.close()
    assert isinstance(raised.value.__cause__, ToolFailed) and "no seats to Oslo" in str(raised.value)
    assert run.outcome is not None and run.outcome.state is SagaState.COMPENSATED
    assert _counts() == {"/bookings": 1, "/cancellations": 1, "/flight-cancellations": 1}  # no email
