"""A scripted chat model, a small tool-calling graph, and the child side of test_langgraph_crash.py.

:class:`ScriptedModel` is a real ``BaseChatModel``: asked after a human message it answers with
tool calls (fresh random ids, as real providers give), asked after tool results it answers "done".
It counts its calls in-process (``calls``) and, given a counter URL, at the counting service too,
so a SIGKILLed process cannot take the count with it.

Run as ``python tests/_langgraphchild.py '<json>'`` with ``$SAGAGUARD_CRASH_AT`` naming where to
die: ``after_model`` (in the model node, after the model answered) or ``after_effect`` (in the tool,
after the charge reached the service, before any record). The JSON holds ``dir`` (checkpoints and
the effect store live there, SQLite both), ``service``, ``thread``, ``mode`` (``sagaguard``: the
ToolGuard, the journaled model and a guarded charge with a reconciler; ``plain``: the checkpointer
alone) and ``action`` (``start`` or ``resume``: ``graph.invoke(None, config)``). Prints one JSON line:
the tool call ids the model's message carried and the ToolMessages answered.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool, tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic import Field

from sagaguard.idempotency import Guard
from sagaguard.idempotency.effect import current_effect
from sagaguard.idempotency.testing import Charge, CounterClient, crash_point

NAMESPACE = "langgraph-crash"
AMOUNT = 1000


class ScriptedModel(BaseChatModel):
    """Answers a human message with ``tool_calls`` (one per entry), and tool results with "done"."""

    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    """``{"name": ..., "args": ...}`` (and optionally a fixed ``"id"``) per call to make."""
    counter_url: str | None = None
    count_key: str = "model"
    calls: list[int] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, AIMessage]:
        return self  # type: ignore[return-value]

    def _answer(self, messages: list[BaseMessage]) -> AIMessage:
        self.calls.append(1)
        usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}
        calls = [
            {"name": c["name"], "args": c["args"], "id": c.get("id") or f"call_{uuid.uuid4().hex[:12]}"}
            for c in self.tool_calls
        ]
        done = isinstance(messages[-1], ToolMessage)
        if self.counter_url is not None:  # the service keeps the ids it answered with
            ids = "done" if done else ",".join(c["id"] for c in calls)
            CounterClient(self.counter_url).charge(self.count_key, 1, provider_key=ids)
        if done:
            return AIMessage(content="done", usage_metadata=usage)  # type: ignore[arg-type]
        return AIMessage(content="", tool_calls=calls, usage_metadata=usage)  # type: ignore[arg-type]

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:  # fmt: skip
        return ChatResult(generations=[ChatGeneration(message=self._answer(messages))])


def build_graph(
    model: Runnable[Any, Any],
    tools: Sequence[BaseTool],
    *,
    wrap: Callable[..., Any] | None = None,
    awrap: Callable[..., Any] | None = None,
    checkpointer: Any = None,
    agent: Callable[..., Any] | None = None,
) -> Any:
    """START -> agent -> (tools -> agent)* -> END, the ReAct loop, with a ToolNode."""

    def call_model(state: MessagesState) -> dict[str, Any]:
        answer = model.invoke(state["messages"])
        crash_point("after_model")  # the answer is in hand (and journaled), not yet checkpointed
        return {"messages": [answer]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent or call_model)
    graph.add_node("tools", ToolNode(list(tools), wrap_tool_call=wrap, awrap_tool_call=awrap))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


def main(config: dict[str, Any]) -> int:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from sagaguard.connectors.frameworks.langgraph import JournaledChatModel, ToolGuard
    from sagaguard.idempotency.stores.sql import SqlStore

    folder = Path(config["dir"])
    client = CounterClient(config["service"])
    thread = config["thread"]
    guarded = config["mode"] == "sagaguard"
    store = SqlStore(f"sqlite:///{folder / 'effects.db'}")
    guard = Guard(store, namespace=NAMESPACE, lease=config.get("lease", 0.5), wait=20.0)

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

    scripted = ScriptedModel(
        tool_calls=[{"name": "pay", "args": {"amount": AMOUNT}}],
        counter_url=config["service"],
        count_key=f"model:{thread}",
    )
    model: Runnable[Any, Any] = JournaledChatModel(inner=scripted, guard=guard) if guarded else scripted
    # The default: pay is read-only at the tool level (undeclared); its charge is a guarded effect
    # of its own (replayed or reconciled), so a crash inside pay re-runs it.
    tool_guard = ToolGuard(guard)
    conn = sqlite3.connect(folder / "checkpoints.db", check_same_thread=False)
    graph = build_graph(
        model, [pay], wrap=tool_guard.wrap_tool_call if guarded else None, checkpointer=SqliteSaver(conn)
    )
    run_config = {"configurable": {"thread_id": thread}}
    inputs = {"messages": [HumanMessage("pay the invoice")]} if config["action"] == "start" else None
    try:
        state = graph.invoke(inputs, run_config, durability="sync")
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
