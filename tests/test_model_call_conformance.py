"""One conformance row for model calls (issue 30), run against every adapter that journals them in
this environment: :func:`~sagaguard.connectors.llm.journal_model` and
:class:`~sagaguard.connectors.llm.ChatJournal` (sync and async), LangGraph's
:class:`~sagaguard.connectors.frameworks.langgraph.JournaledChatModel` in a real graph and
``create_agent``'s :class:`~sagaguard.connectors.frameworks.langchain.GuardMiddleware` (sync and
async), and the Agents SDK's :class:`~sagaguard.connectors.frameworks.openai_agents.JournaledRun`.
CrewAI's journaled model runs only in its own virtualenv, so its row is
tests/test_crewai.py::test_a_restored_crew_replays_tools_and_model_calls_without_running_them and
``test_akickoff_replays_tools_and_model_calls_too`` (a real crew restored from its checkpoint).

Each harness runs one unit that asks the model once and then dies after the answer (recorded, not
yet acted on), and re-runs it the way its framework does after a crash (the graph from its
checkpoint, the Agents SDK run under the same run key, the scope again). The model answers with a
fresh id each time it is asked, so "the same answer" is an assertion.

==================  ===========================================================================
replayed            the re-run gets the recorded answer (the same id); the model was asked once
one_effect          one effect per call: executed once, replayed once, nothing else
span                its span is ``sagaguard.effect {name}`` (a model call is not an
                    ``execute_tool``), with the outcome
failed_call         a call that raised is not in doubt and not retried inside its claim: the
                    next ask under the same key asks the model again (the framework adapters:
                    LangGraph's and ``create_agent``'s model as the others, docs/upgrading.md)
==================  ===========================================================================
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import openai
import pytest
from _guardutil import caused_by, span_exporter
from agents.tool_context import ToolContext

from sagaguard.idempotency import Guard, scope
from sagaguard.idempotency.errors import OutcomeUnknown
from sagaguard.idempotency.stores.sql import SqlStore

pytestmark = pytest.mark.timeout(60)


class Crash(Exception):
    """Stands for the process dying after the model answered."""


class Harness(Protocol):
    """One adapter, one driver."""

    name: str
    effect: str

    def turn(self, guard: Guard, run_id: str, *, crash: bool) -> str:
        """Run the unit once (raising :class:`Crash` after the answer when ``crash``); the answer's id."""

    def asked(self) -> int:
        """How many times the model was asked."""


def _rerun(harness: Harness, guard: Guard, run_id: str) -> list[str]:
    answers: list[str] = []
    try:
        harness.turn(guard, run_id, crash=True)
    except Exception as exc:
        if not caused_by(exc, Crash):
            raise
    answers.append(getattr(harness, "first", ""))
    answers.append(harness.turn(guard, run_id, crash=False))
    return answers


# ------------------------------------------------------------------------------- journal_model


@dataclass
class JournalModelHarness:
    name: str
    run_async: bool
    effect: str = "conformance.plan"
    first: str = ""
    count: int = 0

    def turn(self, guard: Guard, run_id: str, *, crash: bool) -> str:
        from sagaguard.connectors.llm import journal_model

        def answer() -> dict[str, str]:
            self.count += 1
            return {"id": uuid.uuid4().hex}

        if self.run_async:

            @journal_model(guard, self.effect)
            async def aplan(prompt: str) -> dict[str, str]:
                return answer()

            async def go() -> dict[str, str]:
                with scope(run_id):
                    return await aplan("book a room")

            got = asyncio.run(go())
        else:

            @journal_model(guard, self.effect)
            def plan(prompt: str) -> dict[str, str]:
                return answer()

            with scope(run_id):
                got = plan("book a room")
        return _seen(self, got["id"], crash)

    def asked(self) -> int:
        return self.count


def _seen(harness: Any, answer: str, crash: bool) -> str:
    if crash:
        harness.first = answer
        raise Crash("the process died after the answer")
    return answer


