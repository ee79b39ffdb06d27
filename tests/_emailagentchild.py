"""The child of ``tests/test_connector_email_agent.py``: a LangGraph agent whose tool emails a
receipt through the transactional outbox (``EmailEffects.send_later``).

Run as ``python tests/_emailagentchild.py '<json>'`` (keys: ``dir``, where the SQLite effect store,
outbox and checkpoints live; ``smtp``, ``[host, port]``; ``thread``; ``action``, ``start`` or
``resume``) with ``$SAGAGUARD_CRASH_AT=after_commit`` to be SIGKILLed in the tool right after the
message committed. The relay is not run here: the test runs it. Prints one JSON line: the final
answer and the tool's answers.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from _langgraphchild import ScriptedModel, build_graph
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver

from sagaguard.connectors.email import Email, EmailEffects, SmtpSettings
from sagaguard.connectors.frameworks.langgraph import JournaledChatModel, ToolGuard
from sagaguard.idempotency import Guard
from sagaguard.idempotency.outbox import Outbox
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.idempotency.testing import crash_point

NAMESPACE = "email-agent"


def mailer(folder: Path, smtp: list[Any]) -> tuple[Guard, SqlStore, sa.Engine, Outbox, EmailEffects]:
    """The guard, store, outbox engine, outbox and email connector both sides share."""
    store = SqlStore(f"sqlite:///{folder / 'effects.db'}")
    guard = Guard(store, namespace=NAMESPACE, lease=0.5, wait=20.0)
    engine = sa.create_engine(f"sqlite:///{folder / 'outbox.db'}")
    outbox = Outbox()
    outbox.create_tables(engine)
    mail = EmailEffects(guard, SmtpSettings(smtp[0], int(smtp[1])), outbox=outbox, sender="shop@shop.example")
    return guard, store, engine, outbox, mail


def main(config: dict[str, Any]) -> int:
    folder = Path(config["dir"])
    guard, store, engine, _, mail = mailer(folder, config["smtp"])

    @tool
    def send_receipt(order: str) -> str:
        """Email the customer the receipt of an order."""
        receipt = Email(to=["ada@example.com"], subject=f"Receipt for {order}", text="Thank you.")
        message_id = mail.send_later(engine, receipt)  # committed here; the relay sends it
        crash_point("after_commit")
        return f"receipt queued ({message_id})"

    scripted = ScriptedModel(tool_calls=[{"name": "send_receipt", "args": {"order": "o-1"}}])
    model = JournaledChatModel(inner=scripted, guard=guard)
    tools = ToolGuard(guard)
    conn = sqlite3.connect(folder / "checkpoints.db", check_same_thread=False)
    graph = build_graph(model, [send_receipt], wrap=tools.wrap_tool_call, checkpointer=SqliteSaver(conn))
    inputs = {"messages": [HumanMessage("send the receipt")]} if config["action"] == "start" else None
    try:
        state = graph.invoke(inputs, {"configurable": {"thread_id": config["thread"]}}, durability="sync")
    finally:
        guard.close()
        store.close()
        engine.dispose()
        conn.close()
    messages = state["messages"]
    answers = [m.content for m in messages if isinstance(m, ToolMessage)]
    print(json.dumps({"final": messages[-1].content, "answers": answers}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
