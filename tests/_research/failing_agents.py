"""The failing research agent on the OpenAI Agents SDK, run as a child process of the failing sweep
(:mod:`_research.failing`), and that sweep's plug-in (:func:`failing_variants`).

``python tests/_research/failing_agents.py MODE '<config json>'`` with MODE ``sagaguard`` or
``plain``, with the protocol of :mod:`_research.failing_langgraph` (``action`` ``start``, ``resume``
or ``worker``; the same JSON line). One ``Agent`` (``OpenAIChatCompletionsModel`` against the world,
``TASK agent_failing``) with six function tools, the conversation in an ``SQLiteSession``::

    search -> fetch -> write_report (a model call) -> book_review -> pay -> publish (raises)

- ``plain``: the SDK alone with its session: plain tools (``urllib``, the ``openai`` SDK, the
  ``stripe`` SDK with its own random idempotency key, a booking without a key); the tools are
  built with ``failure_error_function=None``, so ``publish``'s exception ends the run. Nothing is
  undone.
- ``sagaguard``: the turn is an agent saga,
  :class:`sagaguard.connectors.frameworks.openai_agents_saga.SagaTurn` (``async with``; run id
  ``{session}/turn-1``): loop model calls journaled, ``book_review`` and ``pay`` declared by name at the
  adapter (``SagaTurn(declare=DECLARE)``: ``changes_world(undo="cancel_review")`` and
  ``changes_world(undo="refund")``, at least once as every compensatable step), the tools built from
  :class:`_research.failing_common.PlanTools` with ``failure_error_function=None``, their insides
  guarded as in the LangGraph child (the booking under the tool call's ``Idempotency-Key``, the
  charge a :class:`sagaguard.connectors.stripe.StripeEffects` effect in the tool call's scope), the read-only
  tools guarded by the SDK adapter, the report's model call journaled
  (:class:`sagaguard.connectors.llm.ChatJournal`). ``publish`` raises, the turn's saga compensates with the
  undos of :mod:`_research.failing_common`. The resume goes on from the session with
  ``SagaTurn.resume_turn``; a turn killed in its compensation is taken over at once (its holder is
  dead on this host) and finished when the run is opened (or, held elsewhere, through the worker
  API once that lease ran out).

Kill points: as in :mod:`_research.failing_common` (the undos, ``charge_applied``, ``booked``,
``model_answered#k``, ``recorded:<effect>#k``, ``saga_commit#k``), plus ``enter:<tool>`` (a tool's
first line), ``searched``, ``fetched``, ``exit:<tool>`` (its output returned, before any record) and
``session_saved#k`` (the session saved its k-th batch of items).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for entry in (HERE.parent.parent, HERE.parent):  # the project root and tests/, when run as a script
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import httpx  # noqa: E402
import openai  # noqa: E402
from agents import (  # noqa: E402
    Agent,
    OpenAIChatCompletionsModel,
    Runner,
    SQLiteSession,
    function_tool,
    set_tracing_disabled,
)

from _research.failing import Failing  # noqa: E402
from _research.failing_common import (  # noqa: E402
    DECLARE,
    INSTRUCTIONS,
    MODEL,
    PlanTools,
    SagaSide,
    configure,
    on_model_response,
    payments_client,
    research_agent,
)
from _research.points import reach  # noqa: E402
from _research.sweep import SDK_PRELOAD, Variant  # noqa: E402
from sagaguard.connectors.frameworks.openai_agents_saga import SagaTurn, turn_run_id  # noqa: E402
from sagaguard.connectors.llm import ChatJournal  # noqa: E402
from sagaguard.connectors.stripe import StripeEffects  # noqa: E402
from sagaguard.idempotency import current_effect, scope  # noqa: E402
from sagaguard.saga import SagaState  # noqa: E402
from sagaguard.saga.agent import AgentRunEnded  # noqa: E402

MODES = ("sagaguard", "plain")
SESSION = "research-failing-1"
"""The session id (one conversation); the research request is its turn 1."""
RUN_ID = turn_run_id(SESSION, 1)
"""The turn's run id: its saga's id and its model calls' run key."""
MAX_TURNS = 20
PRELOAD = (
    *SDK_PRELOAD, "sagaguard.connectors.llm", "sagaguard.connectors.stripe", "sagaguard.saga.recovery",
    "sagaguard.saga.journals.sql",
)  # fmt: skip
EARLY = ("session_saved#1", "model_answered#1", "searched", "model_answered#4", "recorded:llm.chat#1")
"""Kill points before the first call with an undo: the input saved, the first answer, inside the
search, inside the report's model call, the report's model call recorded."""
START = "model_answered#5"
"""The answer asking for ``book_review`` arrived: from here on, every point."""
FAILS_AT = "enter:publish"
"""The failing tool's first line."""


