"""One precedence rule for a tool call's options, over every adapter (issue 30): the adapter's
options for this tool by name, over the declaration's own, over the adapter's options for every
tool, over the defaults of the declaration's kind, over the guard's
(:func:`sagaguard.connectors.toolcall.call_options`, docs/agent_sagas.md "Which options win").

Each row runs one real framework turn whose model asks for the tool ``book``, which raises; each
layer that gives an option gives its own ``classify``, and the one the guard asks about the
failure is the one that won. CrewAI's rows run in its own virtualenv with the conformance table:
tests/test_toolcall_conformance.py::test_crewai_the_highest_layer_that_gives_an_option_wins.

==========  ==================================================================================
adapter     the adapter's ``classify=`` (for every tool) wins over the defaults of the kind
            (``changes_world()``: at most once, its own classifier)
declared    the declaration's ``classify=`` wins over the adapter's
per_tool    the adapter's options for the tool by name win over the declaration's (only the
            Agents SDK takes them: ``tool_options``)
==========  ==================================================================================
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _guardutil import caused_by

from sagaguard.connectors.declare import ToolDeclaration, changes_world
from sagaguard.connectors.toolcall import call_options
from sagaguard.idempotency import Guard
from sagaguard.idempotency.effect import NO_RETRY, Policy
from sagaguard.idempotency.records import Disposition
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry

pytestmark = pytest.mark.timeout(60)


class Boom(Exception):
    """The tool's failure: sure not to have applied (each classifier says so)."""


Classify = Callable[[BaseException], Disposition | None]


def _spy(layer: str, asked: list[str]) -> Classify:
    def classify(exc: BaseException) -> Disposition | None:
        asked.append(layer)
        return Disposition.PERMANENT if isinstance(exc, Boom) else None

    return classify


@dataclass
class Layers:
    """What each layer gives (None: nothing)."""

    adapter: Classify | None = None
    declared: Classify | None = None
    per_tool: Classify | None = None

    def declaration(self, undo: str | None = None) -> ToolDeclaration:
        options: dict[str, Any] = {} if self.declared is None else {"classify": self.declared}
        return changes_world(undo=undo, **options)


def _book(item: str) -> str:
    raise Boom(f"no {item} left")


def _langgraph(guard: Guard, layers: Layers, *, middleware: bool) -> None:
    from _langgraphchild import ScriptedModel, build_graph
    from langchain_core.tools import tool

    from sagaguard.connectors.frameworks.langgraph import ToolGuard

    @tool
    def book(item: str) -> str:
        """Book an item."""
        return _book(item)

    layers.declaration()(book)
    options: Any = {} if layers.adapter is None else {"classify": layers.adapter}
    model = ScriptedModel(tool_calls=[{"name": "book", "args": {"item": "room"}, "id": "call-1"}])
    config = {"configurable": {"thread_id": f"t-{uuid.uuid4().hex[:8]}"}}
    if middleware:
        from langchain.agents import create_agent
        from langgraph.checkpoint.memory import InMemorySaver

        from sagaguard.connectors.frameworks.langchain import GuardMiddleware

        agent = create_agent(
            model, tools=[book], middleware=[GuardMiddleware(guard, **options)], checkpointer=InMemorySaver()
        )
        agent.invoke({"messages": [("user", "book a room")]}, config, durability="sync")
        return
    from langgraph.checkpoint.memory import InMemorySaver

    handler = ToolGuard(guard, **options)
    graph = build_graph(model, [book], wrap=handler.wrap_tool_call, checkpointer=InMemorySaver())
    graph.invoke({"messages": [("user", "book a room")]}, config, durability="sync")


def _agents(guard: Guard, layers: Layers) -> None:
    from _agentschild import ScriptedModel
    from agents import Agent, Runner, function_tool

    from sagaguard.connectors.frameworks.openai_agents import JournaledRun

    def book(order: str) -> str:
        """Book an item."""
        return _book(order)

    layers.declaration()(book)
    agent: Agent[Any] = Agent(
        name="booker", instructions="Book.", model=ScriptedModel(tool="book", order="room"),
        tools=[function_tool(book, failure_error_function=None)],
    )  # fmt: skip
    options: Any = {} if layers.adapter is None else {"classify": layers.adapter}
    per_tool: Any = {} if layers.per_tool is None else {"book": {"classify": layers.per_tool}}
    run = JournaledRun(guard, f"run-{uuid.uuid4().hex[:8]}", tool_options=per_tool, **options)
    asyncio.run(Runner.run(run.wrap(agent), "book a room"))