# --------------------------------------------------------------------------------- ChatJournal


@dataclass
class ChatJournalHarness:
    name: str
    run_async: bool
    effect: str = "llm.chat"
    first: str = ""
    server: Any = None

    def turn(self, guard: Guard, run_id: str, *, crash: bool) -> str:
        from sagaguard.connectors.llm import AsyncChatJournal, ChatJournal

        ask: Any = {
            "model": "m",
            "messages": [{"role": "user", "content": "refund order 42"}],
            "tools": TOOLS,
        }
        if self.run_async:

            async def go() -> Any:
                client = openai.AsyncOpenAI(api_key="sk-local", base_url=self.server.base_url)
                with scope(run_id):
                    return await AsyncChatJournal(guard, client).create(**ask)

            reply = asyncio.run(go())
        else:
            client = openai.OpenAI(api_key="sk-local", base_url=self.server.base_url)
            with scope(run_id):
                reply = ChatJournal(guard, client).create(**ask)
        return _seen(self, str(reply.choices[0].message.tool_calls[0].id), crash)

    def asked(self) -> int:
        return int(self.server.counters()["completions"])


TOOLS: Any = [
    {"type": "function", "function": {"name": "refund", "parameters": {"type": "object", "properties": {}}}}
]


# ---------------------------------------------------------------------------- LangGraph, create_agent


def _unique_model() -> Any:
    """A chat model answering a fresh id each time it is asked."""
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration, ChatResult

    class Unique(BaseChatModel):
        calls: int = 0

        @property
        def _llm_type(self) -> str:
            return "unique"

        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            self.calls += 1
            usage: Any = {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}
            message = AIMessage(content=uuid.uuid4().hex, usage_metadata=usage)
            return ChatResult(generations=[ChatGeneration(message=message)])

    return Unique()


@dataclass
class LangGraphHarness:
    """A one-node graph whose node asks a ``JournaledChatModel`` and dies after the answer; the
    re-run is ``graph.invoke(None, config)`` from the checkpoint (LangGraph re-runs the node)."""

    name: str
    run_async: bool
    middleware: bool = False
    effect: str = "langgraph.model"
    first: str = ""
    model: Any = None
    graph: Any = None
    crashes: list[int] | None = None

    def __post_init__(self) -> None:
        if self.middleware:
            self.effect = "langchain.model"

    def turn(self, guard: Guard, run_id: str, *, crash: bool) -> str:
        config: Any = {"configurable": {"thread_id": run_id}}
        if crash:
            self.crashes = [1]
            self.model = _unique_model()
            self.graph = self._build(guard)
            inputs: Any = {"messages": [("user", "book a room")]}
        else:
            inputs = None
        if self.run_async:
            state = asyncio.run(self.graph.ainvoke(inputs, config, durability="sync"))
        else:
            state = self.graph.invoke(inputs, config, durability="sync")
        return str(state["messages"][-1].content)

    def _crash(self, answer: Any) -> None:
        if self.crashes:
            self.crashes.pop()
            self.first = str(answer.content)
            raise Crash("the process died after the answer")

    def _build(self, guard: Guard) -> Any:
        from langgraph.checkpoint.memory import InMemorySaver

        if self.middleware:
            return self._agent(guard, InMemorySaver())
        from langgraph.graph import END, START, MessagesState, StateGraph

        from sagaguard.connectors.frameworks.langgraph import JournaledChatModel

        model = JournaledChatModel(inner=self.model, guard=guard)

        def node(state: MessagesState) -> dict[str, Any]:
            answer = model.invoke(state["messages"])
            self._crash(answer)
            return {"messages": [answer]}

        async def anode(state: MessagesState) -> dict[str, Any]:
            answer = await model.ainvoke(state["messages"])
            self._crash(answer)
            return {"messages": [answer]}

        graph = StateGraph(MessagesState)
        graph.add_node("agent", anode if self.run_async else node)
        graph.add_edge(START, "agent")
        graph.add_edge("agent", END)
        return graph.compile(checkpointer=InMemorySaver())

    def _agent(self, guard: Guard, checkpointer: Any) -> Any:
        from langchain.agents import create_agent
        from langchain.agents.middleware import AgentMiddleware

        from sagaguard.connectors.frameworks.langchain import GuardMiddleware

        harness = self

        class DiesAfterTheAnswer(AgentMiddleware):  # type: ignore[type-arg]
            """Outside the journal: the answer is recorded when it reaches this middleware."""

            def wrap_model_call(self, request: Any, handler: Any) -> Any:
                response = handler(request)
                harness._crash(response.result[-1])
                return response

            async def awrap_model_call(self, request: Any, handler: Any) -> Any:
                response = await handler(request)
                harness._crash(response.result[-1])
                return response

        middleware = [DiesAfterTheAnswer(), GuardMiddleware(guard)]
        return create_agent(self.model, tools=[], middleware=middleware, checkpointer=checkpointer)

    def asked(self) -> int:
        return int(self.model.calls)


