"""sagaguard.connectors.frameworks.langchain: ``GuardMiddleware`` on real ``create_agent`` agents, SQLite
checkpoints.

In-process, a "crash" is an exception that stops the run after some work was done (a tool that
fails once, or a middleware that raises after the model answered); the run then resumes from its
checkpoint with ``agent.invoke(None, config)``, as after a restart. The SIGKILL versions run a child
(``tests/_langchainchild.py``) that a real SIGKILL stops, and count at a service in another process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _langgraphchild import ScriptedModel
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain.agents.structured_output import ToolStrategy
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from pydantic import BaseModel

from sagaguard.connectors.frameworks.langchain import GuardMiddleware
from sagaguard.connectors.frameworks.langgraph import DurabilityWarning, JournaledChatModel
from sagaguard.idempotency import ConfigurationError, Guard, MemoryStore
from sagaguard.idempotency.testing import CRASH_ENV, CounterService

CHILD = Path(__file__).resolve().parent / "_langchainchild.py"
ROOT = CHILD.parent.parent

pytestmark = pytest.mark.timeout(120)

CALLS = [
    {"name": "pay", "args": {"amount": 1}, "id": "c1"},
    {"name": "pay", "args": {"amount": 2}, "id": "c2"},
]


@pytest.fixture
def guard() -> Iterator[Guard]:
    g = Guard(MemoryStore(), namespace="lc-tests")
    yield g
    g.close()


@pytest.fixture
def saver(tmp_path: Path) -> Iterator[SqliteSaver]:
    conn = sqlite3.connect(tmp_path / "cp.db", check_same_thread=False)
    yield SqliteSaver(conn)
    conn.close()


def config() -> Any:
    return {"configurable": {"thread_id": f"t-{uuid.uuid4().hex[:8]}"}}


class Tools:
    """A ``pay`` tool that counts its body runs."""

    def __init__(self) -> None:
        self.paid: list[int] = []

        @tool
        def pay(amount: int) -> str:
            """Pay."""
            self.paid.append(amount)
            return f"paid {amount}"

        self.tools: list[BaseTool] = [pay]


class DieAfterTool(AgentMiddleware):  # type: ignore[type-arg]
    """Outermost: raises once after the tool call ``call_id`` returned, before its task's checkpoint."""

    def __init__(self, call_id: str) -> None:
        super().__init__()
        self.call_id = call_id
        self.left = 1

    def _die(self, request: Any) -> None:
        if self.left and request.tool_call["id"] == self.call_id:
            self.left -= 1
            raise RuntimeError("died after the tool returned")

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        result = handler(request)
        self._die(request)
        return result

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        result = await handler(request)
        self._die(request)
        return result


