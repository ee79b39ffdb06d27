"""An OpenAI Agents SDK trip agent in an agent saga (the world and the undos of
``tests/_agenttrip.py``): imported by ``tests/test_agent_saga_agents.py`` and run as a real
process for its crash tests; the worker runs ``--app _agenttrip:registry``.

A scripted model (:class:`TripModel`, a real SDK ``Model`` whose tool call ids are fresh and random,
so "the same ids after a crash" is the journal's doing) asks for the hotel and the charge (two
parallel tool calls in one answer), then for the flight. ``$AGENT_DIR`` holds the session and the
``RunState`` saved at an approval; ``$SAGAGUARD_STORE`` the journal and the effects.

``python tests/_agentsagasdk.py run|approve|reject`` runs the turn (or goes on with it from the
session), approves the flight and finishes, or rejects the turn; it prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import _agenttrip as trip
from agents import Agent, RunContextWrapper, RunState, SQLiteSession, function_tool, set_tracing_disabled
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem
from agents.model_settings import ModelSettings
from agents.models.interface import Model, ModelTracing
from agents.tool import Tool
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
from openai.types.responses.response_prompt_param import ResponsePromptParam

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.openai_agents_saga import SagaTurn
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga.agent import AgentRunner
from sagaguard.saga.journals import open_journal

set_tracing_disabled(True)  # no OPENAI_API_KEY to export traces with

SESSION = trip.RUN
TEXT = trip.TEXT


class TripModel(Model):
    """Answers by how many tool outputs the turn holds: ``plan[n]``'s calls (in one answer, under
    fresh random ids) or, for any other count, "done"."""

    def __init__(self, plan: dict[int, list[tuple[str, dict[str, Any]]]] | None = None) -> None:
        self.plan = trip.PLAN if plan is None else plan
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
        done = sum(1 for i in items if isinstance(i, dict) and i.get("type") == "function_call_output")
        if done:
            trip.kill_once("in_model")
        usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
        calls = self.plan.get(done)
        if calls is None:
            text = ResponseOutputText(annotations=[], text="done", type="output_text")
            message = ResponseOutputMessage(
                id="msg_1", content=[text], role="assistant", status="completed", type="message"
            )
            return ModelResponse(output=[message], usage=usage, response_id=None)
        output: list[Any] = []
        for name, arguments in calls:
            call_id = f"call_{uuid.uuid4().hex[:12]}"
            self.call_ids.append(call_id)
            call = ResponseFunctionToolCall(
                arguments=json.dumps(arguments), call_id=call_id, name=name, type="function_call",
                id=f"fc_{uuid.uuid4().hex[:8]}", status="completed",
            )  # fmt: skip
            output.append(call)
        return ModelResponse(output=output, usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@function_tool(failure_error_function=None)
@changes_world(undo="cancel_booking")  # declared next to the tool
def book_hotel(hotel: str) -> dict[str, Any]:
    """Book a hotel."""
    return trip.book_hotel(hotel)


@function_tool(failure_error_function=None)
def charge(amount: int, order: str) -> dict[str, Any]:
    """Charge the card."""
    return trip.charge(amount, order)


async def _flight_needs_approval(_ctx: RunContextWrapper[Any], _args: dict[str, Any], _call_id: str) -> bool:
    return trip.CONFIG["flight"] == "approval"


@function_tool(failure_error_function=None, needs_approval=_flight_needs_approval)
@changes_world(undo="cancel_flight", permanent=(trip.NoSeats,))  # "no seats" is sure not to have booked
def book_flight(to: str) -> dict[str, Any]:
    """Book a flight."""
    return trip.book_flight(to)


def build(model: Model) -> Agent[Any]:
    """The trip agent; ``charge`` is declared by name, at the adapter (see :func:`turn`)."""
    tools = [book_hotel, charge, book_flight]
    return Agent(name="trips", instructions="Book trips.", model=model, tools=tools)


def turn(runner: AgentRunner, n: int = 1) -> SagaTurn:
    """The conversation's ``n``-th turn under the trip agent's saga."""
    return SagaTurn(runner, trip.trip_agent, SESSION, n, declare={"charge": changes_world(undo="refund")})


async def main(mode: str) -> dict[str, Any]:
    folder = Path(os.environ.get("AGENT_DIR", "."))
    url = os.environ["SAGAGUARD_STORE"]
    guard = Guard(open_store(url))  # the defaults: a dead holder is taken over at once
    runner = AgentRunner(open_journal(url), guard, sleep=lambda _s: None)
    agent = build(TripModel())
    saved = folder / "state.json"
    report: dict[str, Any] = {}
    opened = turn(runner)
    try:
        if mode == "reject":
            report["state"] = (await turn(runner).reject("the manager said no")).state.value
            return report
        async with opened:
            if mode == "approve":
                loaded = await RunState.from_json(opened.wrap(agent), json.loads(saved.read_text()))
                state = opened.resume(loaded)
                for item in state.get_interruptions():
                    state.approve(item)
                result = await opened.run(agent, state)
            else:
                session = SQLiteSession(SESSION, str(folder / "session.db"))
                go_on = await opened.resume_turn(session, TEXT)
                assert go_on is not None, "the turn had already finished"
                result = await opened.run(agent, go_on, session=session)
            if result.interruptions:
                saved.write_text(json.dumps(result.to_state().to_json()))
            report["output"] = result.final_output
    except Exception as exc:  # the turn failed: it was undone (or left, as its saga says)
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        runner.close()
    report["state"] = None if opened.outcome is None else opened.outcome.state.value
    return report


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