# ------------------------------------------------------------------------------------ Agents SDK


@dataclass
class AgentsHarness:
    """``JournaledRun.wrap(agent)``: the model asks for a tool that dies the first time (the run
    stops on the tool's output), the re-run is a new ``JournaledRun`` under the same run key."""

    name: str
    effect: str = "agents.model"
    first: str = ""
    model: Any = None

    def turn(self, guard: Guard, run_id: str, *, crash: bool) -> str:
        from _agentschild import ScriptedModel
        from agents import Agent, Runner, function_tool

        from sagaguard.connectors.frameworks.openai_agents import JournaledRun

        if crash:
            self.model = ScriptedModel(tool="book", order="room")
        seen: list[str] = []

        def book(ctx: ToolContext[Any], order: str) -> str:
            """Book an item."""
            seen.append(ctx.tool_call_id)
            if crash:
                self.first = seen[-1]
                raise Crash("the process died after the answer")
            return seen[-1]

        tool = function_tool(book, failure_error_function=None)
        agent: Agent[Any] = Agent(
            name="booker", instructions="Book.", model=self.model, tools=[tool],
            tool_use_behavior="stop_on_first_tool",
        )  # fmt: skip
        run = JournaledRun(guard, run_id, tools=[])  # the tool is not ours: it runs each time
        result = asyncio.run(Runner.run(run.wrap(agent), "book a room"))
        return str(result.final_output)

    def asked(self) -> int:
        return len(self.model.call_ids)


HARNESSES: list[Harness] = [
    JournalModelHarness("journal_model-sync", run_async=False),
    JournalModelHarness("journal_model-async", run_async=True),
    ChatJournalHarness("chat-journal-sync", run_async=False),
    ChatJournalHarness("chat-journal-async", run_async=True),
    LangGraphHarness("langgraph-model-sync", run_async=False),
    LangGraphHarness("langgraph-model-async", run_async=True),
    LangGraphHarness("create_agent-sync", run_async=False, middleware=True),
    LangGraphHarness("create_agent-async", run_async=True, middleware=True),
    AgentsHarness("agents-sdk"),
]


@pytest.fixture(scope="module")
def chat_server() -> Iterator[Any]:
    from sagaguard.connectors.testing import LocalChatModel

    with LocalChatModel() as running:
        yield running


@pytest.fixture(params=HARNESSES, ids=lambda h: h.name)
def harness(request: pytest.FixtureRequest, chat_server: Any) -> Harness:
    found: Any = request.param
    if isinstance(found, ChatJournalHarness):
        chat_server.reset()
        found.server = chat_server
    found.first = ""
    return found  # type: ignore[no-any-return]


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[Guard]:
    guard = Guard(SqlStore(f"sqlite:///{tmp_path / 'models.db'}"), namespace="model-conformance")
    yield guard
    guard.close()


