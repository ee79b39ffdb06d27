"""The LangGraph agent-saga recipe with the declarations exactly as docs/agent_sagas.md writes them,
run as a real process for tests/test_agent_saga_declared.py.

A scripted model (fixed tool call ids, as a journaled model replays them) books a hotel, then
charges a card, then says "done": the trip succeeds. The tools are declared the
shortest way the page shows (``@changes_world(undo="cancel_booking")`` next to the tool,
``declare={"charge": changes_world(undo="refund")}`` at the adapter, no ``policy=``); their bodies
and undos are the booking world's (``tests/_declaredworld.py``: guarded requests at a local API
that counts what it applied). The graph checkpoints to SQLite in ``$AGENT_DIR``, where the effects
and the journal live too.

Kill points (``$SAGAGUARD_CRASH_AT``, :func:`sagaguard.idempotency.testing.crash_point`):
``in_booking`` (the world's: the API applied the booking, its record is not written) and
``booked`` (the booking is recorded, the tool has not returned: the tool's claim is in progress).

``python tests/_agentsagadeclared.py`` starts the run, or resumes it from its checkpoint, and prints
the outcome as JSON.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Sequence
from typing import Any

from _declaredworld import DB, FOLDER, book, guard, pay, undos
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.langgraph import ToolGuard
from sagaguard.idempotency.testing import crash_point
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentRunner, AgentSaga
from sagaguard.saga.journals import open_journal

THREAD = "thread-1"
SCRIPT = [  # one call per answer, so a kill in the booking lands before the charge
    [{"name": "book_hotel", "args": {"hotel": "ritz"}, "id": "call-0", "type": "tool_call"}],
    [{"name": "charge", "args": {"amount": 420}, "id": "call-1", "type": "tool_call"}],
]


class ScriptedModel(BaseChatModel):
    """Answer *i* makes the tool calls ``SCRIPT[i]``; past the script it says "done"."""

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
        if turn >= len(SCRIPT):
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content="done"))])
        answer = AIMessage(content="", tool_calls=SCRIPT[turn])
        return ChatResult(generations=[ChatGeneration(message=answer)])


trip_agent = AgentSaga("trip_agent", undos)
registry = SagaRegistry(trip_agent)


@tool
@changes_world(undo="cancel_booking")
def book_hotel(hotel: str) -> dict[str, Any]:
    """Book a hotel."""
    booking = book(hotel)
    crash_point("booked")  # recorded; the tool has not returned
    return dict(booking)


@tool
def charge(amount: int) -> dict[str, Any]:
    """Charge the card."""
    return pay(amount)


def build(checkpointer: Any) -> Any:
    """model -> tools (the trip tools, steps of the open agent run) -> model."""
    tools = ToolGuard(guard, saga=True, declare={"charge": changes_world(undo="refund")})
    node = ToolNode([book_hotel, charge], wrap_tool_call=tools.wrap_tool_call, handle_tool_errors=False)
    model = ScriptedModel()
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
    graph = build(SqliteSaver(conn))
    config: Any = {"configurable": {"thread_id": THREAD}}
    runner = AgentRunner(open_journal(DB), guard, sleep=lambda _s: None)  # the defaults
    try:
        with runner.run(trip_agent, THREAD) as run:
            started = bool(graph.get_state(config).next)
            inputs = None if started else {"messages": [HumanMessage("book my trip")]}
            answer = graph.invoke(inputs, config, durability="sync")["messages"][-1].content
    finally:
        runner.close()
    outcome = run.outcome.state.value if run.outcome else "?"
    print(json.dumps({"state": outcome, "answer": answer}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
