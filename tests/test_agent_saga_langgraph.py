"""A LangGraph agent in an agent saga: a scripted model books a hotel and charges a card (two
parallel tool calls in one ``ToolNode`` turn), then its flight tool fails. Every booking and charge
is undone once, counted at a local HTTP API (the hotel and the card processor); a run stopped at an
approval and rejected is undone the same way."""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _agentsagagraph import ScriptedModel
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.langgraph_saga import SagaTools
from sagaguard.connectors.testing.http_server import LocalIdempotentApi
from sagaguard.idempotency import Guard
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.saga import SagaState, StepState
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals.sql import SqlJournal

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def api() -> Iterator[LocalIdempotentApi]:
    with LocalIdempotentApi(in_process=True) as server:
        yield server


def _post(api: LocalIdempotentApi, path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    reply = httpx.post(f"{api.url}{path}", json=body, headers={"Idempotency-Key": f'"{key}"'}, timeout=10)
    reply.raise_for_status()
    return dict(reply.json())


def _applied(api: LocalIdempotentApi) -> Counter[str]:
    found = httpx.get(f"{api.url}/resources", timeout=10).json()["resources"]
    return Counter(resource["path"] for resource in found)


class Trip:
    """The graph, its tools and undos, against ``api``."""

    def __init__(self, api: LocalIdempotentApi, tmp_path: Path, script: list[list[dict[str, Any]]]) -> None:
        self.undone: list[tuple[str, Any]] = []
        undos = UndoRegistry()

        @undos.register
        def cancel_booking(arguments: Any, result: Any) -> None:
            self.undone.append(("cancel_booking", result))
            _post(api, "/cancellations", {"booking": result["id"]}, f"cancel-{result['id']}")

        @undos.register
        def refund(arguments: Any, result: Any) -> None:
            self.undone.append(("refund", result))
            _post(api, "/refunds", {"charge": result["id"]}, f"refund-{result['id']}")

        @tool
        @changes_world(undo="cancel_booking")  # declared next to the tool
        def book_hotel(hotel: str) -> dict[str, Any]:
            """Book a hotel."""
            return _post(api, "/bookings", {"hotel": hotel}, f"book-{hotel}")

        @tool
        def charge(amount: int) -> dict[str, Any]:
            """Charge the card."""
            return _post(api, "/charges", {"amount": amount}, f"charge-{amount}")

        @tool
        def book_flight(to: str) -> str:
            """Book a flight."""
            raise RuntimeError(f"no seats to {to}")

        tools = SagaTools({"charge": changes_world(undo="refund")})  # or by name, at the adapter
        node = ToolNode(
            [book_hotel, charge, book_flight], wrap_tool_call=tools.wrap_tool_call, handle_tool_errors=False
        )
        model = ScriptedModel(script=script)
        builder = StateGraph(MessagesState)
        builder.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
        builder.add_node("tools", node)
        builder.add_edge(START, "model")
        builder.add_conditional_edges("model", tools_condition)
        builder.add_edge("tools", "model")
        self.graph = builder.compile(checkpointer=InMemorySaver())
        self.agent = AgentSaga("trip_agent", undos)
        url = f"sqlite:///{tmp_path}/agent.db"
        self.journal = SqlJournal(url)
        self.runner = AgentRunner(self.journal, Guard(SqlStore(url)), sleep=lambda _s: None)

    def invoke(self, thread: str) -> Any:
        config: Any = {"configurable": {"thread_id": thread}}
        return self.graph.invoke({"messages": [HumanMessage("book my trip")]}, config, durability="sync")


BOOK_AND_PAY = [
    {"name": "book_hotel", "args": {"hotel": "ritz"}},
    {"name": "charge", "args": {"amount": 420}},
]


def test_a_langgraph_agent_that_fails_on_a_later_tool_undoes_every_booking_and_charge_once(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    trip = Trip(api, tmp_path, [BOOK_AND_PAY, [{"name": "book_flight", "args": {"to": "Oslo"}}]])
    try:
        with pytest.raises(RuntimeError, match="no seats"), trip.runner.run(trip.agent, "thread-1"):
            trip.invoke("thread-1")
    finally:
        trip.runner.close()
    assert _applied(api) == {"/bookings": 1, "/charges": 1, "/cancellations": 1, "/refunds": 1}
    snapshot = trip.journal.load("thread-1")
    assert snapshot is not None and snapshot.saga.state is SagaState.COMPENSATED
    tools = sorted(r.name.split(".")[1] for r in snapshot.steps if r.name.startswith("tool."))
    assert tools == ["book_hotel", "charge"]  # parallel calls: in the order the journal registered them
    assert all(r.state is StepState.COMPENSATED for r in snapshot.steps if r.name.startswith("tool."))
    undone = [name for name, _ in trip.undone]
    first = snapshot.steps[0].name.split(".")[1]
    assert undone == (["refund", "cancel_booking"] if first == "book_hotel" else ["cancel_booking", "refund"])
    assert all(isinstance(result, dict) and "id" in result for _, result in trip.undone)  # the tool's output


def test_a_langgraph_run_rejected_at_an_approval_is_undone(api: LocalIdempotentApi, tmp_path: Path) -> None:
    trip = Trip(api, tmp_path, [BOOK_AND_PAY])
    try:
        with trip.runner.run(trip.agent, "thread-1") as run:
            trip.invoke("thread-1")
            run.pause()  # a human must approve the booking before the run goes on
        assert _applied(api) == {"/bookings": 1, "/charges": 1}
        outcome = trip.runner.reject(trip.agent, "thread-1", "too expensive")
    finally:
        trip.runner.close()
    assert outcome.state is SagaState.COMPENSATED
    assert _applied(api) == {"/bookings": 1, "/charges": 1, "/cancellations": 1, "/refunds": 1}


def test_a_completed_langgraph_run_keeps_its_effects(api: LocalIdempotentApi, tmp_path: Path) -> None:
    trip = Trip(api, tmp_path, [BOOK_AND_PAY])
    try:
        with trip.runner.run(trip.agent, "thread-1"):
            assert trip.invoke("thread-1")["messages"][-1].content == "done"
    finally:
        trip.runner.close()
    snapshot = trip.journal.load("thread-1")
    assert snapshot is not None and snapshot.saga.state is SagaState.COMPLETED
    assert _applied(api) == {"/bookings": 1, "/charges": 1}


# ------------------------------------------------------------------ real SIGKILLs, fresh processes

GRAPH_CHILD = Path(__file__).resolve().parent / "_agentsagagraph.py"


def _graph_env(api: LocalIdempotentApi, folder: Path, crash_at: str = "") -> dict[str, str]:
    from test_agent_saga_crash import ROOT

    path = os.pathsep.join(
        p for p in (str(ROOT), str(GRAPH_CHILD.parent), os.environ.get("PYTHONPATH", "")) if p
    )
    db = f"sqlite:///{folder / 'agent.db'}"
    return {
        **os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "AGENT_API": api.url,
        "AGENT_DIR": str(folder), "SAGAGUARD_CRASH_AT": crash_at, "SAGAGUARD_STORE": db,
    }  # fmt: skip


@pytest.mark.timeout(240)  # four fresh processes that import LangGraph, on a shared machine
def test_a_langgraph_agent_killed_mid_run_and_mid_compensation_undoes_each_call_once(tmp_path: Path) -> None:
    from test_agent_saga_crash import _run, worker_until_done

    with LocalIdempotentApi() as api:  # its own process: it outlives every kill
        agent = [sys.executable, str(GRAPH_CHILD)]
        killed = _run(agent, _graph_env(api, tmp_path, "in_model"))
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert _applied(api) == {"/bookings": 1, "/charges": 1}
        # Resumed from its checkpoint in a fresh process: the flight fails, the run compensates, and
        # the process is killed right after the refund reached the API.
        resumed = _run(agent, _graph_env(api, tmp_path, "in_refund"))
        assert resumed.returncode == -signal.SIGKILL, resumed.stdout + resumed.stderr
        # The two calls ran in parallel, so either undo may have come first: the cancellation too.
        after_kill = _applied(api)
        assert after_kill["/refunds"] == 1 and after_kill["/cancellations"] <= 1, after_kill
        db = f"sqlite:///{tmp_path / 'agent.db'}"
        # The default leases (30 s run, 60 s worker): one worker pass takes the dead process's run
        # over at once and finishes the compensation.
        passes = worker_until_done(
            _graph_env(api, tmp_path), db, kill_expected=False, app="_agentsagagraph:registry"
        )
        assert passes == 1
        assert _applied(api) == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}
    journal = SqlJournal(db)
    try:
        snapshot = journal.load("thread-1")
        assert snapshot is not None and snapshot.saga.state is SagaState.COMPENSATED
    finally:
        journal.close()


def test_the_declaration_says_the_undo_or_the_pivot_never_both() -> None:
    from sagaguard.connectors.declare import declaration_of
    from sagaguard.idempotency.errors import ConfigurationError

    assert changes_world(undo="refund").kind == "compensatable"
    assert changes_world(pivot=True).kind == "pivot"
    assert changes_world().kind == "nothing_to_undo"
    assert declaration_of(None, "search").kind == "nothing_to_undo"
    for bad in ({"undo": "refund", "pivot": True}, {"kind": "pivot"}, {"undo": "not a name"}):
        with pytest.raises(ConfigurationError):
            changes_world(**bad)
