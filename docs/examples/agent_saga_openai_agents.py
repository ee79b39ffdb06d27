"""Agent sagas on the OpenAI Agents SDK: a turn books a hotel and charges the card, then its flight
tool fails; the turn's calls are undone, each once. The next turn stops at a human's approval and
is rejected: it is undone too. A scripted model stands in for OpenAI, so this runs offline."""

import asyncio
import os
import uuid
from typing import Any

from agents import Agent, function_tool, set_tracing_disabled
from agents.exceptions import UserError
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.openai_agents_saga import SagaTurn
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga import SagaRegistry, SagaState
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal

set_tracing_disabled(True)
world: list[str] = []  # stands in for the hotel, the card processor and the airline
undos = UndoRegistry()  # the same undos serve every framework


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    world.append(f"cancel {result['booking'] if result else arguments['hotel']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    world.append(f"refund {arguments['amount']}")


@undos.register
def cancel_flight(arguments: dict[str, Any], result: Any | None) -> None:
    world.append(f"cancel flight to {arguments['to']}")


class NoSeats(Exception):
    """The airline refused: nothing was booked."""


@function_tool  # a declared tool's failure ends the turn, which undoes it
@changes_world(undo="cancel_booking")
def book_hotel(hotel: str) -> dict[str, str]:
    """Book a hotel."""
    world.append(f"book {hotel}")
    return {"booking": f"bk-{hotel}"}


@function_tool
@changes_world(undo="refund")
def charge(amount: int) -> dict[str, Any]:
    """Charge the card."""
    world.append(f"charge {amount}")
    return {"charge": "ch-1", "amount": amount}


@function_tool
@changes_world(undo="cancel_flight", permanent=(NoSeats,))  # NoSeats: surely not booked
def book_flight(to: str) -> str:
    """Book a flight."""
    raise NoSeats(f"no seats to {to}")


@function_tool(needs_approval=True)  # a human approves the contract first
@changes_world(pivot=True)  # once signed, the trip only goes forward
def sign_contract(party: str) -> str:
    """Sign the travel contract."""
    world.append(f"sign {party}")
    return "signed"


class ScriptedModel(Model):
    """Asks for ``plan[n]`` when the turn holds n tool outputs, else says "done"."""

    def __init__(self, plan: dict[int, list[tuple[str, str]]]) -> None:
        self.plan = plan

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        items = kwargs["input"] if isinstance(kwargs["input"], list) else []
        calls = self.plan.get(sum(1 for item in items if item.get("type") == "function_call_output"))
        usage = Usage(requests=1, input_tokens=20, output_tokens=5, total_tokens=25)
        if calls is None:
            text = ResponseOutputText(annotations=[], text="done", type="output_text")
            reply = ResponseOutputMessage(
                id="m", content=[text], role="assistant", status="completed", type="message"
            )
            return ModelResponse(output=[reply], usage=usage, response_id=None)
        output = [
            ResponseFunctionToolCall(arguments=arguments, call_id=f"call_{uuid.uuid4().hex[:8]}", name=name,
                                     type="function_call", id="fc", status="completed")
            for name, arguments in calls
        ]  # fmt: skip
        return ModelResponse(output=output, usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


trip_agent = AgentSaga("trip_agent", undos)
registry = SagaRegistry(trip_agent)  # what `sagaguard sagas worker` is given

url = os.environ.get("SAGAGUARD_STORE", "sqlite:///agent.db")
journal = open_journal(url)
runner = AgentRunner(journal, Guard(open_store(url)))
tools = [book_hotel, charge, book_flight, sign_contract]
session = f"chat-{uuid.uuid4().hex[:6]}"  # the conversation's id (an SQLiteSession's session_id)


async def turn(n: int, text: str, plan: dict[int, list[tuple[str, str]]]) -> Any:
    agent = Agent(name="trips", instructions="Book trips.", model=ScriptedModel(plan), tools=tools)
    async with SagaTurn(runner, trip_agent, session, n) as opened:  # its saga: f"{session}/turn-{n}"
        return await opened.run(agent, text)  # stopped at an approval: the turn is paused


try:
    asyncio.run(turn(1, "book the Ritz, pay, fly", {
        0: [("book_hotel", '{"hotel": "Ritz"}'), ("charge", '{"amount": 420}')],  # in parallel
        2: [("book_flight", '{"to": "Oslo"}')],
    }))  # fmt: skip
except UserError as exc:  # what a tool raised, as the SDK reports it
    print("the turn failed:", exc.__cause__)
print(world)
assert sorted(world[:2]) == ["book Ritz", "charge 420"]  # made in parallel: in either order
assert sorted(world[2:]) == ["cancel bk-Ritz", "refund 420"]  # each undone once
snapshot = journal.load(f"{session}/turn-1")
assert snapshot is not None and snapshot.saga.state is SagaState.COMPENSATED

world.clear()
paused = asyncio.run(turn(2, "book the Savoy, sign", {
    0: [("book_hotel", '{"hotel": "Savoy"}')],
    1: [("sign_contract", '{"party": "acme"}')],
}))  # fmt: skip
assert [item.name for item in paused.interruptions] == ["sign_contract"]
# Later, in any process: the manager says no. The SDK's state.reject(item) would only tell the model.
outcome = asyncio.run(SagaTurn(runner, trip_agent, session, 2).reject("the manager said no"))
print(outcome.state.value, world)
assert outcome.state is SagaState.COMPENSATED and world == ["book Savoy", "cancel bk-Savoy"]
runner.close()