class DieAfterModel(AgentMiddleware):  # type: ignore[type-arg]
    """Outermost: raises once after the model answered, before the model node's checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.left = 1

    def _die(self) -> None:
        if self.left:
            self.left -= 1
            raise RuntimeError("died after the model answered")

    def wrap_model_call(self, request: ModelRequest[Any], handler: Any) -> ModelResponse[Any]:
        response: ModelResponse[Any] = handler(request)
        self._die()
        return response

    async def awrap_model_call(
        self, request: ModelRequest[Any], handler: Callable[..., Awaitable[Any]]
    ) -> ModelResponse[Any]:
        response: ModelResponse[Any] = await handler(request)
        self._die()
        return response


def ids(state: Any) -> list[str]:
    return [c["id"] for m in state["messages"] if isinstance(m, AIMessage) for c in m.tool_calls]


def test_replayed_tool_calls_return_the_recorded_message_without_running(
    guard: Guard, saver: SqliteSaver
) -> None:
    tools, model = Tools(), ScriptedModel(tool_calls=CALLS)
    agent = create_agent(model, tools=tools.tools, checkpointer=saver,
                         middleware=[DieAfterTool("c2"), GuardMiddleware(guard)])  # fmt: skip
    cfg = config()
    with pytest.raises(RuntimeError, match="after the tool returned"):
        agent.invoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
    assert sorted(tools.paid) == [1, 2]
    state = agent.invoke(None, cfg, durability="sync")  # the failed tool task (c2) runs again
    assert sorted(tools.paid) == [1, 2]  # its call was answered by the record, not run
    answers = {m.tool_call_id: m.content for m in state["messages"] if isinstance(m, ToolMessage)}
    assert answers == {"c1": "paid 1", "c2": "paid 2"}
    assert state["messages"][-1].content == "done"


def test_without_the_middleware_the_checkpointer_alone_runs_the_tool_again(saver: SqliteSaver) -> None:
    """The contrast for the test above: the same agent without GuardMiddleware."""
    tools, model = Tools(), ScriptedModel(tool_calls=CALLS)
    agent = create_agent(model, tools=tools.tools, checkpointer=saver, middleware=[DieAfterTool("c2")])
    cfg = config()
    with pytest.raises(RuntimeError):
        agent.invoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
    agent.invoke(None, cfg, durability="sync")
    assert sorted(tools.paid) == [1, 2, 2]  # c1's task finished and was kept; c2's ran twice


def test_a_crash_in_the_model_node_replays_the_answer_with_the_same_tool_call_ids(
    guard: Guard, saver: SqliteSaver
) -> None:
    tools = Tools()
    model = ScriptedModel(tool_calls=[{"name": "pay", "args": {"amount": 5}}])  # fresh random ids
    agent = create_agent(model, tools=tools.tools, checkpointer=saver,
                         middleware=[DieAfterModel(), GuardMiddleware(guard)])  # fmt: skip
    cfg = config()
    with pytest.raises(RuntimeError, match="after the model answered"):
        agent.invoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
    assert len(model.calls) == 1
    state = agent.invoke(None, cfg, durability="sync")
    assert len(model.calls) == 2  # the journaled answer was replayed for free; then "done"
    assert tools.paid == [5]
    assert state["messages"][-1].content == "done"


def test_without_the_model_journal_the_model_is_asked_again_with_new_ids(
    guard: Guard, saver: SqliteSaver
) -> None:
    tools = Tools()
    model = ScriptedModel(tool_calls=[{"name": "pay", "args": {"amount": 5}}])
    answers: list[list[str]] = []

    class Spy(AgentMiddleware):  # type: ignore[type-arg]
        def wrap_model_call(self, request: ModelRequest[Any], handler: Any) -> ModelResponse[Any]:
            response: ModelResponse[Any] = handler(request)
            answers.append(ids({"messages": response.result}))
            return response

    middleware = [DieAfterModel(), Spy(), GuardMiddleware(guard, journal_model=False)]
    agent = create_agent(model, tools=tools.tools, checkpointer=saver, middleware=middleware)
    cfg = config()
    with pytest.raises(RuntimeError):
        agent.invoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
    state = agent.invoke(None, cfg, durability="sync")
    assert len(model.calls) == 3  # the lost answer, its re-ask, then "done"
    assert answers[0] != answers[1] and ids(state) == answers[1]


def test_async_agents_replay_tool_and_model_calls(guard: Guard, tmp_path: Path) -> None:
    tools = Tools()
    model = ScriptedModel(tool_calls=CALLS)
    cfg = config()

    async def run() -> tuple[Any, list[int]]:
        async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "acp.db")) as saver:
            middleware = [DieAfterModel(), DieAfterTool("c1"), GuardMiddleware(guard)]
            agent = create_agent(model, tools=tools.tools, checkpointer=saver, middleware=middleware)
            with pytest.raises(RuntimeError, match="after the model answered"):
                await agent.ainvoke({"messages": [HumanMessage("go")]}, cfg, durability="sync")
            with pytest.raises(RuntimeError, match="after the tool returned"):
                await agent.ainvoke(None, cfg, durability="sync")
            paid_before_resume = sorted(tools.paid)
            return await agent.ainvoke(None, cfg, durability="sync"), paid_before_resume

    state, paid_before_resume = asyncio.run(run())
    assert paid_before_resume == [1, 2]
    assert sorted(tools.paid) == [1, 2]  # c1 replayed on the second resume, not paid again
    assert len(model.calls) == 2  # the tool-calling answer (replayed once), then "done"
    assert ids(state) == ["c1", "c2"]
    assert state["messages"][-1].content == "done"


class Invoice(BaseModel):
    total: int


def test_structured_output_is_parsed_again_from_the_replayed_answer(guard: Guard, saver: SqliteSaver) -> None:
    calls = [{"name": "Invoice", "args": {"total": 42}, "id": "s1"}]
    model = ScriptedModel(tool_calls=calls)
    agent = create_agent(model, tools=[], checkpointer=saver, response_format=ToolStrategy(Invoice),
                         middleware=[DieAfterModel(), GuardMiddleware(guard)])  # fmt: skip
    cfg = config()
    with pytest.raises(RuntimeError):
        agent.invoke({"messages": [HumanMessage("bill")]}, cfg, durability="sync")
    state = agent.invoke(None, cfg, durability="sync")
    assert len(model.calls) == 1  # the resumed model node was answered by the journal
    assert state["structured_response"] == Invoice(total=42)


def test_the_journaled_model_keeps_the_profile_that_picks_the_output_strategy(guard: Guard) -> None:
    seen: list[Any] = []

    model = ScriptedModel(profile={"structured_output": True})
    middleware = GuardMiddleware(guard)
    request = ModelRequest(model=model, messages=[HumanMessage("x")])
    middleware.wrap_model_call(request, lambda r: seen.append(r.model) or ModelResponse(result=[]))
    journaled = seen[0]
    assert isinstance(journaled, JournaledChatModel) and journaled.inner is model
    assert journaled.profile == {"structured_output": True}
    # Wrapping twice (two middlewares, or a model journaled by the caller) journals once.
    again = request.override(model=journaled)
    middleware.wrap_model_call(again, lambda r: seen.append(r.model) or ModelResponse(result=[]))
    assert seen[1] is journaled


def test_durability_other_than_sync_warns_and_strict_refuses(guard: Guard) -> None:
    tools = Tools()
    model = ScriptedModel(tool_calls=CALLS[:1])
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    warned = create_agent(model, tools=tools.tools, checkpointer=SqliteSaver(conn),
                          middleware=[GuardMiddleware(guard)])  # fmt: skip
    with pytest.warns(DurabilityWarning, match="durability='async'"):
        warned.invoke({"messages": [HumanMessage("go")]}, config())
    strict = create_agent(model, tools=tools.tools, checkpointer=SqliteSaver(conn),
                          middleware=[GuardMiddleware(guard, strict=True)])  # fmt: skip
    with pytest.raises(ConfigurationError, match="durability='exit'"):
        strict.invoke({"messages": [HumanMessage("go")]}, config(), durability="exit")
    assert tools.paid == [1]  # refused before the model was asked, so before the tool ran
    conn.close()


# -- real SIGKILLs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service() -> Iterator[CounterService]:
    with CounterService() as running:
        yield running


def child(
    folder: Path, service: CounterService, thread: str, mode: str, action: str, *, crash: str | None = None
) -> subprocess.CompletedProcess[str]:
    spec = {"dir": str(folder), "service": service.url, "thread": thread, "mode": mode, "action": action}
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(CHILD.parent)])
    if crash:
        env[CRASH_ENV] = crash
    return subprocess.run(
        [sys.executable, str(CHILD), json.dumps(spec)],
        env=env, capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip


def killed(run: subprocess.CompletedProcess[str], point: str) -> None:
    assert run.returncode == -signal.SIGKILL, f"exit {run.returncode}:\n{run.stdout}\n{run.stderr}"
    assert f"SIGKILL at {point}" in run.stderr


def report(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stdout}\n{run.stderr}"
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(("mode", "charges"), [("sagaguard", 1), ("plain", 2)])
def test_sigkill_inside_the_tool_after_the_charge(
    tmp_path: Path, service: CounterService, mode: str, charges: int
) -> None:
    """Killed after the charge reached the service, before anything recorded it; resumed in a new
    process. With the middleware the resumed tool call is reconciled: one charge. The checkpointer
    alone re-runs the tools task from its first line: two."""
    thread = f"t-{uuid.uuid4().hex[:10]}"
    killed(child(tmp_path, service, thread, mode, "start", crash="after_effect"), "after_effect")
    assert service.count(f"tool:{thread}") == 1
    done = report(child(tmp_path, service, thread, mode, "resume"))
    assert service.count(f"tool:{thread}") == charges
    assert service.count(f"model:{thread}") == 2  # the tool-calling answer (checkpointed), then "done"
    assert done["final"] == "done"
    assert done["answered"] == done["call_ids"]


def test_sigkill_in_the_model_node_replays_the_answer_with_the_same_tool_call_ids(
    tmp_path: Path, service: CounterService
) -> None:
    thread = f"t-{uuid.uuid4().hex[:10]}"
    killed(child(tmp_path, service, thread, "sagaguard", "start", crash="after_model"), "after_model")
    recorded = [c.provider_key for c in service.charges(key=f"model:{thread}")]
    done = report(child(tmp_path, service, thread, "sagaguard", "resume"))
    assert len(recorded) == 1
    assert service.count(f"model:{thread}") == 2  # not paid again; then one call for "done"
    assert service.count(f"tool:{thread}") == 1
    assert done["call_ids"] == recorded[0].split(",")  # the killed process's ids, followed on resume
    assert done["answered"] == done["call_ids"]
