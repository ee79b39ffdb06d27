"""sagaguard.connectors.frameworks.langgraph on real LangGraph graphs: tool calls, node effects and model
calls replay.

A "crash" here is an exception that stops the run after some work was done; the run then resumes
from its checkpoint with ``graph.invoke(None, config)``, exactly as after a restart (the SIGKILL
versions are in test_langgraph_crash.py). The scripted model and graph are in _langgraphchild.py.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _langgraphchild import ScriptedModel, build_graph
from conftest import require_postgres
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task
from langgraph.graph import START, MessagesState, StateGraph

from sagaguard.connectors.frameworks.langgraph import (
    DurabilityWarning,
    JournaledChatModel,
    ToolGuard,
    task_scope_id,
    task_scoped,
)
from sagaguard.idempotency import ConfigurationError, Guard, MemoryStore, NoScope


@pytest.fixture
def guard() -> Iterator[Guard]:
    g = Guard(MemoryStore(), namespace="lg-tests")
    yield g
    g.close()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def checkpointer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "memory":
        yield InMemorySaver()
    elif request.param == "sqlite":
        from langgraph.checkpoint.sqlite import SqliteSaver

        conn = sqlite3.connect(tmp_path / "cp.db", check_same_thread=False)
        yield SqliteSaver(conn)
        conn.close()
    else:
        from langgraph.checkpoint.postgres import PostgresSaver

        with PostgresSaver.from_conn_string(require_postgres()) as saver:
            saver.setup()
            yield saver


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"t-{uuid.uuid4().hex[:8]}"}}


class Tools:
    """A ``pay`` tool counting its body runs per amount, and a ``flaky`` one failing once."""

    def __init__(self) -> None:
        self.paid: list[int] = []
        self.flaky_failures = 1

        @tool
        def pay(amount: int) -> str:
            """Pay."""
            self.paid.append(amount)
            return f"paid {amount}"

        @tool
        def flaky(x: int) -> str:
            """Fail once."""
            if self.flaky_failures:
                self.flaky_failures -= 1
                raise RuntimeError("the process died here")
            return "ok"

        self.tools = [pay, flaky]


CALLS = [
    {"name": "pay", "args": {"amount": 1}, "id": "c1"},
    {"name": "pay", "args": {"amount": 2}, "id": "c2"},
    {"name": "flaky", "args": {"x": 0}, "id": "c3"},
]


def test_replayed_tool_calls_return_the_recorded_message_without_running(
    guard: Guard, checkpointer: Any
) -> None:
    # flaky stands for the crash: not journaled, or its failure would (rightly) leave it in doubt.
    tools, model, tg = Tools(), ScriptedModel(tool_calls=CALLS), ToolGuard(guard, exclude={"flaky"})
    graph = build_graph(model, tools.tools, wrap=tg.wrap_tool_call, checkpointer=checkpointer)
    cfg = config()
    with pytest.raises(RuntimeError, match="died here"):
        graph.invoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
    assert sorted(tools.paid) == [1, 2]  # both parallel calls ran before the failure
    state = graph.invoke(None, cfg, durability="sync")  # the ToolNode task re-runs all three calls
    assert sorted(tools.paid) == [1, 2]  # told apart by tool_call_id: each replayed, none re-run
    answers = {m.tool_call_id: m.content for m in state["messages"] if isinstance(m, ToolMessage)}
    assert answers == {"c1": "paid 1", "c2": "paid 2", "c3": "ok"}
    assert state["messages"][-1].content == "done"


def test_a_new_turn_runs_the_tools_again_even_with_the_same_tool_call_ids(guard: Guard) -> None:
    tools, tg = Tools(), ToolGuard(guard)
    model = ScriptedModel(tool_calls=CALLS[:1])  # the same id "c1" every turn
    graph = build_graph(model, tools.tools, wrap=tg.wrap_tool_call, checkpointer=InMemorySaver())
    cfg = config()
    graph.invoke({"messages": [HumanMessage("turn 1")]}, cfg, durability="sync")
    graph.invoke({"messages": [HumanMessage("turn 2")]}, cfg, durability="sync")
    assert tools.paid == [1, 1]  # a new turn is a new task id, so a new key


def test_the_journaled_model_replays_its_answer_and_tool_call_ids(guard: Guard) -> None:
    scripted = ScriptedModel(tool_calls=[{"name": "pay", "args": {"amount": 5}}])
    model = JournaledChatModel(inner=scripted, guard=guard)
    crashes = [1]

    def agent(state: MessagesState) -> dict[str, Any]:
        answer = model.invoke(state["messages"])
        if crashes:
            crashes.pop()
            raise RuntimeError("died after the model answered")
        return {"messages": [answer]}

    tools = Tools()
    graph = build_graph(model, tools.tools, wrap=ToolGuard(guard).wrap_tool_call,
                        checkpointer=InMemorySaver(), agent=agent)  # fmt: skip
    cfg = config()
    with pytest.raises(RuntimeError):
        graph.invoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
    assert len(scripted.calls) == 1
    state = graph.invoke(None, cfg, durability="sync")
    assert len(scripted.calls) == 2  # the replayed answer cost nothing; then "done"
    first = state["messages"][1]
    assert isinstance(first, AIMessage) and first.tool_calls[0]["args"] == {"amount": 5}
    assert tools.paid == [5]


def test_model_calls_in_one_task_get_their_own_ordinals(guard: Guard) -> None:
    scripted = ScriptedModel(tool_calls=[{"name": "pay", "args": {"amount": 1}}])
    model = JournaledChatModel(inner=scripted, guard=guard)

    def agent(state: MessagesState) -> dict[str, Any]:
        first = model.invoke(state["messages"])
        second = model.invoke([*state["messages"], first, ToolMessage("x", tool_call_id="c")])
        return {"messages": [second]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_edge(START, "agent")
    app = graph.compile(checkpointer=InMemorySaver())
    state = app.invoke({"messages": [HumanMessage("go")]}, config(), durability="sync")
    assert state["messages"][-1].content == "done" and len(scripted.calls) == 2


def test_node_and_task_effects_are_keyed_on_the_task(guard: Guard) -> None:
    sent: list[str] = []

    @guard.effect("email.send")
    def send(to: str) -> str:
        sent.append(to)
        return f"sent to {to}"

    failures = [1]

    @task
    @task_scoped
    def notify(to: str) -> str:
        first, second = send(to), send(to + "+cc")  # ordinals 0 and 1 in this task
        if failures:
            failures.pop()
            raise RuntimeError("died after sending")
        return first + "; " + second

    @entrypoint(checkpointer=InMemorySaver())
    def workflow(to: str) -> str:
        return notify(to).result()

    cfg = config()
    with pytest.raises(RuntimeError):
        workflow.invoke("ann", cfg, durability="sync")
    assert workflow.invoke(None, cfg, durability="sync") == "sent to ann; sent to ann+cc"
    assert sent == ["ann", "ann+cc"]
    workflow.invoke("ann", cfg, durability="sync")  # a new run: a new task, sent again
    assert sent == ["ann", "ann+cc", "ann", "ann+cc"]


def test_async_graphs_replay_tool_and_model_calls(guard: Guard) -> None:
    tools, tg = Tools(), ToolGuard(guard, exclude={"flaky"})
    scripted = ScriptedModel(tool_calls=CALLS)
    model = JournaledChatModel(inner=scripted, guard=guard)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = build_graph(model, tools.tools, awrap=tg.awrap_tool_call, checkpointer=InMemorySaver(),
                        agent=agent)  # fmt: skip
    cfg = config()

    async def run() -> dict[str, Any]:
        with pytest.raises(RuntimeError):
            await graph.ainvoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
        return dict(await graph.ainvoke(None, cfg, durability="sync"))

    state = asyncio.run(run())
    assert sorted(tools.paid) == [1, 2]
    assert len(scripted.calls) == 2
    assert state["messages"][-1].content == "done"


def test_durability_other_than_sync_warns_and_strict_refuses(guard: Guard) -> None:
    tools = Tools()
    model = ScriptedModel(tool_calls=CALLS[:1])
    graph = build_graph(
        model, tools.tools, wrap=ToolGuard(guard).wrap_tool_call, checkpointer=InMemorySaver()
    )
    with pytest.warns(DurabilityWarning, match="durability='async'"):
        graph.invoke({"messages": [HumanMessage("go")]}, config())  # the default is "async"
    strict = build_graph(model, tools.tools, wrap=ToolGuard(guard, strict=True).wrap_tool_call,
                         checkpointer=InMemorySaver())  # fmt: skip
    with pytest.raises(ConfigurationError, match="durability='exit'"):
        strict.invoke({"messages": [HumanMessage("go")]}, config(), durability="exit")
    assert tools.paid == [1]  # refused before the tool ran


def test_outside_a_checkpointed_graph_there_is_no_task_scope() -> None:
    with pytest.raises(NoScope):
        task_scope_id()
    with pytest.raises(NoScope):
        task_scope_id({"configurable": {"checkpoint_ns": "agent:1"}})
    a = task_scope_id(
        {"configurable": {"thread_id": "a:b", "checkpoint_ns": "c", "__pregel_durability": "sync"}}
    )
    b = task_scope_id(
        {"configurable": {"thread_id": "a", "checkpoint_ns": "b:c", "__pregel_durability": "sync"}}
    )
    assert a != b
