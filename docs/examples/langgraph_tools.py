"""LangGraph: a tool call that crashed after its charge is resumed from the checkpoint, and the
charge is not made again; the journaled model answer keeps its tool call ids."""

import os

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from sagaguard.connectors.frameworks.langgraph import JournaledChatModel, ToolGuard
from sagaguard.idempotency import Guard, open_store

store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///langgraph.db"))
guard = Guard(store)
charges: list[str] = []
crash = [True]


@guard.effect("payments.charge")
def charge(order: str, amount: int) -> str:
    charges.append(order)  # stands for the provider's API
    return f"ch_{order}"


@tool
def pay(order: str, amount: int) -> str:
    """Charge an order."""
    receipt = charge(order, amount)  # keyed on thread_id + checkpoint_ns + tool_call_id
    if crash:
        crash.pop()
        raise RuntimeError("the worker died after the charge")
    return receipt


answers = iter(
    [
        AIMessage("", tool_calls=[{"name": "pay", "args": {"order": "o-1", "amount": 500}, "id": "call_1"}]),
        AIMessage("paid"),
    ]
)
model = JournaledChatModel(inner=GenericFakeChatModel(messages=answers), guard=guard)
# Tools are read-only unless declared with @changes_world: pay's world-changing call is a
# guard.effect of its own, so a crash inside pay re-runs it and the charge replays.
tools = ToolGuard(guard)


def agent(state: MessagesState) -> dict[str, list[object]]:
    return {"messages": [model.invoke(state["messages"])]}


builder = StateGraph(MessagesState)
builder.add_node("agent", agent)
builder.add_node("tools", ToolNode([pay], wrap_tool_call=tools.wrap_tool_call))
builder.add_edge(START, "agent")
builder.add_conditional_edges("agent", tools_condition)
builder.add_edge("tools", "agent")
graph = builder.compile(checkpointer=InMemorySaver())

config = {"configurable": {"thread_id": "order-o-1"}}
try:
    graph.invoke({"messages": [HumanMessage("Pay order o-1")]}, config, durability="sync")
except RuntimeError:
    print("crashed inside the tool, after the charge")
state = graph.invoke(None, config, durability="sync")  # resume from the checkpoint
assert charges == ["o-1"], charges
print(f"final answer: {state['messages'][-1].content}; charges made: {len(charges)}")

guard.close()
store.close()
