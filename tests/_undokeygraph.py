"""A LangGraph agent in an agent saga, in the world of ``tests/_undokey.py``: run as a real process by
``tests/test_agent_saga_lost_answers.py``. A scripted model books a hotel, then charges the card
(killed there, ``$AGENT_KILL=in_charge``), under ``ToolGuard(guard, saga=True)`` with the recipe's
declarations. ``python tests/_undokeygraph.py`` runs the thread ``thread-1``.
"""

from __future__ import annotations

import os
from typing import Any

import _undokey as world
from _agentsagagraph import ScriptedModel
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.langgraph import ToolGuard
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga.agent import AgentRunner
from sagaguard.saga.journals import open_journal

GUARD: list[Guard] = []


@tool
@changes_world(undo="cancel_booking", policy="at_least_once")
def book_hotel(hotel: str) -> dict[str, Any]:
    """Book a hotel."""
    return world.book_hotel(hotel)


@tool
@changes_world(undo="refund_lost", policy="at_least_once")
def charge(amount: int) -> dict[str, Any]:
    """Charge the card."""
    return world.charge(GUARD[0], amount)


def main() -> None:
    db = os.environ["SAGAGUARD_STORE"]
    guard = Guard(open_store(db))
    GUARD[:] = [guard]
    script = [
        [{"name": "book_hotel", "args": {"hotel": "ritz"}}],
        [{"name": "charge", "args": {"amount": 606}}],
    ]
    model = ScriptedModel(script=script)
    tools = ToolGuard(guard, saga=True)
    node = ToolNode([book_hotel, charge], wrap_tool_call=tools.wrap_tool_call, handle_tool_errors=False)
    builder = StateGraph(MessagesState)
    builder.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", node)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    graph = builder.compile()
    runner = AgentRunner(open_journal(db), guard, sleep=lambda _s: None)
    try:
        with runner.run(world.trip, "thread-1"):
            graph.invoke(
                {"messages": [HumanMessage("book my trip")]}, {"configurable": {"thread_id": "thread-1"}}
            )
    finally:
        runner.close()


if __name__ == "__main__":
    main()