UNDOS = UndoRegistry()


@UNDOS.register
def cancel(arguments: dict[str, Any], result: Any | None) -> None:
    """The undo the engine's step is declared with (never run here)."""


def _engine(guard: Guard, layers: Layers, tmp_path: Path) -> None:
    from sagaguard.connectors.frameworks._engine_saga import EngineSaga
    from sagaguard.saga.journals.sql import SqlJournal

    runner = AgentRunner(SqlJournal(f"sqlite:///{tmp_path / 'journal.db'}"), guard, sleep=lambda _s: None)
    try:
        engine = EngineSaga(runner, AgentSaga("options", UNDOS), sleep=lambda _s: None)
        engine.call(
            f"run-{uuid.uuid4().hex[:8]}", "book", lambda: _book("room"), {"item": "room"}, call_id="call-1",
            declaration=layers.declaration(undo="cancel"), result_type=str,
        )  # fmt: skip
    finally:
        runner.close()


@dataclass
class Adapter:
    name: str
    run: Callable[[Guard, Layers, Path], None]
    layers: tuple[str, ...]
    """The layers the adapter takes (the rows it has)."""


GUARDED = ("adapter", "declared")

ADAPTERS = [
    Adapter("langgraph-toolnode", lambda g, ly, _p: _langgraph(g, ly, middleware=False), GUARDED),
    Adapter("create_agent", lambda g, ly, _p: _langgraph(g, ly, middleware=True), GUARDED),
    Adapter("agents-sdk", lambda g, ly, _p: _agents(g, ly), (*GUARDED, "per_tool")),
    Adapter("dbos-temporal-step", _engine, ("declared",)),  # an engine step takes no adapter options
]

ROWS = ("adapter", "declared", "per_tool")


@pytest.fixture
def guard(tmp_path: Path) -> Any:
    guard = Guard(SqlStore(f"sqlite:///{tmp_path / 'options.db'}"), namespace="options")
    yield guard
    guard.close()


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.name)
def test_the_highest_layer_that_gives_an_option_wins(
    adapter: Adapter, row: str, guard: Guard, tmp_path: Path
) -> None:
    if row not in adapter.layers:
        pytest.skip(f"{adapter.name} takes no {row} options")
    asked: list[str] = []
    given = ROWS[: ROWS.index(row) + 1]  # the row's layer and every layer under it
    layers = Layers(**{layer: _spy(layer, asked) for layer in given if layer in adapter.layers})
    with pytest.raises(Exception) as raised:
        adapter.run(guard, layers, tmp_path)
    assert caused_by(raised.value, Boom)
    assert asked and set(asked) == {row}


def test_the_rule_layer_by_layer() -> None:
    """The rule itself, with no framework: each layer over the ones under it, ``tool`` always set."""
    kind = call_options(changes_world())
    assert kind["policy"] is Policy.AT_MOST_ONCE and kind["tool"] is True
    adapter = call_options(changes_world(), adapter={"retry": None, "lease": 5.0})
    assert "retry" in adapter and adapter["retry"] is None and adapter["lease"] == 5.0
    read_only_kind = call_options(changes_world(undo="cancel"))
    assert read_only_kind["retry"] is NO_RETRY
    declared = call_options(changes_world(lease=9.0), adapter={"lease": 5.0})
    assert declared["lease"] == 9.0
    per_tool = call_options(changes_world(lease=9.0), adapter={"lease": 5.0}, call={"lease": 1.0})
    assert per_tool["lease"] == 1.0
    policy = call_options(changes_world(policy="at_least_once"), policy="at_most_once")
    assert Policy(policy["policy"]) is Policy.AT_LEAST_ONCE  # the declaration's over the adapter's
