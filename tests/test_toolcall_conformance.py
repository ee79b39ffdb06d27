"""One conformance suite over every agent adapter (issue 30): the same table of expectations, run
against each adapter with its real framework, guarded and in saga mode, sync and async where the
framework has both.

Each harness drives one framework turn in which the model asks for one call of the tool ``book``
(its body is the test's), then re-runs the same unit as its framework does after a crash:

- LangGraph ``ToolNode`` (``ToolGuard``) and ``create_agent`` (``GuardMiddleware``): the model also
  asks for ``crash``, an unguarded tool that fails on the first run, so the tools task fails; the
  re-run is ``graph.invoke(None, config)`` from the checkpoint (the tools task runs every call
  again). In saga mode the run is open around both, paused in between (a process that stopped).
- Agents SDK (``JournaledRun``, ``SagaTurn``): a second ``Runner.run`` under the same run key (a
  fresh run object, as a restarted process builds), whose journaled model asks for the same call.
- MCP (``GuardedSession``, guarded and as a step of the open run; async only, as the SDK's client
  is): the tool is served by a real MCP server; the re-run is a new client under the same run and
  call id (``tests/_mcpconformance.py``).
- CrewAI (``CrewGuard``, and its saga mode ``CrewGuard(saga=CrewSaga(...))``, ``kickoff`` and
  ``akickoff``): the crew dies in ``crash`` after ``book``; the re-run is ``Crew.from_checkpoint``
  and a kickoff (tests/_crewconformance.py). They run in .venv-crewai (CrewAI pins openai<3):
  ``test_the_crewai_rows_in_their_own_venv`` runs this file there and reports each of their rows.

The expectations (the table the report quotes):

==================  ===========================================================================
one_effect          a world-changing call's body runs once across the run and its re-run
execute_tool_span   its effect's span is ``execute_tool {name}`` with ``gen_ai.tool.call.id``
scope_per_attempt   the body runs in the call's scope: an effect inside it needs no ``key=`` and
                    replays on the re-run; the call id is current inside the body
on_doubt            ``ReturnPending`` turns an in-doubt call into the framework's tool result
undo_with_claim     saga mode: the step and its undo are in the journal before the body runs
error_types         saga mode: a step with no open run raises ``NoOpenRun`` (a ``LookupError``)
undo_key_is_scope   saga mode: the step's key (what ``undoing().key`` gives its undo) is the scope
                    the body ran in, so ``provider_key`` finds what the body sent (issue 26, 10)
run_visible         saga mode: the step's body sees its run (``current_run()``), whatever context
                    the adapter runs it in (an MCP session's step or an undo helper inside it
                    asks for it)
failure_is_failed   saga mode: a declared tool's exception ends the turn and its step is never
                    recorded as a success, whatever the framework does with tool errors by
                    default (the Agents SDK's tools keep their default ``failure_error_function``
                    in saga mode; issue 26, item 11)
==================  ===========================================================================

Where an expectation cannot apply to an adapter, its harness lists it in ``skips`` and says why:

==================  ===========================================================================
dbos-temporal-step  scope_per_attempt, on_doubt, no_open_run: only declared tools are the
                    adapter's (a read-only tool is the engine's own step), the engines stop on
                    doubt (their retry policy decides), and the step opens its run itself
mcp-session(-saga)  scope_per_attempt: a read-only MCP tool is ``pass_through``, sent as it is and
                    never a guarded call (no attempt scope, no call id of ours); a step's attempt
                    scope is checked by undo_key_is_scope. failure_is_failed holds with the error
                    type MCP carries: the server's exception is an ``isError`` result, raised as
                    ``ToolFailed`` (its type does not cross the wire)
==================  ===========================================================================

A new adapter joins :data:`HARNESSES` (and passes this file) before it is documented.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from xml.etree import ElementTree

import pytest
from _crewconformance import CREW_HERE, CrewCrash, crew_harnesses
from _guardutil import span_exporter

from sagaguard.connectors.declare import ToolDeclaration, changes_world, is_step, read_only
from sagaguard.connectors.in_doubt import OnDoubt, ReturnPending, Stop
from sagaguard.idempotency import Guard
from sagaguard.idempotency.errors import OutcomeUnknown
from sagaguard.idempotency.records import Disposition
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.idempotency.telemetry import TOOL_CALL_ID
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry, current_run
from sagaguard.saga.journals.sql import SqlJournal
from sagaguard.saga.records import StepState

pytestmark = pytest.mark.timeout(60)

UNDOS = UndoRegistry()


@UNDOS.register
def cancel(arguments: dict[str, Any], result: Any | None) -> None:
    """The undo of ``book`` (the suite never fails a run: it is only registered)."""


SAGA = AgentSaga("conformance", UNDOS)


class Crash(Exception):
    """Stands for the process dying after the tools ran: fails the turn once."""


@dataclass
class Seen:
    """What the tool body saw, per attempt."""

    runs: int = 0
    call_ids: list[str | None] = field(default_factory=list)
    inner: int = 0
    steps: list[list[tuple[str | None, StepState]]] = field(default_factory=list)


@dataclass
class Env:
    """One test's world: a guard and an agent runner on one SQLite file."""

    guard: Guard
    runner: AgentRunner
    run_id: str


