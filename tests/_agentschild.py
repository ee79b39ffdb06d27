"""A scripted OpenAI Agents SDK model for the tests, and the child of ``tests/test_openai_agents_crash.py``.

:class:`ScriptedModel` subclasses the SDK's ``Model``: asked with no tool output in its input yet, it
asks for one ``refund`` call (``{"order": ...}``) under a *fresh random* ``call_id``; once a tool output
is in the input, it answers with a message. Fresh ids make "a rerun sees the same tool call ids" an
assertion, and ``calls`` counts what was paid for.

Run as ``python tests/_agentschild.py '<json>'`` (keys: ``store`` URL, counter ``service`` URL,
``run_key``, ``order``) with ``$SAGAGUARD_CRASH_AT=after_effect`` to be SIGKILLed inside the tool after
the charge reached the service, before its record. Prints one JSON line: the final output, the tool
call ids the model answered with, model calls paid and replayed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

from agents import Agent, FunctionTool, Runner, function_tool, set_tracing_disabled
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseStreamEvent
from agents.model_settings import ModelSettings
from agents.models.interface import Model, ModelTracing
from agents.tool import Tool
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
from openai.types.responses.response_prompt_param import ResponsePromptParam

NAMESPACE = "agents-tests"

set_tracing_disabled(True)  # no OPENAI_API_KEY to export traces with


class ScriptedModel(Model):
    """Asks for ``tool`` once per run, then answers ``"done: <tool output>"``."""

    def __init__(self, tool: str = "refund", order: str = "42") -> None:
        self.tool = tool
        self.order = order
        self.calls = 0
        self.call_ids: list[str] = []

    async def get_response(  # noqa: PLR0917 - the SDK's Model signature
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        self.calls += 1
        items = [] if isinstance(input, str) else list(input)
        outputs = [i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
        usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
        if outputs:
            text = f"done: {outputs[-1].get('output')}"
            message = ResponseOutputMessage(
                id=f"msg_{uuid.uuid4().hex[:8]}",
                content=[ResponseOutputText(annotations=[], text=text, type="output_text")],
                role="assistant",
                status="completed",
                type="message",
            )
            return ModelResponse(output=[message], usage=usage, response_id=None)
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        self.call_ids.append(call_id)
        call = ResponseFunctionToolCall(
            arguments=json.dumps({"order": self.order}),
            call_id=call_id,
            name=self.tool,
            type="function_call",
            id=f"fc_{uuid.uuid4().hex[:8]}",
            status="completed",
        )
        return ModelResponse(output=[call], usage=usage, response_id=None)

    def stream_response(  # noqa: PLR0917 - the SDK's Model signature
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError


def charging_tool(service: str) -> FunctionTool:
    """``refund(order)``: POSTs a charge to the counter service, then dies where the test says."""
    from idempotency import current_effect
    from idempotency.testing import CounterClient, crash_point

    client = CounterClient(service)

    @function_tool
    def refund(order: str) -> str:
        """Refund an order."""
        effect = current_effect()
        charge = client.charge(
            order, 1000, provider_key=effect.provider_key, idempotency_key=effect.provider_key
        )
        crash_point("after_effect")
        return f"refunded {charge.key} ({charge.charge_id})"

    return refund


def main(config: dict[str, Any]) -> int:
    from connectors.openai_agents import AgentRun
    from idempotency import Guard, open_store

    store = open_store(config["store"])
    guard = Guard(store, namespace=NAMESPACE, lease=0.5, wait=20.0)
    model = ScriptedModel(order=config["order"])
    agent = Agent(
        name="refunds", instructions="Refund orders.", model=model, tools=[charging_tool(config["service"])]
    )
    run = AgentRun(guard, config["run_key"], tool_options={"refund": {"provider_idempotent": True}})
    try:
        result = asyncio.run(Runner.run(run.wrap(agent), f"Refund order {config['order']}"))
    finally:
        guard.close()
        store.close()
    report = {
        "output": result.final_output,
        "call_ids": model.call_ids,
        "paid": run.usage.calls,
        "saved": run.usage.saved_calls,
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    sys.exit(main(json.loads(sys.argv[1])))
