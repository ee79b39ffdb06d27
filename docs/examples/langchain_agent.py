"""LangChain create_agent: the worker dies in the model step, after the model answered; the resumed
agent replays the journaled answer (same tool call ids, not paid again) and charges once."""

import os
import sqlite3
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver

from sagaguard.connectors.frameworks.langchain import GuardMiddleware
from sagaguard.idempotency import Guard, open_store

store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///langchain.db"))
guard = Guard(store)
charges: list[str] = []


@guard.effect("payments.charge")
def charge(order: str, amount: int) -> str:
    charges.append(order)  # stands for the provider's API
    return f"ch_{order}"


@tool
def pay(order: str, amount: int) -> str:
    """Charge an order."""
    return charge(order, amount)


class Model(GenericFakeChatModel):
    """A scripted model that counts what it is asked (what a provider bills)."""

    asked: int = 0

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> "Model":
        return self

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        self.asked += 1
        return super()._generate(*args, **kwargs)


class DieOnce(AgentMiddleware):
    """Stands for a crash between the model's answer and the checkpoint of the model step."""

    died = False

    def wrap_model_call(self, request: ModelRequest, handler: Any) -> ModelResponse:
        response = handler(request)
        if not self.died:
            self.died = True
            raise RuntimeError("the worker died after the model answered")
        return response


call = {"name": "pay", "args": {"order": "o-1", "amount": 500}, "id": "call_1"}
model = Model(messages=iter([AIMessage("", tool_calls=[call]), AIMessage("paid")]))
checkpoints = sqlite3.connect(Path(tempfile.mkdtemp()) / "checkpoints.db", check_same_thread=False)
agent = create_agent(
    model,
    tools=[pay],
    middleware=[DieOnce(), GuardMiddleware(guard)],  # GuardMiddleware last: innermost
    checkpointer=SqliteSaver(checkpoints),
)

config: Any = {"configurable": {"thread_id": "order-o-1"}}
try:
    agent.invoke({"messages": [HumanMessage("Pay order o-1")]}, config, durability="sync")
except RuntimeError as exc:
    print(f"crashed: {exc}")
state = agent.invoke(None, config, durability="sync")  # resume from the checkpoint
assert charges == ["o-1"], charges
assert model.asked == 2, model.asked  # the tool-calling answer once (replayed on resume), then "paid"
answer = state["messages"][-1].content
print(f"final answer: {answer}; charges made: {len(charges)}; model calls: {model.asked}")

checkpoints.close()
guard.close()
store.close()
