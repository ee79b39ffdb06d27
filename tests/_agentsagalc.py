"""A LangChain ``create_agent`` trip agent in an agent saga (the world and the undos of
``tests/_agenttrip.py``, the same functions the Agents SDK agent uses): imported by
``tests/test_agent_saga_langchain.py`` and run as a real process for its crash test; the worker runs
``--app _agenttrip:registry``.

A scripted chat model (:class:`TripChatModel`, tool call ids fresh and random, so "the same ids
after a crash" is the journal's doing) asks for the hotel and the charge in one answer (two
parallel tool calls), then for the flight.
:class:`~sagaguard.connectors.frameworks.langchain_saga.SagaMiddleware` journals it and makes the declared
tools' calls steps of the run; with ``approval`` LangChain's ``HumanInTheLoopMiddleware`` stops the agent
before the flight.

``python tests/_agentsagalc.py`` runs the agent (``thread_id`` ``trip-1``, checkpointed to SQLite in
``$AGENT_DIR``), or resumes it from its checkpoint, and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _agenttrip as trip
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, HumanInTheLoopMiddleware
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import tool

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.langchain_saga import SagaMiddleware
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga.agent import AgentRunner
from sagaguard.saga.journals import open_journal


class TripChatModel(BaseChatModel):
    """Answers by how many tool results the thread holds: :data:`_agenttrip.PLAN`'s calls, under
    fresh random ids, or "done"."""

    @property
    def _llm_type(self) -> str:
        return "scripted-trip"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, AIMessage]:
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        done = sum(isinstance(m, ToolMessage) for m in messages)
        if done:
            trip.kill_once("in_model")
        calls = trip.PLAN.get(done)
        if calls is None:
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content="done"))])
        tool_calls = [
            {"name": name, "args": args, "id": f"call_{uuid.uuid4().hex[:12]}", "type": "tool_call"}
            for name, args in calls
        ]
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content="", tool_calls=tool_calls))])


@tool
@changes_world(undo="cancel_booking")  # declared next to the tool
def book_hotel(hotel: str) -> dict[str, Any]:
    """Book a hotel."""
    return trip.book_hotel(hotel)


@tool
def charge(amount: int, order: str) -> dict[str, Any]:
    """Charge the card."""
    return trip.charge(amount, order)


@tool
@changes_world(undo="cancel_flight", permanent=(trip.NoSeats,))  # "no seats" is sure not to have booked
def book_flight(to: str) -> dict[str, Any]:
    """Book a flight."""
    return trip.book_flight(to)


def build(guard: Guard, checkpointer: Any) -> Any:
    """The agent; with ``flight="approval"`` a human approves the flight first."""
    middleware: list[AgentMiddleware[Any, Any, Any]] = []
    if trip.CONFIG["flight"] == "approval":
        middleware.append(HumanInTheLoopMiddleware(interrupt_on={"book_flight": True}))
    # innermost, so the journal sees what the model and the tools really do
    middleware.append(SagaMiddleware(guard, declare={"charge": changes_world(undo="refund")}))
    tools = [book_hotel, charge, book_flight]
    return create_agent(TripChatModel(), tools=tools, middleware=middleware, checkpointer=checkpointer)


THREAD: Any = {"configurable": {"thread_id": trip.RUN}}


def main() -> int:
    from langgraph.checkpoint.sqlite import SqliteSaver

    folder = Path(trip.CONFIG["dir"])
    url = os.environ["SAGAGUARD_STORE"]
    guard = Guard(open_store(url))  # the defaults: a dead holder is taken over at once
    runner = AgentRunner(open_journal(url), guard, sleep=lambda _s: None)
    conn = sqlite3.connect(folder / "checkpoints.db", check_same_thread=False)
    agent = build(guard, SqliteSaver(conn))
    report: dict[str, Any] = {}
    run = runner.run(trip.trip_agent, trip.RUN)
    try:
        with run:
            inputs = None if agent.get_state(THREAD).next else {"messages": [HumanMessage(trip.TEXT)]}
            result = agent.invoke(inputs, THREAD, durability="sync")
            if "__interrupt__" in result:
                run.pause()
            report["output"] = result["messages"][-1].content
    except Exception as exc:  # the run failed: it was undone (or left, as its saga says)
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        runner.close()
    report["state"] = None if run.outcome is None else run.outcome.state.value
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
