"""An OpenAI Agents SDK turn in an agent saga, in the world of ``tests/_undokey.py``: run as a real
process by ``tests/test_agent_saga_lost_answers.py`` (and imported by it for the in-process case).

A scripted model (a real SDK ``Model``; fresh random tool call ids, so the same ids after a crash
are the journal's doing) asks, by the number of tool outputs the turn holds, for the calls of
``SCRIPTS[script]``, one per answer; a tool output that is the SDK's error text ("An error
occurred ...") makes it ask for the same tool again, under a new call id, as a model does.

The tools are declared as the docs' recipe declares them and built with the SDK's defaults (no
``failure_error_function=None``): a declared tool's failure must still be a failed step.

``python tests/_undokeysdk.py SCRIPT`` runs (or goes on with) turn 1 of the conversation
``$AGENT_SESSION`` and prints one JSON line: what the turn raised and where its saga is.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import _undokey as world
from agents import Agent, SQLiteSession, function_tool, set_tracing_disabled
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

set_tracing_disabled(True)

SCRIPTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "lost": [("book_hotel", {"hotel": "ritz"}), ("charge", {"amount": 606})],
    "pivot": [("book_hotel", {"hotel": "ritz"}), ("send_email", {"to": "ann@example.com"})],
    "fails": [("book_hotel", {"hotel": "ritz"}), ("book_flight", {"to": "Oslo"}),
              ("send_email", {"to": "ann@example.com"})],
}  # fmt: skip
GUARD: list[Guard] = []


class ScriptedModel(Model):
    """Asks for ``script[n]`` when the turn holds ``n`` tool outputs (the last one again when the
    last output is an error text), else says "done"."""

    def __init__(self, script: list[tuple[str, dict[str, Any]]]) -> None:
        self.script = script

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
        items = [] if isinstance(input, str) else list(input)
        outputs = [i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
        usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
        # A tool that failed (the SDK's error text) is asked for again, as a model does.
        n = sum(1 for o in outputs if "error occurred" not in str(o.get("output", "")))
        if n >= len(self.script):
            text = ResponseOutputText(annotations=[], text="done", type="output_text")
            message = ResponseOutputMessage(
                id="msg_1", content=[text], role="assistant", status="completed", type="message"
            )
            return ModelResponse(output=[message], usage=usage, response_id=None)
        name, arguments = self.script[n]
        call = ResponseFunctionToolCall(
            arguments=json.dumps(arguments), call_id=f"call_{uuid.uuid4().hex[:12]}", name=name,
            type="function_call", id=f"fc_{uuid.uuid4().hex[:8]}", status="completed",
        )  # fmt: skip
        return ModelResponse(output=[call], usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


# The recipe's declarations, the SDK's default tools (a failure becomes text for the model).
@function_tool
@changes_world(undo="cancel_booking", policy="at_least_once")
def book_hotel(hotel: str) -> dict[str, Any]:
    """Book a hotel."""
    return world.book_hotel(hotel)


@function_tool
@changes_world(undo="refund_lost", policy="at_least_once")
def charge(amount: int) -> dict[str, Any]:
    """Charge the card."""
    return world.charge(GUARD[0], amount)


@function_tool
@changes_world(undo="cancel_flight", policy="at_least_once", permanent=(world.NoSeats,))
def book_flight(to: str) -> dict[str, Any]:
    """Book a flight."""
    return world.book_flight(to)


@function_tool
@changes_world(pivot=True, policy="at_least_once")
def send_email(to: str) -> dict[str, Any]:
    """Send the confirmation."""
    return world.send_email(GUARD[0], to)


async def play(script: str, db: str, folder: Path, session_id: str) -> dict[str, Any]:
    """Run (or go on with) turn 1 of ``session_id``; what it raised and where its saga is."""
    guard = Guard(open_store(db))
    GUARD[:] = [guard]
    runner = AgentRunner(open_journal(db), guard, sleep=lambda _s: None)
    agent = Agent(
        name="trips", instructions="Book trips.", model=ScriptedModel(SCRIPTS[script]),
        tools=[book_hotel, charge, book_flight, send_email],
    )  # fmt: skip
    turn = SagaTurn(runner, world.trip, session_id, 1)
    report: dict[str, Any] = {"raised": None}
    try:
        async with turn:
            session = SQLiteSession(session_id, str(folder / "session.db"))
            go_on = await turn.resume_turn(session, "book my trip")
            if go_on is not None:
                await turn.run(agent, go_on, session=session)
    except Exception as exc:
        report["raised"] = type(exc).__name__
        report["cause"] = None if exc.__cause__ is None else type(exc.__cause__).__name__
    finally:
        runner.close()
    report["run_id"] = turn.run_id
    report["state"] = None if turn.outcome is None else turn.outcome.state.value
    return report


if __name__ == "__main__":
    here = Path(os.environ.get("AGENT_MARKS", "."))
    url = os.environ["SAGAGUARD_STORE"]
    print(json.dumps(asyncio.run(play(sys.argv[1], url, here, os.environ["AGENT_SESSION"]))), flush=True)
