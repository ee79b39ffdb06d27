"""OpenAI Agents SDK with a session: a turn killed after the session saved part of it goes on from the
session; no tool runs twice, no model answer is paid twice (a scripted model stands in for OpenAI)."""

import asyncio
import os
import uuid
from typing import Any

from agents import Agent, Runner, SQLiteSession, function_tool, set_tracing_disabled
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from sagaguard.connectors.frameworks.openai_agents import JournaledRun
from sagaguard.idempotency import Guard, open_store

set_tracing_disabled(True)
refunds: list[str] = []


@function_tool
def refund(order: str) -> str:
    """Refund an order."""
    refunds.append(order)  # the side effect: a payment provider's refund
    return f"refunded {order}"


class ScriptedModel(Model):
    """Refunds the two orders of the turn's message ("refund 41 and 42"), one call per answer."""

    calls = 0

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        self.calls += 1
        items = kwargs["input"] if isinstance(kwargs["input"], list) else []
        last_user = max(i for i, item in enumerate(items) if item.get("role") == "user")
        orders = str(items[last_user]["content"]).split()[1::2]  # "refund 41 and 42" -> 41, 42
        done = sum(1 for item in items[last_user:] if item.get("type") == "function_call_output")
        usage = Usage(requests=1, input_tokens=20, output_tokens=5, total_tokens=25)
        if done == len(orders):
            text = ResponseOutputText(annotations=[], text=f"refunded {done} orders", type="output_text")
            reply = ResponseOutputMessage(
                id="msg_1", content=[text], role="assistant", status="completed", type="message"
            )
            return ModelResponse(output=[reply], usage=usage, response_id=None)
        call = ResponseFunctionToolCall(
            arguments=f'{{"order": "{orders[done]}"}}', call_id=f"call_{uuid.uuid4().hex[:8]}",
            name="refund", type="function_call", id="fc_1", status="completed",
        )  # fmt: skip
        return ModelResponse(output=[call], usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class Killed(BaseException):
    """Stands in for a kill -9 of the process."""


class Session(SQLiteSession):
    """An SQLiteSession; `kill_after` saves from now, the process "dies"."""

    kill_after: int | None = None

    async def add_items(self, items: list[Any]) -> None:
        await super().add_items(items)
        if self.kill_after is not None:
            self.kill_after -= 1
            if self.kill_after == 0:
                raise Killed


store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///agents.db"))
guard = Guard(store)
model = ScriptedModel()
agent = Agent(name="support", instructions="Refund what is asked.", model=model, tools=[refund])
session = Session(f"chat-{uuid.uuid4().hex[:6]}", "sessions.db")


async def turn(n: int, text: str) -> None:
    run = JournaledRun(guard, f"{session.session_id}/turn-{n}")  # one run key per turn of the session
    go_on = await run.resume_turn(session, n, text)  # the input, [] to go on, None when it had finished
    if go_on is not None:
        result = await Runner.run(run.wrap(agent), go_on, session=session)
        print(f"turn {n}: {result.final_output!r} (model calls paid {run.usage.calls})")


asyncio.run(turn(1, "refund 41 and 42"))
session.kill_after = 2  # the second turn dies once its input and its first step were saved
try:
    asyncio.run(turn(2, "refund 43 and 44"))
except Killed:
    print(f"killed after refunds {refunds}")
session.kill_after = None
asyncio.run(turn(2, "refund 43 and 44"))  # the restart: the same recipe goes on from the session
asyncio.run(turn(2, "refund 43 and 44"))  # and once the turn finished, it runs nothing
assert refunds == ["41", "42", "43", "44"]  # every refund once
assert model.calls == 6  # three answers a turn: none paid twice
session.close()
guard.close()
store.close()
