"""The OpenAI Agents SDK agent-saga recipe with the declarations exactly as docs/agent_sagas.md
writes them, run as a real process for tests/test_agent_saga_declared.py.

A scripted model (a real SDK ``Model`` whose tool call ids are fresh and random, so the same ids
after a crash are the journal's doing) books a hotel, then charges a card, then says "done": the
turn succeeds. The tools are declared the shortest way the page shows (an undo by name under
``@function_tool``, ``charge``'s by name in the ``SagaTurn``'s ``declare=``, no ``policy=``);
their bodies and undos are the booking world's (``tests/_declaredworld.py``, killed at
``in_booking``). The session, the effects and the journal live in ``$AGENT_DIR``.

``python tests/_agentsagasdkdeclared.py`` runs turn 1, or goes on with it from the session, and
prints the outcome as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from typing import Any

from _declaredworld import DB, FOLDER, book, guard, pay, undos
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
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentRunner, AgentSaga
from sagaguard.saga.journals import open_journal

set_tracing_disabled(True)  # no OPENAI_API_KEY to export traces with

SESSION = "chat-1"
SCRIPT = [("book_hotel", {"hotel": "ritz"}), ("charge", {"amount": 420})]  # one call per answer


class ScriptedModel(Model):
    """Asks for ``SCRIPT[n]`` when the turn holds ``n`` tool outputs; past the script, "done"."""

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
        n = sum(1 for i in items if isinstance(i, dict) and i.get("type") == "function_call_output")
        usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
        if n >= len(SCRIPT):
            text = ResponseOutputText(annotations=[], text="done", type="output_text")
            message = ResponseOutputMessage(
                id="msg_1", content=[text], role="assistant", status="completed", type="message"
            )
            return ModelResponse(output=[message], usage=usage, response_id=None)
        name, arguments = SCRIPT[n]
        call = ResponseFunctionToolCall(
            arguments=json.dumps(arguments), call_id=f"call_{uuid.uuid4().hex[:12]}", name=name,
            type="function_call", id=f"fc_{uuid.uuid4().hex[:8]}", status="completed",
        )  # fmt: skip
        return ModelResponse(output=[call], usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


trip_agent = AgentSaga("trip_agent", undos)
registry = SagaRegistry(trip_agent)


@function_tool
@changes_world(undo="cancel_booking")
def book_hotel(hotel: str) -> dict[str, Any]:
    """Book a hotel."""
    return book(hotel)


@function_tool
def charge(amount: int) -> dict[str, Any]:
    """Charge the card."""
    return pay(amount)


async def main() -> dict[str, Any]:
    """Run turn 1 of the conversation, or go on with it from the session."""
    agent = Agent(name="trips", instructions="Book trips.", model=ScriptedModel(), tools=[book_hotel, charge])
    runner = AgentRunner(open_journal(DB), guard, sleep=lambda _s: None)  # the defaults
    session = SQLiteSession(SESSION, str(FOLDER / "session.db"))
    answer = None
    try:
        async with SagaTurn(runner, trip_agent, session.session_id, 1,
                            declare={"charge": changes_world(undo="refund")}) as turn:  # fmt: skip
            go_on = await turn.resume_turn(session, "book my trip")  # the input, [] to go on, None: done
            if go_on is not None:
                answer = (await turn.run(agent, go_on, session=session)).final_output
    finally:
        runner.close()
    return {"state": turn.outcome.state.value if turn.outcome else "?", "answer": answer}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())), flush=True)
    sys.exit(0)