class Harness(Protocol):
    """One adapter, one mode, one driver (sync or async)."""

    name: str
    saga: bool

    def turn(
        self, env: Env, body: Callable[[str], str], declaration: ToolDeclaration, on_doubt: OnDoubt, *,
        rerun: bool, open_run: bool = True,
    ) -> list[str]:  # fmt: skip
        """Run the turn (and, with ``rerun``, its re-run); the tool results the framework saw."""


# ------------------------------------------------------------------------------------- LangGraph


def _lg_model(call_id: str) -> Any:
    from _langgraphchild import ScriptedModel

    return ScriptedModel(
        tool_calls=[
            {"name": "book", "args": {"item": "room"}, "id": call_id},
            {"name": "crash", "args": {}, "id": call_id + "-crash"},
        ]
    )


def _lg_tools(body: Callable[[str], str], declaration: ToolDeclaration, crashes: list[int]) -> list[Any]:
    from langchain_core.tools import tool

    booked = threading.Event()

    @tool
    def book(item: str) -> str:
        """Book an item."""
        try:
            return body(item)
        finally:
            booked.set()

    @tool
    def crash() -> str:
        """Fail the first time, once ``book`` has returned (an async ToolNode cancels the calls
        still running when one fails: the crash must not cut ``book`` short)."""
        if crashes:
            booked.wait(timeout=30)
            crashes.pop()
            raise Crash("the process died here")
        return "ok"

    declaration(book)
    return [book, crash]


def _results(messages: list[Any]) -> list[str]:
    from langchain_core.messages import ToolMessage

    return [str(m.content) for m in messages if isinstance(m, ToolMessage) and m.name == "book"]


@dataclass
class LangGraphHarness:
    """``ToolNode(wrap_tool_call=ToolGuard(...))`` on a real graph with a SQLite checkpointer."""

    name: str
    saga: bool
    run_async: bool
    middleware: bool = False

    def turn(
        self, env: Env, body: Callable[[str], str], declaration: ToolDeclaration, on_doubt: OnDoubt, *,
        rerun: bool, open_run: bool = True,
    ) -> list[str]:  # fmt: skip
        from langgraph.checkpoint.memory import InMemorySaver

        crashes = [1] if rerun else []
        tools = _lg_tools(body, declaration, crashes)
        graph = self._graph(env, tools, on_doubt, InMemorySaver())
        config = {"configurable": {"thread_id": env.run_id}}
        first: Any = {"messages": [("user", "book a room")]}
        if not rerun:
            return _results(self._invoke(env, graph, first, config, open_run)["messages"])
        with pytest.raises(Crash):
            self._invoke(env, graph, first, config, open_run, pause=True)
        return _results(self._invoke(env, graph, None, config, open_run)["messages"])

    def _graph(self, env: Env, tools: list[Any], on_doubt: OnDoubt, checkpointer: Any) -> Any:
        from _langgraphchild import build_graph

        from sagaguard.connectors.frameworks.langgraph import ToolGuard

        model = _lg_model(f"call-{uuid.uuid4().hex[:8]}")
        if self.middleware:
            from langchain.agents import create_agent

            from sagaguard.connectors.frameworks.langchain import GuardMiddleware

            middleware = GuardMiddleware(env.guard, saga=self.saga, on_doubt=on_doubt, exclude={"crash"})
            return create_agent(model, tools=tools, middleware=[middleware], checkpointer=checkpointer)
        handler = ToolGuard(env.guard, saga=self.saga, on_doubt=on_doubt, exclude={"crash"})
        wrap, awrap = handler.wrap_tool_call, handler.awrap_tool_call
        return build_graph(model, tools, wrap=wrap, awrap=awrap, checkpointer=checkpointer)

    def _invoke(
        self, env: Env, graph: Any, inputs: Any, config: Any, open_run: bool, *, pause: bool = False
    ) -> Any:
        if not (self.saga and open_run):
            return self._call(graph, inputs, config)
        crashed: list[Crash] = []
        if self.run_async:

            async def go() -> Any:
                async with env.runner.run(SAGA, env.run_id) as run:
                    work = graph.ainvoke(inputs, config, durability="sync")
                    return await _paused_on_crash(run, work, crashed)

            result = asyncio.run(go())
        else:
            with env.runner.run(SAGA, env.run_id) as run:
                try:
                    result = graph.invoke(inputs, config, durability="sync")
                except Crash as exc:
                    run.pause()  # the process stops here, the run parked; a new one opens it again
                    crashed.append(exc)
        if crashed:
            raise crashed[0]
        return result

    def _call(self, graph: Any, inputs: Any, config: Any) -> Any:
        if self.run_async:
            return asyncio.run(graph.ainvoke(inputs, config, durability="sync"))
        return graph.invoke(inputs, config, durability="sync")