def failing_variants() -> list[Failing]:
    """The Agents SDK with an agent saga (``SagaTurn``), and the SDK alone with its session."""
    child = str(Path(__file__).resolve())
    entry = "_research.failing_agents:main"
    return [
        Failing(Variant("OpenAI Agents SDK + sagaguard", (sys.executable, child, "sagaguard"), guarded=True,
                        entry=entry, preload=PRELOAD), EARLY, START, FAILS_AT),
        Failing(Variant("OpenAI Agents SDK alone (session)", (sys.executable, child, "plain"), entry=entry,
                        preload=PRELOAD), EARLY, START, FAILS_AT),
    ]  # fmt: skip


class HookedSession(SQLiteSession):
    """An SQLiteSession with a kill point after each batch of items it saved."""

    async def add_items(self, items: list[Any]) -> None:
        await super().add_items(items)
        if items:
            reach("session_saved")


def _failed(exc: BaseException) -> bool:
    """Whether ``exc`` is the publisher's refusal (the SDK wraps what a tool raised)."""
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ == "PublishFailed":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def _run(mode: str, config: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    set_tracing_disabled(True)  # no OPENAI_API_KEY to export traces with

    async def answered(response: httpx.Response) -> None:
        on_model_response(response)

    base_url = config["model_base_url"]
    client = openai.OpenAI(
        api_key="sk-local", base_url=base_url, max_retries=0,
        http_client=httpx.Client(event_hooks={"response": [on_model_response]}, timeout=30),
    )  # fmt: skip
    loop_client = openai.AsyncOpenAI(
        api_key="sk-local", base_url=base_url, max_retries=0,
        http_client=httpx.AsyncClient(event_hooks={"response": [answered]}, timeout=30),
    )  # fmt: skip
    payments = payments_client(config)

    def messages(user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": "TASK write. You are a research assistant."},
                {"role": "user", "content": user}]  # fmt: skip

    side = SagaSide(folder) if mode == "sagaguard" else None
    effects = StripeEffects(side.guard, payments) if side is not None else None
    journal = ChatJournal(side.guard, client) if side is not None else None

    def ask(user: str) -> str:
        if journal is None:
            reply = client.chat.completions.create(model=MODEL, messages=messages(user))  # type: ignore[arg-type]
        else:
            with scope(current_effect().key):  # the tool call's effect names its model call
                reply = journal.create(model=MODEL, messages=messages(user))  # type: ignore[arg-type]
        return str(reply.choices[0].message.content)

    tools_url = config["tools_url"]
    configure(effects, tools_url)
    plan = PlanTools(tools_url, payments, effects, ask)
    # failure_error_function=None: a tool's exception ends the turn (which undoes it), rather than
    # becoming text for the model.
    tools = [function_tool(method, failure_error_function=None) for method in plan.all()]
    model = OpenAIChatCompletionsModel(MODEL, loop_client)
    agent = Agent(name="researcher", instructions=INSTRUCTIONS, model=model, tools=tools)
    session = HookedSession(SESSION, str(folder / "session.db"))
    status, error = "completed", ""
    try:
        if config["action"] == "worker":
            status, error = "swept", side.sweep() if side is not None else ""
        elif side is None:
            saved = await session.get_items()
            go_on = config["action"] == "resume" and bool(saved)
            try:
                given = [] if go_on else str(config["topic"])
                await Runner.run(agent, given, session=session, max_turns=MAX_TURNS)
            except Exception as exc:
                if not _failed(exc):
                    raise
                status, error = "failed", str(exc)
        else:
            turn = SagaTurn(side.runner, research_agent, SESSION, 1, declare=DECLARE)
            try:
                async with turn:
                    go_on_with = await turn.resume_turn(session, str(config["topic"]))
                    if go_on_with is not None:
                        await turn.run(agent, go_on_with, session=session, max_turns=MAX_TURNS)
            except AgentRunEnded as exc:  # it ended, or is compensating, since a killed process had it
                if exc.state != SagaState.COMPENSATING.value:
                    status, error = "ended", str(exc)
                else:
                    await asyncio.to_thread(side.recover_until_ended, RUN_ID)
                    status, error = "recovered", str(exc)
            except Exception as exc:  # the turn's calls were undone on the way out of the block
                if not _failed(exc):
                    raise
                status, error = "failed", str(exc)
        return {
            "status": status,
            "saga": side.state(RUN_ID) if side is not None else "",
            "in_doubt": side.in_doubt() if side is not None else [],
            "error": error,
        }
    finally:
        session.close()
        client.close()
        await loop_client.close()
        if side is not None:
            side.close()


def main(mode: str, config: Mapping[str, Any]) -> int:
    """Start, resume or sweep (``action``) the failing agent once; print the JSON result line."""
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, not {mode!r}")
    folder = Path(config["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    print(json.dumps(asyncio.run(_run(mode, config, folder))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
