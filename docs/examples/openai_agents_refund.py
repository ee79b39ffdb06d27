"""OpenAI Agents SDK: a rerun of the same run key replays the model and the tool; nothing is paid
or refunded twice (a scripted model stands in for OpenAI, so this runs offline)."""

import asyncio
import os
import uuid
from typing import Any

from agents import Agent, Runner, function_tool, set_tracing_disabled
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.openai_agents import JournaledRun
from sagaguard.idempotency import Guard, open_store

set_tracing_disabled(True)
refunds: list[str] = []


@function_tool
@changes_world  # refunds without a guarded effect of its own: at most once
def refund(order: str) -> str:
    """Refund an order."""
    refunds.append(order)  # the side effect: a payment provider's refund
    return f"refunded {order}"


class ScriptedModel(Model):
    """Asks for refund(order=42) under a fresh call id, then answers with the tool's output."""

    calls = 0

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        self.calls += 1
        items = kwargs["input"] if isinstance(kwargs["input"], list) else []
        done = [i for i in items if i.get("type") == "function_call_output"]
        usage = Usage(requests=1, input_tokens=20, output_tokens=5, total_tokens=25)
        if done:
            text = ResponseOutputText(annotations=[], text=f"Done: {done[-1]['output']}", type="output_text")
            reply = ResponseOutputMessage(
                id="msg_1", content=[text], role="assistant", status="completed", type="message"
            )
            return ModelResponse(output=[reply], usage=usage, response_id=None)
        call = ResponseFunctionToolCall(
            arguments='{"order": "42"}', call_id=f"call_{uuid.uuid4().hex[:8]}", name="refund",
            type="function_call", id="fc_1", status="completed",
        )  # fmt: skip
        return ModelResponse(output=[call], usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///agents.db"))
guard = Guard(store)
model = ScriptedModel()
agent = Agent(name="support", instructions="Refund what is asked.", model=model, tools=[refund])


async def turn(run_key: str) -> str:
    run = JournaledRun(guard, run_key)  # a fresh JournaledRun, as a restarted process would make
    result = await Runner.run(run.wrap(agent), "Please refund order 42.")
    paid, replayed = run.usage.calls, run.usage.saved_calls
    print(f"{run_key}: {result.final_output!r}; model calls paid {paid}, replayed {replayed}")
    return str(result.final_output)


first = asyncio.run(turn("ticket-881/turn-1"))
again = asyncio.run(turn("ticket-881/turn-1"))  # the same turn run again (after a crash)
assert again == first
assert refunds in ([], ["42"]) and model.calls in (0, 2)  # 0 when the store already had the run
print(f"refunds made by this process: {len(refunds)}")

guard.close()
store.close()