async def _paused_on_crash(run: Any, work: Any, crashed: list[Crash]) -> Any:
    """Await ``work`` in an open run; a :class:`Crash` pauses the run (so leaving the block parks
    it, as a stopped process leaves it) and is kept in ``crashed`` for the caller to raise."""
    try:
        return await work
    except Exception as exc:
        if not _caused_by(exc, Crash):
            raise
        run.pause()
        crashed.append(Crash(str(exc)))
        return None


# ------------------------------------------------------------------------------------ Agents SDK


@dataclass
class AgentsHarness:
    """``JournaledRun.wrap(agent)`` (guarded) or ``SagaTurn`` (saga) with the real SDK."""

    name: str
    saga: bool
    run_async: bool = True

    def turn(
        self, env: Env, body: Callable[[str], str], declaration: ToolDeclaration, on_doubt: OnDoubt, *,
        rerun: bool, open_run: bool = True,
    ) -> list[str]:  # fmt: skip
        from agents import Agent, function_tool

        def book(order: str) -> str:  # the scripted model's argument name
            """Book an item."""
            return body(order)

        declaration(book)
        # A failing tool must reach the adapter as it is (failure_error_function=None), except a
        # step: the recipe's declared tool keeps the SDK's default, and a step raises anyway.
        step = self.saga and is_step(declaration)
        tool = function_tool(book) if step else function_tool(book, failure_error_function=None)
        crashes = [1] if rerun else []
        model = _crashing_model(crashes)
        agent: Agent[Any] = Agent(name="booker", instructions="Book.", model=model, tools=[tool])
        outputs = []
        for attempt in range(2 if rerun else 1):
            try:
                outputs.append(asyncio.run(self._once(env, agent, on_doubt, open_run)))
            except Exception as exc:
                if not (rerun and attempt == 0 and _caused_by(exc, Crash)):
                    raise
                crashes.clear()  # the process died once (in the tool or after it): the re-run finishes
        return outputs

    async def _once(self, env: Env, agent: Any, on_doubt: OnDoubt, open_run: bool) -> str:
        from agents import Runner

        if not self.saga:
            from sagaguard.connectors.frameworks.openai_agents import JournaledRun

            run = JournaledRun(env.guard, env.run_id, on_doubt=on_doubt)
            result = await Runner.run(run.wrap(agent), "book a room")
            return _agents_output(result.final_output)
        from sagaguard.connectors.frameworks.openai_agents_saga import SagaTurn

        turn = SagaTurn(env.runner, SAGA, env.run_id, 1, on_doubt=on_doubt)
        if not open_run:
            result = await turn.run(agent, "book a room")
            return _agents_output(result.final_output)
        crashed: list[Crash] = []
        async with turn:
            result = await _paused_on_crash(turn, turn.run(agent, "book a room"), crashed)
        if crashed:
            raise crashed[0]
        return _agents_output(result.final_output)


