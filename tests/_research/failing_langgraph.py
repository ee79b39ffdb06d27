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
- ``sagaguard``: an agent saga (:mod:`saga.agent`). The model is journaled
  (:class:`connectors.langgraph.JournaledChatModel`, so a resumed run's tool calls keep their ids),
  the ``ToolNode``'s handler is :class:`connectors.langgraph_saga.SagaTools` with
  ``inner=ToolGuard(guard)``: ``book_review`` is declared ``changes_world(undo="cancel_review")`` and
  ``pay`` ``changes_world(undo="refund")`` (both ``policy="at_least_once"``: what they do inside is
  guarded on its own, the booking by the desk's ``Idempotency-Key``, the charge as a
  :class:`connectors.stripe.StripeEffects` effect with its reconciler), the read-only tools run
  through the ``ToolGuard`` (the report's model call journaled with
  :class:`connectors.llm.ChatJournal`). The run is opened with ``AgentRunner.run(research_agent,
  THREAD)`` around ``graph.invoke``; ``publish`` raises, the run's saga compensates: the charge is
  refunded (``StripeEffects.refund``, a guarded effect with its reconciler), the booking cancelled
  (the desk's ``Idempotency-Key`` from the undo's own effect), each undo a guarded effect of its own.

The config JSON: ``dir`` (checkpoints, effects and the saga journal live there), ``action``:

- ``start``: invoke with the topic;
- ``resume``: a fresh process after a kill: open the run again and ``invoke(None)`` from the last
  checkpoint (from the topic when the killed run left none); a run that ended meanwhile is reported
  as it is; a run killed in its compensation (``AgentRunEnded``: compensating) is finished here
  through the worker API (:func:`saga.recovery.recover`, once the dead process's lease ran out);
- ``worker``: one sweep of the worker API over the journal (:func:`saga.recovery.recover`), as
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
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for entry in (HERE.parent.parent, HERE.parent):  # the project root and tests/, when run as a script
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import httpx  # noqa: E402
import openai  # noqa: E402
import stripe  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.checkpoint.sqlite import SqliteSaver  # noqa: E402
from langgraph.graph import START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import ToolNode, tools_condition  # noqa: E402

from _research.points import reach  # noqa: E402
from _research.world import write_prompt  # noqa: E402
from connectors.declare import changes_world  # noqa: E402
from connectors.langgraph import JournaledChatModel, ToolGuard  # noqa: E402
from connectors.langgraph_saga import SagaTools  # noqa: E402
from connectors.llm import ChatJournal  # noqa: E402
from connectors.stripe import StripeEffects  # noqa: E402
from idempotency import Guard, current_effect, scope  # noqa: E402
from idempotency.records import Record, State  # noqa: E402
from idempotency.stores.sql import SqlStore  # noqa: E402
from saga import SagaRegistry, SagaState, recover  # noqa: E402
from saga.agent import AgentRunEnded, AgentRunner, AgentSaga, UndoRegistry  # noqa: E402
from saga.journals.sql import SqlJournal  # noqa: E402
from saga.records import Phase, SagaRecord  # noqa: E402

MODES = ("sagaguard", "plain")
THREAD = "research-failing-1"
"""The graph's ``thread_id``, and the agent run's saga id."""
MODEL = "research-model"
INSTRUCTIONS = (
    "TASK agent_failing. You are a research agent: search, fetch the first page, write the report, "
    "book a reviewer, pay for the report and publish it."
)
LEASE = 2.0
"""The agent runs' saga lease (``AgentRunner(lease=...)``; 30 s by default): how long after a kill
in the middle of a compensation the worker can take the run over. Shortened so the sweep's
kills in compensations each wait 2 s rather than 30; the effects' claims keep Guard's defaults."""
RECOVER_FOR = 60.0
"""Seconds a resume waits for a killed compensation's lease to run out before it gives up."""

undos = UndoRegistry()
research_agent = AgentSaga("research_agent", undos)
registry = SagaRegistry(research_agent)
"""What the worker is given (``sagaguard sagas worker --app _research.failing_langgraph:registry``)."""

_clients: dict[str, Any] = {}
"""The undos' clients, set by :func:`main` for the run (each run is a fresh process)."""


class PublishFailed(RuntimeError):
    """The publisher refused the report: the agent's run fails here."""


# ---------------------------------------------------------------------------------- the undos


@undos.register
def refund(arguments: Any, result: Any | None) -> None:
    """Refund the charge ``pay`` made: by its PaymentIntent id when the call's output is recorded,
    else every succeeded PaymentIntent with the call's description (what its arguments say)."""
    reach("enter:undo:refund", numbered=False)
    payments: StripeEffects = _clients["payments"]
    if isinstance(result, str) and result.startswith("pi_"):
        payments.refund(result)
    else:
        listed = payments.client.v1.payment_intents.list({"limit": 100})
        for intent in listed.data:
            if intent.description == arguments["description"] and intent.status == "succeeded":
                payments.refund(intent.id)
    reach("undone:refund", numbered=False)


@undos.register
def cancel_review(arguments: Any, result: Any | None) -> None:
    """Cancel the booking ``book_review`` made: by its id when the call's output is recorded, else
    by the reference it was booked under. The desk's ``Idempotency-Key`` is the undo effect's own,
    so a cancellation sent again after a crash is the same request."""
    reach("enter:undo:cancel_review", numbered=False)
    booking = result.get("booking") if isinstance(result, dict) else None
    body = {"booking": booking} if booking else {"reference": arguments["reference"]}
    _post(f"{_clients['tools_url']}/bookings/cancel", body, current_effect().provider_key)
    reach("cancel_applied", numbered=False)
    reach("undone:cancel_review", numbered=False)


# ----------------------------------------------------------------------------------- plumbing


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


def _post(url: str, body: Mapping[str, Any], key: str | None = None) -> Any:
    headers = {"Content-Type": "application/json", **({"Idempotency-Key": key} if key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


class HookedSaver(SqliteSaver):
    """A SqliteSaver with a kill point after each saved checkpoint."""

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        saved = super().put(config, checkpoint, metadata, new_versions)
        reach("checkpoint")
        return saved


class HookedStore(SqlStore):
    """The effect store with a kill point after each recorded outcome, named by its effect."""

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        record = super().complete(key, token, result, retention)
        reach(f"recorded:{record.name}")
        return record


class HookedJournal(SqlJournal):
    """The saga journal with a kill point after each commit that writes a step or a state (lease
    renewals alone, which come on the renewer's clock, are not numbered)."""

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        record = super().commit(saga_id, token, phase)
        if phase.steps or phase.state is not None:
            reach("saga_commit")
        return record


class HookedRequestsClient(stripe.RequestsClient):
    """The Stripe SDK's HTTP client with kill points once a charge or a refund was answered."""

    def request(self, method: str, url: str, headers: Mapping[str, str] | None, post_data: Any = None) -> Any:
        answer = super().request(method, url, headers, post_data)
        path = urllib.parse.urlsplit(url).path
        if method.lower() == "post" and path in ("/v1/payment_intents", "/v1/refunds"):
            reach("charge_applied" if path == "/v1/payment_intents" else "refund_applied", numbered=False)
        return answer


def _on_model_response(response: httpx.Response) -> None:
    if response.request.method == "POST" and response.request.url.path.endswith("/chat/completions"):
        reach("model_answered")


# ------------------------------------------------------------------------------------ the agent


class Built:
    """The compiled graph and what the run needs, for one mode."""

    def __init__(self, graph: Any, closers: list[Callable[[], None]]) -> None:
        self.graph = graph
        self.closers = closers
        self.runner: AgentRunner | None = None
        self.journal: SqlJournal | None = None
        self.guard: Guard | None = None
        self.store: SqlStore | None = None

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def _tools(
    mode: str,
    config: Mapping[str, Any],
    payments: Any,
    effects: StripeEffects | None,
    ask: Callable[[str], str],
) -> list[Any]:
    """The six tools of the plan: ``effects`` (sagaguard) charges as a guarded effect, else the
    plain ``payments`` client does."""
    tools_url = config["tools_url"]
    guarded = mode == "sagaguard"

    @tool
    def search(query: str) -> str:
        """Search the literature; returns the result URLs, one a line."""
        reach("enter:search", numbered=False)
        found = _get(f"{tools_url}/search?" + urllib.parse.urlencode({"q": query}))
        reach("searched", numbered=False)
        return "\n".join(r["url"] for r in found["results"])

    @tool
    def fetch(url: str) -> str:
        """Fetch a page; returns its text."""
        reach("enter:fetch", numbered=False)
        text = str(_get(f"{tools_url}/fetch?" + urllib.parse.urlencode({"url": url}))["text"])
        reach("fetched", numbered=False)
        return text

    @tool
    def write_report(topic: str, summaries: list[str], verdicts: list[str]) -> str:
        """Write the report from the summaries and the verdicts."""
        reach("enter:write_report", numbered=False)
        report = ask(write_prompt(topic, summaries, verdicts))
        reach("exit:write_report", numbered=False)
        return report

    @tool
    @changes_world(undo="cancel_review", policy="at_least_once")
    def book_review(reviewer: str, slot: str, reference: str) -> dict[str, Any]:
        """Book a reviewer for the report; returns the booking."""
        reach("enter:book_review", numbered=False)
        # The tool call's own effect key names the booking: a call run again after a crash sends
        # the same Idempotency-Key, and the desk answers with the first booking.
        key = current_effect().provider_key if guarded else None
        booking = dict(_post(f"{tools_url}/bookings", {"reviewer": reviewer, "slot": slot,
                                                        "reference": reference}, key))  # fmt: skip
        reach("booked", numbered=False)
        return booking

    @tool
    @changes_world(undo="refund", policy="at_least_once")
    def pay(amount: int, currency: str, description: str) -> str:
        """Pay for the report (amount in cents); returns the payment id."""
        reach("enter:pay", numbered=False)
        if effects is not None:
            with scope(current_effect().key):  # the charge is keyed on the tool call
                charged = effects.charge(
                    amount, currency, payment_method="pm_card_visa", description=description
                )
            paid = charged.id
        else:
            params = {"amount": amount, "currency": currency, "payment_method": "pm_card_visa",
                      "confirm": True, "description": description}  # fmt: skip
            paid = str(payments.v1.payment_intents.create(params).id)
        reach("exit:pay", numbered=False)
        return paid

    @tool
    def publish(reference: str, report: str) -> str:
        """Publish the report."""
        reach("enter:publish", numbered=False)
        try:
            _post(f"{tools_url}/publish", {"reference": reference, "report": report})
        except urllib.error.HTTPError as exc:
            raise PublishFailed(f"the publisher refused {reference!r}: HTTP {exc.code}") from None
        return "published"

    return [search, fetch, write_report, book_review, pay, publish]


def build(config: Mapping[str, Any], mode: str, folder: Path) -> Built:
    """The compiled agent graph for ``mode`` and what its run needs."""
    chat = ChatOpenAI(
        model=MODEL, api_key="sk-local", base_url=config["model_base_url"], max_retries=0,  # type: ignore[arg-type]
        http_client=httpx.Client(event_hooks={"response": [_on_model_response]}, timeout=30),
    )  # fmt: skip
    payments = stripe.StripeClient(
        config["stripe_api_key"],
        base_addresses={"api": config["stripe_api_base"]},
        max_network_retries=0,
        http_client=HookedRequestsClient(timeout=30),
    )
    client = openai.OpenAI(
        api_key="sk-local", base_url=config["model_base_url"], max_retries=0,
        http_client=httpx.Client(event_hooks={"response": [_on_model_response]}, timeout=30),
    )  # fmt: skip
    closers: list[Callable[[], None]] = [client.close]

    def messages(user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": "TASK write. You are a research assistant."},
                {"role": "user", "content": user}]  # fmt: skip

    guard: Guard | None = None
    store: SqlStore | None = None
    effects: StripeEffects | None = None
    if mode == "sagaguard":
        store = HookedStore(f"sqlite:///{folder / 'effects.db'}")
        guard = Guard(store, namespace="research")  # Guard's defaults, as the framework pages show it
        closers += [store.close, guard.close]
        journal_chat = ChatJournal(guard, client)
        effects = StripeEffects(guard, payments)

        def ask(user: str) -> str:
            return str(journal_chat.create(model=MODEL, messages=messages(user)).choices[0].message.content)  # type: ignore[arg-type]
    else:

        def ask(user: str) -> str:
            reply = client.chat.completions.create(model=MODEL, messages=messages(user))  # type: ignore[arg-type]
            return str(reply.choices[0].message.content)

    tools = _tools(mode, config, payments, effects, ask)
    if guard is not None:
        model: Any = JournaledChatModel(inner=chat.bind_tools(tools), guard=guard)
        handler = SagaTools(inner=ToolGuard(guard)).wrap_tool_call
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
    built = Built(graph.compile(checkpointer=HookedSaver(conn)), closers)
    _clients.update(payments=effects, tools_url=config["tools_url"])
    if guard is not None:
        journal = HookedJournal(f"sqlite:///{folder / 'sagas.db'}")
        built.runner = AgentRunner(journal, guard, lease=LEASE)
        built.journal, built.guard, built.store = journal, guard, store
        closers += [journal.close, built.runner.close]
    return built


def _saga_state(built: Built) -> str:
    if built.journal is None:
        return ""
    found = built.journal.load(THREAD)
    return "" if found is None else found.saga.state.value


def _in_doubt(built: Built) -> list[str]:
    if built.store is None:
        return []
    return sorted(r.name for r in built.store.list(states=[State.IN_DOUBT], limit=1000))


def _recover_until_ended(built: Built) -> None:
    """The worker API, until the run's compensation is no longer held by the dead process: a
    sweep claims it once its lease ran out (:data:`LEASE`), and finishes it."""
    assert built.journal is not None and built.guard is not None
    deadline = time.monotonic() + RECOVER_FOR
    while time.monotonic() < deadline:
        recover(built.journal, built.guard, registry, lease=LEASE)
        if _saga_state(built) not in (SagaState.RUNNING.value, SagaState.COMPENSATING.value):
            return
        time.sleep(0.1)  # the dead process's saga lease has not run out yet


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

    if built.runner is None:
        try:
            invoke()
        except PublishFailed as exc:
            return "failed", str(exc)
        return "completed", ""
    try:
        with built.runner.run(research_agent, THREAD):
            invoke()
    except AgentRunEnded as exc:  # it ended, or is compensating, since a killed process had it
        if exc.state != SagaState.COMPENSATING.value:
            return "ended", str(exc)
        _recover_until_ended(built)
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
            if built.journal is not None and built.guard is not None:
                report = recover(built.journal, built.guard, registry, lease=LEASE)
                status, error = "swept", json.dumps(dict(report.errors))
            else:
                status, error = "swept", ""
        else:
            status, error = _run(built, config)
        result = {"status": status, "saga": _saga_state(built), "in_doubt": _in_doubt(built), "error": error}
    finally:
        built.close()
    print(json.dumps(result), flush=True)
    return 0


def _argv(argv: Sequence[str]) -> int:
    return main(argv[1], json.loads(argv[2]))


if __name__ == "__main__":
    sys.exit(_argv(sys.argv))
