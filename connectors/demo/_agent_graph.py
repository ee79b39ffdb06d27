"""The agent demo's LangGraph agent, run as a real process (its undos are in
:mod:`sagaguard.connectors.demo._agent_undos`, which the saga worker imports).

``python -m sagaguard.connectors.demo._agent_graph`` runs the trip agent of ``$SAGAGUARD_AGENT_DEMO`` (a JSON
config: the services' addresses, the SQLite files, ``side``), or resumes it from its checkpoint,
and prints JSON events on stdout. The graph is model -> tools -> model; the model (the local model
server, scripted) plans: book the hotel, charge the card, email the confirmation, book the flight,
and the flight is sold out. Two sides of one graph:

- ``sagaguard``: the tools run in an agent saga
  (:class:`~sagaguard.connectors.frameworks.langgraph.ToolGuard` in saga mode, each declared with its
  undo), the model
  is journaled, the email goes through the transactional outbox (``send_later``). When the flight fails the
  run undoes its calls in reverse: the email is corrected (``correction_undo``), the charge refunded, the
  booking cancelled.
- ``checkpointer``: the same graph on the same checkpointer, without sagaguard: the plain model,
  the plain tools, the email sent at once. When the flight fails, the error ends the run.

Kill points (``$SAGAGUARD_CRASH_AT``): ``agent_after_email`` (the model node after the email tool:
booked, charged, emailed and checkpointed) and ``agent_after_refund`` (right after Stripe refunded
the charge, in whichever process undoes it).
"""

from __future__ import annotations

import json
import smtplib
import sqlite3
import sys
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import httpx
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.demo._agent_undos import (
    demo_config,
    outbox_mail,
    payments,
    post,
    the_trip,
    trip_agent,
)
from sagaguard.connectors.demo.agent import THREAD
from sagaguard.connectors.email import Email
from sagaguard.connectors.frameworks.langgraph import JournaledChatModel, ToolGuard, graph_scope
from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.testing import crash_point
from sagaguard.saga.agent import AgentRunner

__all__ = ["DECLARE", "TOOLS", "build", "main"]


# ------------------------------------------------------------------------------ the tools


@tool
def book_hotel(hotel: str, nights: int) -> dict[str, Any]:
    """Book the hotel."""
    return post("/bookings", {"hotel": hotel, "nights": nights}, f"{THREAD}-book-{hotel}")


@tool
def charge_card(amount: int) -> dict[str, Any]:
    """Charge the traveller's card (Stripe)."""
    params: Any = {
        "amount": amount, "currency": "eur", "payment_method": "pm_card_visa", "confirm": True,
        "metadata": {"run": THREAD},
    }  # fmt: skip
    intent = payments().v1.payment_intents.create(
        params=params, options={"idempotency_key": f"{THREAD}-charge"}
    )
    return {"id": intent.id, "amount": intent.amount}


def _confirmation() -> Email:
    trip = the_trip()
    return Email(
        to=[trip.email],
        subject=f"Confirmed: your trip to {trip.destination}",
        text=f"Hotel {trip.hotel} for {trip.nights} nights, {trip.amount / 100:.2f} EUR charged.",
    )


@tool
def email_confirmation(to: str) -> str:
    """Email the traveller the confirmation."""
    if demo_config()["side"] == "sagaguard":
        _, _, engine, _, mail = outbox_mail()
        with graph_scope():  # the task's scope: a rerun of the tool finds the message it enqueued
            return str(mail.send_later(engine, _confirmation()))  # the relay sends it
    mail_ = _confirmation()
    message = EmailMessage()
    message["From"], message["To"], message["Subject"] = "trips@agent.example", to, mail_.subject
    message.set_content(mail_.text)
    with smtplib.SMTP(demo_config()["smtp_host"], int(demo_config()["smtp_port"]), timeout=10) as smtp:
        smtp.send_message(message)
    return "sent"


@tool
def book_flight(to: str) -> dict[str, Any]:
    """Book the flight."""
    try:
        return post("/flights", {"to": to}, f"{THREAD}-fly-{to}")
    except httpx.HTTPStatusError as exc:
        raise RuntimeError(f"the flight to {to} is sold out ({exc.response.status_code})") from None


TOOLS: list[BaseTool] = [book_hotel, charge_card, email_confirmation, book_flight]
DECLARE = {
    "book_hotel": changes_world(undo="cancel_booking"),
    "charge_card": changes_world(undo="refund"),
    "email_confirmation": changes_world(undo="correct_email"),
}
"""Each tool that changes the world, with its undo (``book_flight`` fails before it books anything)."""


def build(model: Any, checkpointer: Any, *, saga: bool) -> Any:
    """The agent graph: model -> tools -> model, the tools in the agent saga when ``saga``."""
    # book_flight (declared nowhere) runs as it is: it fails before it books anything
    steps = ToolGuard(None, saga=True, declare=DECLARE, exclude={"book_flight"})
    wrap = steps.wrap_tool_call if saga else None
    node = ToolNode(TOOLS, wrap_tool_call=wrap, handle_tool_errors=False)

    def think(state: MessagesState) -> dict[str, Any]:
        if sum(isinstance(m, ToolMessage) for m in state["messages"]) == 3:
            crash_point("agent_after_email")  # booked, charged, emailed: all checkpointed
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("model", think)
    builder.add_node("tools", node)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile(checkpointer=checkpointer)


def _request() -> str:
    """The user's message to the agent."""
    t = the_trip()
    return (
        f"Book {t.nights} nights at {t.hotel} and a flight to {t.destination} for {t.traveller}, "
        f"pay {t.amount / 100:.2f} EUR, and email {t.email} the confirmation."
    )


def _emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def main() -> int:
    """Run (or resume from its checkpoint) the trip agent; returns 0 however the run ended."""
    config = demo_config()
    saga = config["side"] == "sagaguard"
    chat = ChatOpenAI(model="local", api_key="sk-local", base_url=config["chat_url"], max_retries=0)  # type: ignore[arg-type]
    conn = sqlite3.connect(Path(config["dir"]) / f"checkpoints-{config['side']}.db", check_same_thread=False)
    guard = Guard(open_store(config["store"])) if saga else None
    model: Any = chat.bind_tools(TOOLS)
    if guard is not None:
        model = JournaledChatModel(inner=model, guard=guard)
    graph = build(model, SqliteSaver(conn), saga=saga)
    graph_config: Any = {"configurable": {"thread_id": THREAD}}
    started = bool(graph.get_state(graph_config).next)
    inputs = None if started else {"messages": [HumanMessage(_request())]}
    try:
        if guard is None:
            graph.invoke(inputs, graph_config, durability="sync")
        else:
            runner = AgentRunner(_journal(config), guard, lease=config["lease"])
            try:
                with runner.run(trip_agent, THREAD):
                    graph.invoke(inputs, graph_config, durability="sync")
            finally:
                runner.close()
        _emit("completed", resumed=started)
    except RuntimeError as exc:
        _emit("failed", error=str(exc), resumed=started)
    finally:
        conn.close()
    return 0


def _journal(config: dict[str, Any]) -> Any:
    from sagaguard.saga.journals import open_journal

    return open_journal(config["store"])


if __name__ == "__main__":
    sys.exit(main())