def _crashing_model(crashes: list[int]) -> Any:
    """The scripted model asking for ``book``, whose answer to the tool's output fails the first
    time (the process dies after the tool ran; a failed model call leaves no record)."""
    from _agentschild import ScriptedModel

    class CrashingModel(ScriptedModel):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            given = kwargs.get("input", args[1] if len(args) > 1 else None)
            if (
                crashes
                and not isinstance(given, str)
                and any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in given or [])
            ):
                crashes.pop()
                raise Crash("the process died after the tool ran")
            return await super().get_response(*args, **kwargs)

    return CrashingModel(tool="book", order="room")


def _agents_output(final: Any) -> str:
    return str(final).removeprefix("done: ")


@dataclass
class EngineHarness:
    """``EngineSaga.call``, the step both the DBOS and the Temporal adapters make of a declared
    tool call (in a DBOS step / a Temporal activity); the engine's retry of the step calls it again
    with the same run id and call id. Only declared tools are ours there: a read-only tool is the
    engine's own step, the engines stop on doubt (their retry policy decides), and the step opens
    its run itself."""

    name: str
    saga: bool = True
    skips: tuple[str, ...] = ("scope_per_attempt", "on_doubt", "no_open_run")

    def turn(
        self, env: Env, body: Callable[[str], str], declaration: ToolDeclaration, on_doubt: OnDoubt, *,
        rerun: bool, open_run: bool = True,
    ) -> list[str]:  # fmt: skip
        from sagaguard.connectors.frameworks._engine_saga import EngineSaga

        engine = EngineSaga(env.runner, SAGA, sleep=lambda _s: None)
        outputs = []
        for _ in range(2 if rerun else 1):
            TOOL_CALL_ID.set(None)
            value = engine.call(
                env.run_id, "book", lambda: body("room"), {"item": "room"}, call_id="call-1",
                declaration=declaration, result_type=str,
            )  # fmt: skip
            outputs.append(value)
        return outputs


HARNESSES: list[Harness] = [
    LangGraphHarness("langgraph-toolnode-sync", saga=False, run_async=False),
    LangGraphHarness("langgraph-toolnode-async", saga=False, run_async=True),
    LangGraphHarness("langgraph-toolnode-saga-sync", saga=True, run_async=False),
    LangGraphHarness("langgraph-toolnode-saga-async", saga=True, run_async=True),
    LangGraphHarness("create_agent-sync", saga=False, run_async=False, middleware=True),
    LangGraphHarness("create_agent-async", saga=False, run_async=True, middleware=True),
    LangGraphHarness("create_agent-saga-sync", saga=True, run_async=False, middleware=True),
    LangGraphHarness("create_agent-saga-async", saga=True, run_async=True, middleware=True),
    AgentsHarness("agents-sdk", saga=False),
    AgentsHarness("agents-sdk-saga", saga=True),
    EngineHarness("dbos-temporal-step"),
]
HARNESSES.extend(crew_harnesses())  # in .venv-crewai only: see test_the_crewai_rows_in_their_own_venv


def _skip(harness: Harness, expectation: str) -> None:
    if expectation in getattr(harness, "skips", ()):
        why = getattr(harness, "why", {}).get(expectation, "not the adapter's (see its harness)")
        pytest.skip(f"{expectation}: {why}")


if not CREW_HERE:
    # The MCP rows run in the main venv: .venv-crewai has the 1.x MCP SDK that CrewAI pins.
    from _mcpconformance import mcp_harnesses

    HARNESSES.extend(mcp_harnesses(SAGA))


@pytest.fixture(params=HARNESSES, ids=lambda h: h.name)
def harness(request: pytest.FixtureRequest) -> Harness:
    found: Harness = request.param
    return found


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    url = f"sqlite:///{tmp_path / 'conformance.db'}"
    guard = Guard(SqlStore(url), namespace="conformance")
    runner = AgentRunner(SqlJournal(url), guard, sleep=lambda _s: None)
    yield Env(guard, runner, f"run-{uuid.uuid4().hex[:8]}")
    runner.close()


def _declared(harness: Harness) -> ToolDeclaration:
    return changes_world(undo="cancel") if harness.saga else changes_world()


