"""A shop agent whose tools are the payments MCP server's, through the guarded session, in an agent
saga: run as a real process by the MCP crash tests (and imported by the worker, which finds the
charge's undo, an MCP ``refund`` call, and the server's session factory here).

A scripted model (fixed tool call ids by turn, as a journaled model replays them) charges the card,
then sends the receipt, then (``AGENT_FAIL=1``) calls a flight tool that fails: the run is then
compensated, the charge refunded through MCP. ``python tests/_mcpagentchild.py langgraph`` runs it
as a LangGraph agent (``ToolNode`` with ``ToolGuard``, async), ``... agents`` as an OpenAI Agents SDK
agent (``sagaguard.connectors.frameworks.openai_agents.AgentRun``); either starts the run or resumes it.

Environment: the payments server's (``MCP_*``, see ``_mcpserver.py``), ``AGENT_DIR`` (the ledger,
the journal and the checkpoints), ``AGENT_KILL``: ``before_charge``, ``after_charge``, ``after_refund``
(see :class:`Killing`), once per folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from _mcpkit import server_params

from sagaguard.connectors.mcp import GuardedSession, McpServers, McpUndos, UndoTool, stdio_session
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal

FOLDER = Path(os.environ.get("AGENT_DIR", "."))
DB = f"sqlite:///{FOLDER / 'agent.db'}"
RUN = "shop-run-1"
SCRIPT: list[dict[str, Any]] = [
    {"name": "charge", "args": {"amount": 420, "customer": "pm_card_visa"}},
    {"name": "send_email", "args": {"to": "ana@example.com", "subject": "your receipt"}},
    {"name": "book_flight", "args": {"to": "Oslo"}},
]


class Killing:
    """A session that SIGKILLs this process where ``$AGENT_KILL`` says: ``before_{tool}`` (the call
    is claimed, and registered with its undo, but never sent) or ``after_{tool}`` (the server did
    the work and answered; this process never records it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def list_tools(self) -> Any:
        return await self.inner.list_tools()

    async def call_tool(
        self, name: str, arguments: Any = None, timeout: Any = None, *, meta: Any = None
    ) -> Any:
        _kill(f"before_{name}")
        result = await self.inner.call_tool(name, arguments, timeout, meta=meta)
        _kill(f"after_{name}")
        return result


def _kill(point: str) -> None:
    mark = FOLDER / f"agent-{point}"
    if os.environ.get("AGENT_KILL") == point and not mark.exists():
        mark.write_text("killed")
        os.kill(os.getpid(), signal.SIGKILL)


@asynccontextmanager
async def payments() -> AsyncIterator[Any]:
    """A session to the payments server (a new server process), killing as ``$AGENT_KILL`` says."""
    async with stdio_session(server_params(dict(os.environ))) as session:
        yield Killing(session)


servers = McpServers()
servers.register("payments", payments)
undos = UndoRegistry()
DECLARE = {
    "charge": McpUndos(undos, servers).undo(
        "payments", "charge",
        UndoTool("refund", arguments={"payment_intent": "result.structuredContent.id",
                                      "charge_key": "idempotency_key"}),
    ),
}  # fmt: skip
shop_agent = AgentSaga("shop_agent", undos)
registry = SagaRegistry(shop_agent)  # the worker's guard comes from $SAGAGUARD_STORE


def script() -> list[dict[str, Any]]:
    return SCRIPT if os.environ.get("AGENT_FAIL") == "1" else SCRIPT[:2]


def fail_flight(to: str) -> str:
    raise RuntimeError(f"no seats to {to}")


async def langgraph(guarded: GuardedSession, guard: Guard) -> None:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
    from langchain_core.outputs import ChatGeneration, ChatResult
    from langchain_core.runnables import Runnable
    from langchain_core.tools import StructuredTool
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from sagaguard.connectors.frameworks.langgraph import ToolGuard
    from sagaguard.connectors.mcp.tools import langchain_tools

    class Scripted(BaseChatModel):
        @property
        def _llm_type(self) -> str:
            return "scripted"

        def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, AIMessage]:
            return self

        def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                      **kwargs: Any) -> ChatResult:  # fmt: skip
            turn = sum(isinstance(m, AIMessage) for m in messages)
            steps = script()
            if turn >= len(steps):
                return ChatResult(generations=[ChatGeneration(message=AIMessage(content="done"))])
            call = {**steps[turn], "id": f"call-{turn}", "type": "tool_call"}
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content="", tool_calls=[call]))])

    flight = StructuredTool.from_function(fail_flight, name="book_flight", description="Book a flight.")
    tool_guard = ToolGuard(guard)
    node = ToolNode(
        [*await langchain_tools(guarded), flight], awrap_tool_call=tool_guard.awrap_tool_call,
        wrap_tool_call=tool_guard.wrap_tool_call, handle_tool_errors=False,
    )  # fmt: skip
    model = Scripted()

    async def think(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("model", think)
    builder.add_node("tools", node)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    config: Any = {"configurable": {"thread_id": RUN}}
    async with AsyncSqliteSaver.from_conn_string(str(FOLDER / "graph.db")) as saver:
        graph = builder.compile(checkpointer=saver)
        started = bool((await graph.aget_state(config)).next)
        inputs = None if started else {"messages": [HumanMessage("pay for my trip")]}
        await graph.ainvoke(inputs, config, durability="sync")


async def agents(guarded: GuardedSession, guard: Guard) -> None:
    from agents import Agent, Runner, function_tool, set_tracing_disabled
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from agents.usage import Usage
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

    from sagaguard.connectors.frameworks.openai_agents import AgentRun
    from sagaguard.connectors.mcp.tools import agents_tools

    set_tracing_disabled(True)

    class Scripted(Model):
        async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
            items = [] if isinstance(input, str) else list(input)
            turn = sum(1 for i in items if isinstance(i, dict) and i.get("type") == "function_call_output")
            usage = Usage(requests=1, input_tokens=1, output_tokens=1, total_tokens=2)
            steps = script()
            if turn >= len(steps):
                text = ResponseOutputText(annotations=[], text="done", type="output_text")
                message = ResponseOutputMessage(id="msg_done", content=[text], role="assistant",
                                                status="completed", type="message")  # fmt: skip
                return ModelResponse(output=[message], usage=usage, response_id=None)
            step = steps[turn]
            call = ResponseFunctionToolCall(
                arguments=json.dumps(step["args"]), call_id=f"call-{turn}", name=step["name"],
                type="function_call", id=f"fc_{turn}", status="completed",
            )  # fmt: skip
            return ModelResponse(output=[call], usage=usage, response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    flight = function_tool(fail_flight, name_override="book_flight", failure_error_function=None)
    agent = Agent(name="shop", model=Scripted(), tools=[*await agents_tools(guarded), flight])
    await Runner.run(AgentRun(guard, RUN).wrap(agent), "pay for my trip")


async def main(framework: str) -> str:
    guard = Guard(open_store(DB))  # the defaults: a dead holder is taken over at once
    runner = AgentRunner(open_journal(DB), guard, sleep=lambda _s: None)
    run: Any = None
    try:
        async with payments() as session, runner.run(shop_agent, RUN) as run:
            guarded = GuardedSession(session, guard, server="payments", declare=DECLARE)
            await (langgraph if framework == "langgraph" else agents)(guarded, guard)
        return "completed"
    except Exception as exc:
        ended = run.outcome.state.value if run is not None and run.outcome else "?"
        return f"failed: {type(exc).__name__}; {ended}"
    finally:
        runner.close()


if __name__ == "__main__":
    print(json.dumps({"state": asyncio.run(main(sys.argv[1]))}))
