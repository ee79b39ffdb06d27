"""The failing research agent on LangGraph, run as a child process of the failing sweep
(:mod:`_research.failing`): it books a reviewer, pays, then fails on a later tool.

``python tests/_research/failing_langgraph.py MODE '<config json>'`` with MODE ``sagaguard`` or
``plain``; the sweep forks it from a zygote that imported this module (:mod:`_research.zygote`),
so nothing here starts a thread or opens anything at import. The agent is a LangGraph tool loop
(``StateGraph``: a model node and a ``ToolNode``, SQLite checkpointer, ``durability="sync"``),
driven by the world's ``TASK agent_failing`` plan (:func:`_research.world.failing_step`)::

    search -> fetch -> write_report (a model call) -> book_review (the review desk)
           -> pay (a Stripe charge) -> publish (the publisher is down: the tool raises)

- ``plain``: the checkpointer alone: ``ChatOpenAI`` against the world, plain tools (``urllib``, the
  ``stripe`` SDK with its own random idempotency key per request, a booking without a key), a
  ``ToolNode`` with ``handle_tool_errors=False``. The failure ends the run; nothing undoes the
  booking or the charge.
- ``sagaguard``: an agent saga (:mod:`sagaguard.saga.agent`). The model is journaled
  (:class:`sagaguard.connectors.frameworks.langgraph.JournaledChatModel`, so a resumed run's tool calls keep
  their ids), the ``ToolNode``'s handler is :class:`sagaguard.connectors.frameworks.langgraph.ToolGuard`
  in saga mode with the steps declared by name (``ToolGuard(guard, saga=True, declare=DECLARE)``:
  ``book_review`` ``changes_world(undo="cancel_review")``, ``pay`` ``changes_world(undo="refund")``,
  at least once as every compensatable step: what they do inside is
  guarded on its own, the booking by the desk's ``Idempotency-Key``, the charge as a
  :class:`sagaguard.connectors.stripe.StripeEffects` effect with its reconciler), the read-only tools run
  through the ``ToolGuard`` (the report's model call journaled with
  :class:`sagaguard.connectors.llm.ChatJournal`). The run is opened with ``AgentRunner.run(research_agent,
  THREAD)`` around ``graph.invoke``; ``publish`` raises, the run's saga compensates with the undos
  of :mod:`_research.failing_common`: the charge refunded (``StripeEffects.refund``, a guarded
  effect with its reconciler), the booking cancelled (the desk's ``Idempotency-Key`` from the undo's
  own effect), each undo a guarded effect of its own.

The config JSON: ``dir`` (checkpoints, effects and the saga journal live there), ``action``:

- ``start``: invoke with the topic;
- ``resume``: a fresh process after a kill: open the run again and ``invoke(None)`` from the last
  checkpoint (from the topic when the killed run left none); a run that ended meanwhile is reported
  as it is; a run killed in its compensation is taken over at once (its holder is dead on this
  host) and finished when the run is opened (``AgentRunEnded``: compensated); one still held
  elsewhere (``AgentRunEnded``: compensating) is finished here through the worker API
  (:func:`sagaguard.saga.recovery.recover`, once that lease ran out);
- ``worker``: one sweep of the worker API over the journal (:func:`sagaguard.saga.recovery.recover`), as
  ``sagaguard sagas worker --once`` does;

``topic``, and the world's addresses (:func:`_research.sweep.world_config`).

Kill points (:func:`_research.points.reach`): ``model_answered#k`` (an answer arrived, nothing
recorded it), ``model_returned#k`` (the model node holds it, journaled under sagaguard),
``checkpoint#k`` (the checkpointer saved its k-th checkpoint), ``enter:<tool>`` and
``exit:<tool>`` (the tool's first line; its output returned, before any record), ``searched``,
``fetched``, ``booked`` (the desk answered the booking), ``charge_applied`` (Stripe answered the
charge), ``recorded:<effect>#k`` (the effect store recorded the k-th outcome of that effect:
``agent.tool.pay``, ``stripe.charge``, ``stripe.refund``, ``sagaguard.compensate.research_agent``,
...), ``saga_commit#k`` (the saga journal's k-th commit: a call registered, its result, the run
failed, an undo done, the run ended), and in the compensation ``enter:undo:<undo>`` (the undo's
first line, before the provider is called), ``refund_applied`` (Stripe answered the refund, before
any record), ``cancel_applied`` (the desk answered the cancellation), ``undone:<undo>`` (the undo
returned, before its record).

Prints one JSON line: ``status`` (``failed``: the run failed and this process ended it;
``ended``: it had ended before; ``recovered``: the worker API finished its compensation here;
``completed``), ``saga`` (its state in the journal, ``""`` for ``plain``), ``in_doubt`` (effects
left in doubt in the store), ``error``.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for entry in (HERE.parent.parent, HERE.parent):  # the project root and tests/, when run as a script
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import httpx  # noqa: E402
import openai  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.checkpoint.sqlite import SqliteSaver  # noqa: E402
from langgraph.graph import START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import ToolNode, tools_condition  # noqa: E402

from _research.failing_common import (  # noqa: E402
    DECLARE,
    INSTRUCTIONS,
    MODEL,
    PlanTools,
    PublishFailed,
    SagaSide,
    configure,
    on_model_response,
    payments_client,
    research_agent,
)
from _research.points import reach  # noqa: E402
from sagaguard.connectors.frameworks.langgraph import JournaledChatModel, ToolGuard  # noqa: E402
from sagaguard.connectors.llm import ChatJournal  # noqa: E402
from sagaguard.connectors.stripe import StripeEffects  # noqa: E402
from sagaguard.saga import SagaState  # noqa: E402
from sagaguard.saga.agent import AgentRunEnded  # noqa: E402

MODES = ("sagaguard", "plain")
THREAD = "research-failing-1"
"""The graph's ``thread_id``, and the agent run's saga id."""


class HookedSaver(SqliteSaver):
    """A SqliteSaver with a kill point after each saved checkpoint."""

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        saved = super().put(config, checkpoint, metadata, new_versions)
        reach("checkpoint")
        return saved


class Built:
    """The compiled graph and what the run needs, for one mode (``saga``: None for ``plain``)."""

    def __init__(self, graph: Any, saga: SagaSide | None, closers: list[Callable[[], None]]) -> None:
        self.graph = graph
        self.saga = saga
        self.closers = closers

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def build(config: Mapping[str, Any], mode: str, folder: Path) -> Built:
    """The compiled agent graph for ``mode`` and what its run needs."""
    chat = ChatOpenAI(
        model=MODEL, api_key="sk-local", base_url=config["model_base_url"], max_retries=0,  # type: ignore[arg-type]
        http_client=httpx.Client(event_hooks={"response": [on_model_response]}, timeout=30),
    )  # fmt: skip
    payments = payments_client(config)
    client = openai.OpenAI(
        api_key="sk-local", base_url=config["model_base_url"], max_retries=0,
        http_client=httpx.Client(event_hooks={"response": [on_model_response]}, timeout=30),
    )  # fmt: skip
    closers: list[Callable[[], None]] = [client.close]

    def messages(user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": "TASK write. You are a research assistant."},
                {"role": "user", "content": user}]  # fmt: skip

    saga: SagaSide | None = None
    effects: StripeEffects | None = None
    if mode == "sagaguard":
        saga = SagaSide(folder)
        closers.append(saga.close)
        journal_chat = ChatJournal(saga.guard, client)
        effects = StripeEffects(saga.guard, payments)

        def ask(user: str) -> str:
            reply = journal_chat.create(model=MODEL, messages=messages(user))  # type: ignore[arg-type]
            return str(reply.choices[0].message.content)
    else:

        def ask(user: str) -> str:
            reply = client.chat.completions.create(model=MODEL, messages=messages(user))  # type: ignore[arg-type]
            return str(reply.choices[0].message.content)

    tools = [tool(method) for method in PlanTools(config["tools_url"], payments, effects, ask).all()]
    if saga is not None:
        model: Any = JournaledChatModel(inner=chat.bind_tools(tools), guard=saga.guard)
        handler = ToolGuard(saga.guard, saga=True, declare=DECLARE).wrap_tool_call
        node = ToolNode(tools, wrap_tool_call=handler, handle_tool_errors=False)
    else:
        model = chat.bind_tools(tools)
        node = ToolNode(tools, handle_tool_errors=False)

    def call_model(state: MessagesState) -> dict[str, Any]:
        answer = model.invoke([SystemMessage(INSTRUCTIONS), *state["messages"]])
        reach("model_returned")
        return {"messages": [answer]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", node)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    conn = sqlite3.connect(folder / "checkpoints.db", check_same_thread=False)
    closers.append(conn.close)
    configure(effects, config["tools_url"])
    return Built(graph.compile(checkpointer=HookedSaver(conn)), saga, closers)


def _run(built: Built, config: Mapping[str, Any]) -> tuple[str, str]:
    """One start or resume; the status and the error it met."""
    run = {"configurable": {"thread_id": THREAD}}
    graph = built.graph

    def invoke() -> None:
        saved = graph.get_state(run)
        # A run killed before its first checkpoint left nothing to resume: start it again.
        inputs = None if config["action"] == "resume" and saved.values else {
            "messages": [HumanMessage(str(config["topic"]))]
        }  # fmt: skip
        graph.invoke(inputs, run, durability="sync")

    if built.saga is None:
        try:
            invoke()
        except PublishFailed as exc:
            return "failed", str(exc)
        return "completed", ""
    try:
        with built.saga.runner.run(research_agent, THREAD):
            invoke()
    except AgentRunEnded as exc:  # it ended, or is compensating, since a killed process had it
        if exc.state != SagaState.COMPENSATING.value:
            return "ended", str(exc)
        built.saga.recover_until_ended(THREAD)
        return "recovered", str(exc)
    except PublishFailed as exc:  # the run's calls were undone on the way out of the block
        return "failed", str(exc)
    return "completed", ""


def main(mode: str, config: Mapping[str, Any]) -> int:
    """Start, resume or sweep (``action``) the failing agent once; print the JSON result line."""
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, not {mode!r}")
    folder = Path(config["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    built = build(config, mode, folder)
    try:
        if config["action"] == "worker":
            status, error = "swept", built.saga.sweep() if built.saga is not None else ""
        else:
            status, error = _run(built, config)
        saga = built.saga
        result = {
            "status": status,
            "saga": saga.state(THREAD) if saga is not None else "",
            "in_doubt": saga.in_doubt() if saga is not None else [],
            "error": error,
        }
    finally:
        built.close()
    print(json.dumps(result), flush=True)
    return 0


def _argv(argv: Sequence[str]) -> int:
    return main(argv[1], json.loads(argv[2]))


if __name__ == "__main__":
    sys.exit(_argv(sys.argv))