def _body(env: Env, seen: Seen, harness: Harness) -> Callable[[str], str]:
    def body(item: str) -> str:
        seen.runs += 1
        seen.call_ids.append(TOOL_CALL_ID.get())
        if harness.saga:
            snapshot = env.runner.journal.load(current_run().run_id)
            rows = [] if snapshot is None else snapshot.steps
            seen.steps.append([(row.compensation, row.state) for row in rows])

        def inner() -> str:
            seen.inner += 1
            return "held"

        env.guard.run("conformance.inner", inner, result_type=str)  # no key=: the call's scope
        return f"booked {item}"

    return body


# ------------------------------------------------------------------------------------ the table


def test_one_effect_per_call_across_a_rerun(harness: Harness, env: Env) -> None:
    seen = Seen()
    results = harness.turn(env, _body(env, seen, harness), _declared(harness), Stop(), rerun=True)
    assert seen.runs == 1
    assert results[-1] == "booked room"


@pytest.fixture(scope="module")
def exporter() -> Any:
    found = span_exporter()
    if found is None:
        pytest.skip("a non-SDK tracer provider is installed")
    return found


def test_the_execute_tool_span_carries_the_call_id(harness: Harness, env: Env, exporter: Any) -> None:
    _skip(harness, "execute_tool_span")
    exporter.clear()
    seen = Seen()
    harness.turn(env, _body(env, seen, harness), _declared(harness), Stop(), rerun=False)
    (call_id,) = seen.call_ids
    assert call_id
    tool_spans = [s for s in exporter.get_finished_spans() if s.name.startswith("execute_tool ")]
    assert [s.attributes.get("gen_ai.tool.call.id") for s in tool_spans] == [call_id]
    assert tool_spans[0].attributes.get("gen_ai.tool.name")


def test_a_scope_per_attempt_and_the_call_id_inside_the_body(harness: Harness, env: Env) -> None:
    _skip(harness, "scope_per_attempt")
    seen = Seen()
    run_body = _body(env, seen, harness)

    def body(item: str) -> str:
        answer = run_body(item)
        if seen.runs == 1:  # the first attempt dies after the effect inside it
            raise Crash("the process died inside the tool")
        return answer

    # read-only: its body runs again on the re-run, as its first attempt did not finish
    results = harness.turn(env, body, read_only, Stop(), rerun=True)
    assert seen.runs == 2
    assert seen.inner == 1  # each attempt in a fresh scope of the call: replayed, never run twice
    assert len(set(seen.call_ids)) == 1 and seen.call_ids[0]
    assert results[-1] == "booked room"


def test_on_doubt_is_honoured(harness: Harness, env: Env) -> None:
    _skip(harness, "on_doubt")

    def body(item: str) -> str:
        raise ConnectionError("the provider hung up: did it book?")  # ambiguous: in doubt

    results = harness.turn(env, body, _declared(harness), ReturnPending(), rerun=False)
    pending = json.loads(results[-1])
    assert pending["status"] == "pending"


def test_stop_raises_outcome_unknown(harness: Harness, env: Env) -> None:
    def body(item: str) -> str:
        raise ConnectionError("the provider hung up: did it book?")

    with pytest.raises(Exception) as raised:
        harness.turn(env, body, _declared(harness), Stop(), rerun=False)
    assert _caused_by(raised.value, OutcomeUnknown)


def test_the_undo_is_registered_with_the_claim(harness: Harness, env: Env) -> None:
    if not harness.saga:
        pytest.skip("guarded mode registers no undo")
    seen = Seen()
    harness.turn(env, _body(env, seen, harness), _declared(harness), Stop(), rerun=False)
    (rows,) = seen.steps
    assert [(undo, state) for undo, state in rows if undo is not None] == [("cancel", StepState.STARTED)]


def test_a_step_with_no_open_run_is_refused_with_one_error_type(harness: Harness, env: Env) -> None:
    if not harness.saga:
        pytest.skip("guarded mode needs no run")
    _skip(harness, "no_open_run")
    from sagaguard.saga.agent import NoOpenRun

    seen = Seen()
    with pytest.raises(Exception) as raised:
        harness.turn(env, _body(env, seen, harness), _declared(harness), Stop(), rerun=False, open_run=False)
    assert _caused_by(raised.value, NoOpenRun)
    assert _caused_by(raised.value, LookupError)
    assert seen.runs == 0


