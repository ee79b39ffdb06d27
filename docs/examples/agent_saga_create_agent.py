"""Agent sagas on LangChain's create_agent: the agent books a hotel and charges the card, then its
flight tool fails; the run's calls are undone, each once. A second run stops at a human's approval
(HumanInTheLoopMiddleware) and is rejected: it is undone too. A scripted chat model stands in for
OpenAI, so this runs offline."""

import asyncio
import os
import uuid
from collections.abc import Sequence
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.langchain import GuardMiddleware
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga import SagaRegistry, SagaState
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal

world: list[str] = []  # stands in for the hotel, the card processor and the airline
undos = UndoRegistry()  # the same undos serve every framework


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    world.append(f"cancel {result['booking'] if result else arguments['hotel']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    world.append(f"refund {arguments['amount']}")


class NoSeats(Exception):
    """The airline refused: nothing was booked."""


@tool
@changes_world(undo="cancel_booking")
def book_hotel(hotel: str) -> dict[str, str]:
    """Book a hotel."""
    world.append(f"book {hotel}")
    return {"booking": f"bk-{hotel}"}


@tool
def charge(amount: int) -> dict[str, Any]:
    """Charge the card."""
    world.append(f"charge {amount}")
    return {"charge": "ch-1", "amount": amount}


@tool
def book_flight(to: str) -> str:
    """Book a flight."""
    raise NoSeats(f"no seats to {to}")


class ScriptedModel(BaseChatModel):
    """Asks for ``plan[n]`` when the thread holds n tool results, else says "done"."""

    plan: dict[int, list[tuple[str, dict[str, Any]]]]

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        calls = self.plan.get(sum(isinstance(m, ToolMessage) for m in messages))
        if calls is None:
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content="done"))])
        asked = [
            {"name": n, "args": a, "id": f"call_{uuid.uuid4().hex[:8]}", "type": "tool_call"}
            for n, a in calls
        ]
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content="", tool_calls=asked))])


trip_agent = AgentSaga("trip_agent", undos)
registry = SagaRegistry(trip_agent)  # what `sagaguard sagas worker` is given

url = os.environ.get("SAGAGUARD_STORE", "sqlite:///agent.db")
journal = open_journal(url)
guard = Guard(open_store(url))
runner = AgentRunner(journal, guard)
# the saga middleware last (innermost); charge is declared by name, at the middleware
saga_middleware = GuardMiddleware(guard, saga=True, declare={"charge": changes_world(undo="refund")})


def agent(plan: dict[int, list[tuple[str, dict[str, Any]]]], *, approval: bool = False) -> Any:
    middleware: list[Any] = [HumanInTheLoopMiddleware(interrupt_on={"book_flight": True})] if approval else []
    return create_agent(
        ScriptedModel(plan=plan), tools=[book_hotel, charge, book_flight],
        middleware=[*middleware, saga_middleware], checkpointer=InMemorySaver(),
    )  # fmt: skip


async def first_run(thread: str) -> None:
    trip = agent(
        {
            0: [("book_hotel", {"hotel": "Ritz"}), ("charge", {"amount": 420})],
            2: [("book_flight", {"to": "Oslo"})],
        }
    )
    async with runner.run(trip_agent, thread):  # the run's saga: keyed on the thread (async: ainvoke)
        await trip.ainvoke({"messages": [HumanMessage("book the Ritz, pay, fly")]},
                           {"configurable": {"thread_id": thread}}, durability="sync")  # fmt: skip


try:
    asyncio.run(first_run("thread-1"))
except NoSeats as exc:
    print("the run failed:", exc)
print(world)
assert sorted(world[:2]) == ["book Ritz", "charge 420"]  # made in parallel: in either order
assert sorted(world[2:]) == ["cancel bk-Ritz", "refund 420"]  # each undone once
snapshot = journal.load("thread-1")
assert snapshot is not None and snapshot.saga.state is SagaState.COMPENSATED

world.clear()
trip = agent({0: [("book_hotel", {"hotel": "Savoy"})], 1: [("book_flight", {"to": "Oslo"})]}, approval=True)
with runner.run(trip_agent, "thread-2") as run:
    config: Any = {"configurable": {"thread_id": "thread-2"}}
    result = trip.invoke({"messages": [HumanMessage("book the Savoy, fly")]}, config, durability="sync")
    assert "__interrupt__" in result  # stopped before the flight, for a human
    run.pause()  # WAITING, no process held
# Later, in any process: the manager says no (HumanInTheLoopMiddleware's own "reject" only tells the model).
outcome = runner.reject(trip_agent, "thread-2", "the manager said no")
print(outcome.state.value, world)
assert outcome.state is SagaState.COMPENSATED and world == ["book Savoy", "cancel bk-Savoy"]
runner.close()
