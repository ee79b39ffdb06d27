"""A scripted OpenAI Agents SDK model for the tests, and the child of ``tests/test_openai_agents_crash.py``.

:class:`ScriptedModel` subclasses the SDK's ``Model``: asked with no tool output in its input yet, it
asks for one ``refund`` call (``{"order": ...}``) under a *fresh random* ``call_id``; once a tool output
is in the input, it answers with a message. Fresh ids make "a rerun sees the same tool call ids" an
assertion, and ``calls`` counts what was paid for.

Run as ``python tests/_agentschild.py '<json>'`` (keys: ``store`` URL, counter ``service`` URL,
``run_key``, ``order``) with ``$SAGAGUARD_CRASH_AT=after_effect`` to be SIGKILLed inside the tool after
the charge reached the service, before its record. Prints one JSON line: the final output, the tool
call ids the model answered with, model calls paid and replayed. With the keys ``session``, ``turns``
and ``ledger`` it runs the two-turn session of ``tests/test_openai_agents_resume.py`` instead
(:func:`run_session`).
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


class PlanModel(ScriptedModel):
    """Asks for ``steps`` ``refund`` calls per turn, one per answer, then answers ``"done: <n>"``.

    The turn is what follows the last user message of the input; the k-th call of a turn refunds
    ``"<user text>/<k>"``, so every tool call of a session has its own arguments. Call ids are fresh
    and random, as in :class:`ScriptedModel`.
    """

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

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
        items: list[Any] = [{"role": "user", "content": input}] if isinstance(input, str) else list(input)
        users = [i for i, item in enumerate(items) if isinstance(item, dict) and item.get("role") == "user"]
        turn = items[users[-1] :]
        done = sum(1 for i in turn if isinstance(i, dict) and i.get("type") == "function_call_output")
        usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
        if done >= self.steps:
            message = ResponseOutputMessage(
                id=f"msg_{uuid.uuid4().hex[:8]}",
                content=[ResponseOutputText(annotations=[], text=f"done: {done}", type="output_text")],
                role="assistant", status="completed", type="message",
            )  # fmt: skip
            return ModelResponse(output=[message], usage=usage, response_id=None)
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        self.call_ids.append(call_id)
        call = ResponseFunctionToolCall(
            arguments=json.dumps({"order": f"{turn[0].get('content')}/{done + 1}"}), call_id=call_id,
            name=self.tool, type="function_call", id=f"fc_{uuid.uuid4().hex[:8]}", status="completed",
        )  # fmt: skip
        return ModelResponse(output=[call], usage=usage, response_id=None)


def charging_tool(service: str) -> FunctionTool:
    """``refund(order)``: POSTs a charge to the counter service, then dies where the test says."""
    from sagaguard.idempotency import current_effect
    from sagaguard.idempotency.testing import CounterClient, crash_point

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


def run_session(config: dict[str, Any]) -> int:
    """Two turns of a :class:`PlanModel` agent in an ``SQLiteSession``, each run or resumed with
    :meth:`AgentRun.resume_turn`; SIGKILLed at ``saved_<n>`` after the session's n-th save (counted in
    this process). Each tool run appends its order to the file ``config["ledger"]`` (the effect, counted
    by the test). Prints the final outputs and the loop's model calls paid and replayed."""
    from agents import SQLiteSession

    from sagaguard.connectors.frameworks.openai_agents import AgentRun
    from sagaguard.idempotency import Guard, open_store
    from sagaguard.idempotency.testing import crash_point

    class Saving(SQLiteSession):
        saves = 0

        async def add_items(self, items: list[Any]) -> None:
            await super().add_items(items)
            if items:
                self.saves += 1
                crash_point(f"saved_{self.saves}")

    @function_tool
    def refund(order: str) -> str:
        """Refund an order."""
        with open(config["ledger"], "a", encoding="utf-8") as ledger:
            ledger.write(order + "\n")
        return f"refunded {order}"

    store = open_store(config["store"])
    guard = Guard(store, namespace=NAMESPACE, lease=0.5, wait=20.0)
    agent = Agent(name="refunds", instructions="Refund orders.", model=PlanModel(3), tools=[refund])
    session = Saving("chat", config["session"])
    outputs: list[Any] = []
    paid = saved = 0
    try:
        for turn, text in enumerate(config["turns"], start=1):
            run = AgentRun(guard, f"chat/turn-{turn}")
            go_on = asyncio.run(run.resume_turn(session, turn, text))
            if go_on is not None:
                result = asyncio.run(Runner.run(run.wrap(agent), go_on, session=session))
                outputs.append(result.final_output)
            paid, saved = paid + run.usage.calls, saved + run.usage.saved_calls
    finally:
        session.close()
        guard.close()
        store.close()
    print(json.dumps({"outputs": outputs, "paid": paid, "saved": saved}), flush=True)
    return 0


def main(config: dict[str, Any]) -> int:
    if "session" in config:
        return run_session(config)
    from sagaguard.connectors.frameworks.openai_agents import AgentRun
    from sagaguard.idempotency import Guard, open_store

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