def test_the_undos_key_is_the_scope_the_body_ran_in(harness: Harness, env: Env) -> None:
    if not harness.saga:
        pytest.skip("guarded mode has no undo")
    from sagaguard.idempotency.keys import current_scope
    from sagaguard.saga.agent.call import ToolCall

    scopes: list[str] = []
    run_body = _body(env, Seen(), harness)

    def body(item: str) -> str:
        scopes.append(current_scope().id)
        return run_body(item)

    harness.turn(env, body, _declared(harness), Stop(), rerun=False)
    snapshot = env.runner.journal.load(env.run_id if not isinstance(harness, AgentsHarness) else _turn(env))
    assert snapshot is not None
    keys = [call.key for call in map(ToolCall.of_row, snapshot.steps) if call is not None]
    assert keys == scopes and len(keys) == 1


def test_a_steps_body_sees_its_run(harness: Harness, env: Env) -> None:
    if not harness.saga:
        pytest.skip("guarded mode has no run")
    from sagaguard.saga.agent.call import ToolCall

    runs: list[str] = []
    run_body = _body(env, Seen(), harness)

    def body(item: str) -> str:
        runs.append(current_run().run_id)  # an MCP session's step, an undo helper inside it ask too
        return run_body(item)

    harness.turn(env, body, _declared(harness), Stop(), rerun=False)
    (run_id,) = runs
    snapshot = env.runner.journal.load(run_id)
    assert snapshot is not None
    tools = [c.tool for c in map(ToolCall.of_row, snapshot.steps) if c is not None]
    assert len(tools) == 1 and tools[0].endswith("book")  # MCP names it mcp.{server}.book


class Refused(Exception):
    """The provider refused: sure not to have applied (declared ``permanent``)."""


def test_a_declared_tools_failure_is_a_failed_step(harness: Harness, env: Env) -> None:
    if not harness.saga:
        pytest.skip("guarded mode has no steps")

    def body(item: str) -> str:
        raise Refused(f"no {item} left")

    with pytest.raises(Exception) as raised:
        harness.turn(env, body, changes_world(undo="cancel", permanent=(Refused,)), Stop(), rerun=False)
    assert _caused_by(raised.value, getattr(harness, "tool_failure", Refused))  # MCP: ToolFailed
    snapshot = env.runner.journal.load(env.run_id if not isinstance(harness, AgentsHarness) else _turn(env))
    assert snapshot is not None
    states = [row.state for row in snapshot.steps if row.name.startswith("tool.")]
    assert len(states) == 1 and StepState.SUCCEEDED not in states


def _turn(env: Env) -> str:
    from sagaguard.connectors.frameworks.openai_agents_saga import turn_run_id

    return turn_run_id(env.run_id, 1)


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# ---------------------------------------------------------------------------------------- CrewAI
# CrewAI pins openai<3, this environment has openai>=3 (the Agents SDK): CrewAI's harnesses
# (tests/_crewconformance.py) run in .venv-crewai, where this file runs once more; each of their
# rows is reported here as a row of its own, with the outcome and reason it had there.

CREW_ROWS = ("crewai", "crewai-saga", "crewai-saga-akickoff")


def _expectations() -> list[str]:
    return [
        name
        for name, fn in globals().items()
        if name.startswith("test_") and callable(fn) and {"harness", "crew"} & _parameters(fn)
    ]


def _parameters(fn: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(fn).parameters)


@pytest.mark.parametrize("crew", crew_harnesses(), ids=lambda h: h.name)
def test_crewai_execute_tool_span_has_no_call_id(crew: Harness, env: Env, exporter: Any) -> None:
    """CrewAI's ``execute_tool_span`` row: no tool-call id reaches a CrewAI tool, so the call's one
    ``execute_tool`` span has no ``gen_ai.tool.call.id`` (the adapter's key is never on a span),
    and no call id is current inside the body."""
    exporter.clear()
    seen = Seen()
    crew.turn(env, _body(env, seen, crew), _declared(crew), Stop(), rerun=False)
    assert seen.call_ids == [None]
    tool_spans = [s for s in exporter.get_finished_spans() if s.name.startswith("execute_tool ")]
    assert len(tool_spans) == 1 and tool_spans[0].attributes.get("gen_ai.tool.name")
    assert "gen_ai.tool.call.id" not in (tool_spans[0].attributes or {})


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ == "test_the_crewai_rows_in_their_own_venv":
        rows = [f"{name}[{harness}]" for harness in CREW_ROWS for name in _expectations()]
        metafunc.parametrize("row", rows)


