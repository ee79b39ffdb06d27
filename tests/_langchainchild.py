"""A real ``create_agent`` agent, and the child side of the SIGKILL tests in test_langchain_middleware.py.

Run as ``python tests/_langchainchild.py '<json>'`` with ``$SAGAGUARD_CRASH_AT`` naming where to die:
``after_model`` (in the model node, after the model answered and the journal recorded it, before the
checkpoint) or ``after_effect`` (in the tool, after the charge reached the service, before any record).
The JSON holds ``dir`` (the SQLite checkpoints and effect store live there), ``service``, ``thread``,
``mode`` (``sagaguard``: :class:`GuardMiddleware` and a guarded charge with a reconciler; ``plain``:
the checkpointer alone) and ``action`` (``start``, or ``resume``: ``agent.invoke(None, config)``).
Prints one JSON line: the tool call ids the model's message carried and the ToolMessages answered.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

from _langgraphchild import ScriptedModel
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver

from sagaguard.connectors.frameworks.langchain import GuardMiddleware
from sagaguard.idempotency import Guard
from sagaguard.idempotency.effect import current_effect
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.idempotency.testing import Charge, CounterClient, crash_point

NAMESPACE = "langchain-crash"
AMOUNT = 1000


class CrashAfterModel(AgentMiddleware):  # type: ignore[type-arg]
    """Outermost: dies once the model call (journaled or not) has returned, before the checkpoint."""

    def wrap_model_call(self, request: ModelRequest[Any], handler: Any) -> ModelResponse[Any]:
        response: ModelResponse[Any] = handler(request)
        crash_point("after_model")
        return response


def main(config: dict[str, Any]) -> int:
    folder = Path(config["dir"])
    client = CounterClient(config["service"])
    thread = config["thread"]
    guarded = config["mode"] == "sagaguard"
    store = SqlStore(f"sqlite:///{folder / 'effects.db'}")
    guard = Guard(store, namespace=NAMESPACE, lease=0.5, wait=20.0)

    @guard.effect("charge", reconciler=client.reconciler())
    def charge(amount: int) -> Charge:
        result = client.charge(f"tool:{thread}", amount, provider_key=current_effect().provider_key)
        crash_point("after_effect")
        return result

    @tool
    def pay(amount: int) -> str:
        """Charge the customer."""
        if guarded:
            return charge(amount).charge_id
        result = client.charge(f"tool:{thread}", amount)
        crash_point("after_effect")
        return result.charge_id

    model = ScriptedModel(
        tool_calls=[{"name": "pay", "args": {"amount": AMOUNT}}],
        counter_url=config["service"],
        count_key=f"model:{thread}",
    )
    # The default: pay is read-only at the tool level (undeclared); the charge inside it is a
    # guarded effect (replayed or reconciled), so a crash inside pay re-runs it.
    middleware: list[Any] = [CrashAfterModel()]
    if guarded:
        middleware.append(GuardMiddleware(guard))
    conn = sqlite3.connect(folder / "checkpoints.db", check_same_thread=False)
    agent = create_agent(model, tools=[pay], middleware=middleware, checkpointer=SqliteSaver(conn))
    run_config: Any = {"configurable": {"thread_id": thread}}
    inputs = {"messages": [HumanMessage("pay the invoice")]} if config["action"] == "start" else None
    try:
        state = agent.invoke(inputs, run_config, durability="sync")
    finally:
        guard.close()
        store.close()
        conn.close()
    messages = state["messages"]
    report = {
        "call_ids": [c["id"] for m in messages if isinstance(m, AIMessage) for c in m.tool_calls],
        "answered": [m.tool_call_id for m in messages if isinstance(m, ToolMessage)],
        "final": messages[-1].content,
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
