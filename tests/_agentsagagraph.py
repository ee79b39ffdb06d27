"""A LangGraph trip agent in an agent saga, run as a real process for the crash tests (and imported
by the worker, which finds its undos here).

A scripted model (fixed tool call ids, as a journaled model replays them) books a hotel and charges
a card in one ``ToolNode`` turn, then calls a flight tool that fails. The graph checkpoints to SQLite
in ``$AGENT_DIR``; the effects, the journal and the tools' API (``$AGENT_API``, a local
``sagaguard.connectors.testing`` server that counts what it applied) are shared with the worker. Kill points
(``$SAGAGUARD_CRASH_AT``, through :func:`sagaguard.idempotency.testing.crash_point`): ``in_model`` (the model
node of the second turn: the booking and the charge are done and checkpointed) and ``in_refund``
(right after the API applied the refund, in whichever process undoes the charge).

``python tests/_agentsagagraph.py`` starts the run, or resumes it from its checkpoint.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic import Field

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.langgraph_saga import SagaTools
from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.testing import crash_point
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal

API = os.environ.get("AGENT_API", "http://127.0.0.1:9")
FOLDER = Path(os.environ.get("AGENT_DIR", "."))
DB = f"sqlite:///{FOLDER / 'agent.db'}"
THREAD = "thread-1"
BOOK_AND_PAY = [
    {"name": "book_hotel", "args": {"hotel": "ritz"}},
    {"name": "charge", "args": {"amount": 420}},
]
FLY = [{"name": "book_flight", "args": {"to": "Oslo"}}]


class ScriptedModel(BaseChatModel):
    """Turn *i* (the *i*-th answer in the thread) makes the tool calls ``script[i]``, with ids fixed
    by turn and position; past the script it says "done"."""

    script: list[list[dict[str, Any]]] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, AIMessage]:
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        turn = sum(isinstance(m, AIMessage) for m in messages)
        if turn == 1:
            crash_point("in_model")
        if turn >= len(self.script):
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content="done"))])
        calls = [
            {**c, "id": f"call-{turn}-{i}", "type": "tool_call"} for i, c in enumerate(self.script[turn])
        ]
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content="", tool_calls=calls))])


def post(api: str, path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    """POST to the counting API with an ``Idempotency-Key`` (what makes the undos idempotent)."""
    reply = httpx.post(f"{api}{path}", json=body, headers={"Idempotency-Key": f'"{key}"'}, timeout=10)
    reply.raise_for_status()
    return dict(reply.json())


undos = UndoRegistry()


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    post(API, "/cancellations", {"hotel": arguments["hotel"]}, f"cancel-{arguments['hotel']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    post(API, "/refunds", {"amount": arguments["amount"]}, f"refund-{arguments['amount']}")
    crash_point("in_refund")


trip_agent = AgentSaga("trip_agent", undos)
registry = SagaRegistry(trip_agent)  # the worker's guard comes from $SAGAGUARD_STORE


@tool
@changes_world(undo="cancel_booking")  # declared next to the tool
def book_hotel(hotel: str) -> dict[str, Any]:
    """Book a hotel."""
    return post(API, "/bookings", {"hotel": hotel}, f"book-{hotel}")


@tool
def charge(amount: int) -> dict[str, Any]:
    """Charge the card."""
    return post(API, "/charges", {"amount": amount}, f"charge-{amount}")


@tool
def book_flight(to: str) -> str:
    """Book a flight."""
    raise RuntimeError(f"no seats to {to}")


def build(model: BaseChatModel, checkpointer: Any) -> Any:
    """The agent graph: model -> tools (the trip tools, in the open agent run) -> model."""
    saga_tools = SagaTools({"charge": changes_world(undo="refund")})  # or by name, at the adapter
    node = ToolNode(
        [book_hotel, charge, book_flight], wrap_tool_call=saga_tools.wrap_tool_call, handle_tool_errors=False
    )
    builder = StateGraph(MessagesState)
    builder.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", node)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile(checkpointer=checkpointer)


def main() -> int:
    from langgraph.checkpoint.sqlite import SqliteSaver

    conn = sqlite3.connect(FOLDER / "checkpoints.db", check_same_thread=False)
    graph = build(ScriptedModel(script=[BOOK_AND_PAY, FLY]), SqliteSaver(conn))
    config: Any = {"configurable": {"thread_id": THREAD}}
    runner = AgentRunner(open_journal(DB), Guard(open_store(DB)), sleep=lambda _s: None)  # the defaults
    state = "completed"
    try:
        with runner.run(trip_agent, THREAD) as run:
            started = bool(graph.get_state(config).next)
            inputs = None if started else {"messages": [HumanMessage("book my trip")]}
            graph.invoke(inputs, config, durability="sync")
    except RuntimeError as exc:
        state = f"failed: {exc}; {run.outcome.state.value if run.outcome else '?'}"
    finally:
        runner.close()
    print(json.dumps({"state": state}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