@pytest.fixture(scope="module")
def crew_table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """Each CrewAI row's outcome there (``passed``, ``skipped``, ``failed``) and its message, from
    one pytest run of this file's CrewAI rows in .venv-crewai (a CrewAI import costs seconds)."""
    from conftest import require_service
    from test_crewai import CREW_PYTHON, ROOT, child_env, crewai_problem

    require_service("The CrewAI environment", crewai_problem())
    report = tmp_path_factory.mktemp("crew-table") / "rows.xml"
    command = [
        str(CREW_PYTHON), "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", "-o", "addopts=",
        "-k", "crewai and not in_their_own_venv", f"--junitxml={report}", str(Path(__file__)),
    ]  # fmt: skip
    # CrewAI offline as its other tests run it, but with the OpenTelemetry SDK on: the rows read spans.
    spans_on = {k: v for k, v in child_env().items() if k != "OTEL_SDK_DISABLED"}
    done = subprocess.run(
        command, cwd=ROOT, env=spans_on, capture_output=True, text=True, timeout=900, check=False
    )
    assert report.exists(), f"exit {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    table: dict[str, tuple[str, str]] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                if kind == "skipped":
                    outcome, message = "skipped", found.get("message", "")
                else:
                    outcome, message = "failed", f"{found.get('message')}\n{found.text}"
        table[case.get("name", "")] = (outcome, message)
    return table


@pytest.mark.timeout(900)
def test_the_crewai_rows_in_their_own_venv(row: str, crew_table: dict[str, tuple[str, str]]) -> None:
    assert row in crew_table, f"{row} did not run in .venv-crewai: {sorted(crew_table)}"
    outcome, message = crew_table[row]
    if outcome == "skipped":
        pytest.skip(f"in .venv-crewai: {message.strip()}")
    assert outcome == "passed", message


@pytest.mark.parametrize("crew", crew_harnesses(), ids=lambda h: h.name)
def test_crewai_a_scope_per_attempt(crew: Harness, env: Env) -> None:
    """CrewAI's ``scope_per_attempt`` row: the process dies inside the tool (a ``BaseException``:
    a tool's ``Exception`` is a failure CrewAI ends the kickoff with, and in saga mode its run is
    undone) after an effect inside it; the restored crew runs the body again in the call's scope,
    where that effect replays. No call id is current in the body: none reaches a CrewAI tool."""
    seen = Seen()
    run_body = _body(env, seen, crew)

    def body(item: str) -> str:
        answer = run_body(item)
        if seen.runs == 1:
            raise CrewCrash("the process died inside the tool")
        return answer

    results = crew.turn(env, body, read_only, Stop(), rerun=True)
    assert seen.runs == 2
    assert seen.inner == 1
    assert seen.call_ids == [None, None]
    assert results[-1] == "booked room"


@pytest.mark.parametrize("crew", crew_harnesses(), ids=lambda h: h.name)
def test_crewai_the_highest_layer_that_gives_an_option_wins(crew: Harness, env: Env) -> None:
    """CrewAI's rows of tests/test_toolcall_options.py: ``CrewGuard``'s ``classify=`` (for every
    tool) wins over the defaults of the declaration's kind, and the declaration's own over it."""
    for layer in ("adapter", "declared"):
        asked: list[str] = []

        def spy(name: str, asked: list[str] = asked) -> Any:
            def classify(exc: BaseException) -> Disposition | None:
                asked.append(name)
                return Disposition.PERMANENT if isinstance(exc, Refused) else None

            return classify

        declared = {"classify": spy("declared")} if layer == "declared" else {}
        declaration = changes_world(undo="cancel", **declared) if crew.saga else changes_world(**declared)
        given = dataclasses.replace(crew, options={"classify": spy("adapter")})  # type: ignore[type-var]

        def body(item: str) -> str:
            raise Refused(f"no {item} left")

        with pytest.raises(Exception) as raised:
            given.turn(env, body, declaration, Stop(), rerun=False)
        assert _caused_by(raised.value, Refused)
        assert asked and set(asked) == {layer}