@pytest.fixture(scope="module")
def exporter() -> Any:
    found = span_exporter()
    if found is None:
        pytest.skip("a non-SDK tracer provider is installed")
    return found


def test_the_answer_is_replayed_on_a_rerun_one_effect_per_call_and_its_span(
    harness: Harness, guard: Guard, exporter: Any
) -> None:
    exporter.clear()
    first, again = _rerun(harness, guard, f"run-{uuid.uuid4().hex[:8]}")
    # replayed
    assert first and again == first
    assert harness.asked() == 1
    # one effect per call, and its span
    spans = [
        s
        for s in exporter.get_finished_spans()
        if s.attributes.get("sagaguard.effect.name") == harness.effect
    ]
    assert [s.attributes.get("sagaguard.effect.outcome") for s in spans] == ["executed", "replayed"]
    assert {s.name for s in spans} == {f"sagaguard.effect {harness.effect}"}
    assert not any(s.attributes.get("gen_ai.operation.name") == "execute_tool" for s in spans)



# ------------------------------------------------------------------------- a failed model call


class _Flaky:
    """A model that fails once, as a provider that hung up (ambiguous to the guard's own
    classification), then answers a fresh id; counts how often it was asked."""

    def __init__(self) -> None:
        self.asked = 0

    def answer(self) -> str:
        self.asked += 1
        if self.asked == 1:
            raise ConnectionError("the provider hung up")
        return uuid.uuid4().hex


def _chat_model(flaky: _Flaky, guard: Guard) -> Any:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration, ChatResult

    from sagaguard.connectors.frameworks.langgraph import JournaledChatModel

    class FailsOnce(BaseChatModel):
        @property
        def _llm_type(self) -> str:
            return "fails-once"

        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content=flaky.answer()))])

    return JournaledChatModel(inner=FailsOnce(), guard=guard)


def _ask_langgraph(run_async: bool) -> Callable[[_Flaky, Guard], str]:
    def ask(flaky: _Flaky, guard: Guard) -> str:
        model = _chat_model(flaky, guard)
        if run_async:
            return str(asyncio.run(model.ainvoke("book a room")).content)
        return str(model.invoke("book a room").content)

    return ask


def _ask_journaled_call(flaky: _Flaky, guard: Guard) -> str:
    """What the Agents SDK's ``JournaledModel`` and CrewAI's journaled ``BaseLLM.call`` pass: no
    options of their own (CrewAI runs in its own venv: the call is the same function)."""
    from sagaguard.connectors.model_call import journaled_call

    return journaled_call(guard, "agents.model", flaky.answer, result_type=str)


FAILED_CALL_ROWS: dict[str, Callable[[_Flaky, Guard], str]] = {
    "langgraph-model-sync": _ask_langgraph(False),
    "langgraph-model-async": _ask_langgraph(True),  # and create_agent's: its model is this class
    "journaled_call (agents-sdk, crewai)": _ask_journaled_call,
}
"""The framework adapters' model calls; ``journal_model`` and ``ChatJournal`` are left out on
purpose: they retry a provider's timeouts, 5xx and rate limits inside the claim (their options win
over MODEL_OPTIONS, docs/connectors.md)."""


@pytest.mark.parametrize("ask", FAILED_CALL_ROWS.values(), ids=FAILED_CALL_ROWS.keys())
def test_a_failed_model_call_is_asked_again_with_no_doubt(
    ask: Callable[[_Flaky, Guard], str], guard: Guard
) -> None:
    flaky, run_id = _Flaky(), f"run-{uuid.uuid4().hex[:8]}"
    with scope(run_id), pytest.raises(ConnectionError) as raised:
        ask(flaky, guard)
    assert not caused_by(raised.value, OutcomeUnknown)  # the failure as it is: nothing in doubt
    assert flaky.asked == 1  # not retried inside the claim: the framework decides about retries
    with scope(run_id):  # the same key: its claim was dropped, so the model is asked again
        answer = ask(flaky, guard)
    assert answer and flaky.asked == 2
