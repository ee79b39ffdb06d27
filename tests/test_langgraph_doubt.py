"""sagaguard.connectors.frameworks.langgraph: read-only tools by default, declared tools at most once, and the
three choices of ``on_doubt`` when an effect is left in doubt, on real LangGraph graphs.

The effect in doubt is an email send (a ``guard.effect``, at most once) whose connection drops after
the message went out: the one thing SMTP cannot answer. The operator resolves it with the real CLI
(``sagaguard effects resolve``) on the same SQLite store.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _langgraphchild import ScriptedModel, build_graph
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from sagaguard.connectors.declare import changes_world, read_only
from sagaguard.connectors.frameworks.langgraph import ToolGuard
from sagaguard.connectors.in_doubt import ReturnPending, Stop, WaitForOperator
from sagaguard.idempotency import Guard, OutcomeUnknown, State
from sagaguard.idempotency.cli import main as cli
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores.sql import SqlStore


class World:
    """A mail server that drops the first connection after taking the message, and tools using it."""

    def __init__(self, guard: Guard) -> None:
        self.sent: list[str] = []
        self.reads: list[str] = []
        self.drops = 1
        self.search_failures = 0

        @guard.effect("mail.send", result_type=str)
        def send(to: str) -> str:
            self.sent.append(to)
            if self.drops:
                self.drops -= 1
                raise ConnectionResetError("connection lost after DATA")
            return f"sent to {to}"

        @tool
        def notify(to: str) -> str:
            """Email someone (the send is a guarded effect of its own)."""
            return send(to)

        @tool
        @changes_world
        def wire(to: str) -> str:
            """Wire money: changes the world with no guarded effect inside."""
            self.sent.append(f"wire:{to}")
            if self.drops:
                self.drops -= 1
                raise ConnectionResetError("the bank hung up")
            return f"wired {to}"

        @tool
        def search(query: str) -> str:
            """A read."""
            self.reads.append(query)
            if self.search_failures:
                self.search_failures -= 1
                raise TimeoutError("the index was slow")
            return f"found {query}"

        self.tools = [notify, wire, search]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'effects.db'}"


@pytest.fixture
def guard(url: str) -> Iterator[Guard]:
    store = SqlStore(url)
    g = Guard(store, namespace="lg-doubt")
    yield g
    g.close()
    store.close()


def run_config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"t-{uuid.uuid4().hex[:8]}"}}


def graph_for(world: World, name: str, tools: ToolGuard) -> Any:
    model = ScriptedModel(tool_calls=[{"name": name, "args": _args(name), "id": f"call-{name}"}])
    return build_graph(model, world.tools, wrap=tools.wrap_tool_call, checkpointer=InMemorySaver())


def _args(name: str) -> dict[str, str]:
    return {"query": "flights"} if name == "search" else {"to": "ada@example.com"}


def in_doubt(store: IdempotencyStore, name: str) -> str:
    keys = [r.key for r in store.list() if r.name == name and r.state is State.IN_DOUBT]
    assert len(keys) == 1, keys
    return keys[0]


def resolve(url: str, key: str, result: Any) -> None:
    assert cli(["--store", url, "effects", "resolve", key, "--applied", "--result", json.dumps(result)]) == 0


def test_a_read_only_tool_that_fails_is_asked_again_and_never_parks(guard: Guard) -> None:
    world = World(guard)
    world.search_failures = 1
    graph, cfg = graph_for(world, "search", ToolGuard(guard)), run_config()
    with pytest.raises(TimeoutError):
        graph.invoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
    assert not [r for r in guard.store.list() if r.name.startswith("langgraph.tool.")]  # nothing parked
    state = graph.invoke(None, cfg, durability="sync")
    assert world.reads == ["flights", "flights"]
    assert state["messages"][-1].content == "done"


def test_a_declared_tool_in_doubt_stops_the_run_and_replays_once_resolved(guard: Guard, url: str) -> None:
    world = World(guard)
    graph, cfg = graph_for(world, "wire", ToolGuard(guard)), run_config()
    with pytest.raises(OutcomeUnknown):
        graph.invoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
    key = in_doubt(guard.store, "langgraph.tool.wire")
    with pytest.raises(OutcomeUnknown):  # still parked: never wired twice
        graph.invoke(None, cfg, durability="sync")
    shape = {"content": "wired ada@example.com", "tool_call_id": "call-wire", "name": "wire"}
    resolve(url, key, shape)  # the documented --result shape of a LangGraph tool call
    state = graph.invoke(None, cfg, durability="sync")
    answer = [m for m in state["messages"] if isinstance(m, ToolMessage)][-1]
    assert (answer.content, answer.tool_call_id) == ("wired ada@example.com", "call-wire")
    assert world.sent == ["wire:ada@example.com"]
    assert state["messages"][-1].content == "done"


def test_the_old_behaviour_stays_one_policy_away(guard: Guard) -> None:
    world = World(guard)
    world.search_failures = 1
    graph = graph_for(world, "search", ToolGuard(guard, policy="at_most_once"))
    with pytest.raises(OutcomeUnknown):  # every tool at most once, as before declarations
        graph.invoke({"messages": [HumanMessage("go")]}, run_config(), durability="sync")


def test_a_mapping_declaration_wins_over_the_decorator(guard: Guard) -> None:
    world = World(guard)
    graph = graph_for(world, "wire", ToolGuard(guard, declare={"wire": read_only}))
    with pytest.raises(ConnectionResetError):  # read-only: the error is not a doubt
        graph.invoke({"messages": [HumanMessage("go")]}, run_config(), durability="sync")


def test_stop_raises_and_the_rerun_replays_what_the_operator_resolved(guard: Guard, url: str) -> None:
    world = World(guard)
    graph, cfg = graph_for(world, "notify", ToolGuard(guard, on_doubt=Stop())), run_config()
    with pytest.raises(OutcomeUnknown):
        graph.invoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
    # The doubt is held by the send's record alone: the tool's claim was released.
    assert not [r for r in guard.store.list() if r.name == "langgraph.tool.notify"]
    resolve(url, in_doubt(guard.store, "mail.send"), "sent to ada@example.com")
    state = graph.invoke(None, cfg, durability="sync")
    assert [m.content for m in state["messages"] if isinstance(m, ToolMessage)] == ["sent to ada@example.com"]
    assert world.sent == ["ada@example.com"]


def test_return_pending_hands_the_model_a_pending_result_and_the_run_finishes(guard: Guard) -> None:
    world = World(guard)
    graph = graph_for(world, "notify", ToolGuard(guard, on_doubt=ReturnPending()))
    state = graph.invoke({"messages": [HumanMessage("go")]}, run_config(), durability="sync")
    [answer] = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    pending = json.loads(str(answer.content))
    assert (pending["status"], pending["effect"]) == ("pending", "mail.send")
    assert pending["key"] == in_doubt(guard.store, "mail.send")
    assert "operator" in pending["message"]
    assert state["messages"][-1].content == "done"  # the agent went on
    assert world.sent == ["ada@example.com"]


def test_wait_for_operator_polls_then_replays_the_resolution(guard: Guard, url: str) -> None:
    world = World(guard)
    looks: list[float] = []

    def operator_sleep(seconds: float) -> None:  # the operator acts during the second wait
        looks.append(seconds)
        if len(looks) == 2:
            resolve(url, in_doubt(guard.store, "mail.send"), "sent to ada@example.com")

    waiting = WaitForOperator(timeout=60.0, interval=5.0, sleep=operator_sleep, clock=lambda: 0.0)
    graph = graph_for(world, "notify", ToolGuard(guard, on_doubt=waiting))
    state = graph.invoke({"messages": [HumanMessage("go")]}, run_config(), durability="sync")
    assert looks == [5.0, 5.0]
    assert [m.content for m in state["messages"] if isinstance(m, ToolMessage)] == ["sent to ada@example.com"]
    assert world.sent == ["ada@example.com"]


def test_wait_for_operator_gives_up_after_its_timeout(guard: Guard) -> None:
    world = World(guard)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    waiting = WaitForOperator(timeout=10.0, interval=4.0, sleep=sleep, clock=lambda: now[0])
    graph = graph_for(world, "notify", ToolGuard(guard, on_doubt=waiting))
    with pytest.raises(OutcomeUnknown):
        graph.invoke({"messages": [HumanMessage("go")]}, run_config(), durability="sync")
    assert now[0] == 12.0  # three looks of 4 s, then the deadline
    assert world.sent == ["ada@example.com"]
