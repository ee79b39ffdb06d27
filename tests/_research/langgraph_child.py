"""The LangGraph research agent, run as a child process of the sweep (``_research.sweep``).

``python tests/_research/langgraph_child.py MODE '<config json>'`` with MODE ``sagaguard`` or
``plain``; the sweep forks it instead from a zygote that imported this module
(:mod:`_research.zygote`), calling :func:`main` in a fresh child process per run, so nothing here may
start a thread or open anything at import. The graph (``StateGraph``, SQLite checkpointer,
``durability="sync"``)::

    search -> fetch (11 pages) -> summarize (11 model calls) -> cross_check (15 model calls)
           -> write (1 model call) -> pay (a Stripe charge) -> email (SMTP, inline)

Each node is one LangGraph task; a crash anywhere in it re-runs it from its first line on resume.

- ``plain``: the checkpointer alone, as LangGraph's docs recommend: the ``openai`` SDK, the
  ``stripe`` SDK (its own random idempotency key per request) and ``smtplib``.
- ``sagaguard``: the same nodes under :func:`sagaguard.connectors.frameworks.langgraph.task_scoped` (effects
  keyed on ``thread_id`` + ``checkpoint_ns`` + a per-task ordinal), model calls journaled
  (:class:`sagaguard.connectors.llm.ChatJournal`), the charge a
  :class:`sagaguard.connectors.stripe.StripeEffects` effect (provider key + reconciler), the email an
  :class:`sagaguard.connectors.email.EmailEffects` inline send (at most once: a send whose answer was lost is
  parked for an operator, never re-sent). Effects are recorded in a SQLite
  :class:`~sagaguard.idempotency.stores.sql.SqlStore` beside the checkpoints.

The config JSON: ``dir`` (checkpoints and effects live there), ``action`` (``start``: invoke with the
topic; ``resume``: ``invoke(None)`` from the last checkpoint, or from the topic when the killed run
left none), ``topic``, and the world's ``model_base_url``, ``tools_url``, ``stripe_api_base``,
``stripe_api_key``, ``smtp_host``, ``smtp_port`` (:meth:`_research.sweep.world_config`).

Kill points (:func:`_research.points.reach`; the process dies where ``$SAGAGUARD_CRASH_AT`` says):
``enter:<node>`` / ``exit:<node>`` (first line of a node / its update returned, before LangGraph
saved it), ``searched``, ``fetched#k``, ``model_answered#k`` (the k-th model answer arrived, before
anything recorded it), ``model_returned#k`` (the node holds it; journaled under sagaguard),
``charge_applied`` (Stripe answered, before any record), ``charge_returned``, ``email_sent`` (the
SMTP server accepted the message, before any record), ``email_returned``, ``writes#k`` (the
checkpointer saved a task's writes) and ``checkpoint#k`` (it saved the k-th checkpoint).

Prints one JSON line: ``report``, ``digest``, ``payment`` (the PaymentIntent id), ``email``
(``sent`` or ``in_doubt``: parked for an operator), ``status``.
"""

from __future__ import annotations

import itertools
import json
import smtplib
import sqlite3
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from email.message import EmailMessage
from pathlib import Path
from typing import Any, TypedDict

HERE = Path(__file__).resolve().parent
for entry in (HERE.parent.parent, HERE.parent):  # the project root and tests/, when run as a script
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import httpx  # noqa: E402
import openai  # noqa: E402
import stripe  # noqa: E402
from langgraph.checkpoint.sqlite import SqliteSaver  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402

from _research.points import reach  # noqa: E402
from _research.world import (  # noqa: E402
    RECIPIENT,
    REPORT_PRICE,
    SENDER,
    check_prompt,
    claims_for,
    report_digest,
    write_prompt,
)

MODES = ("sagaguard", "plain")
NODES = ("search", "fetch", "summarize", "cross_check", "write", "pay", "email")
THREAD = "research-1"
MODEL = "research-model"


class Research(TypedDict, total=False):
    """The graph's state."""

    topic: str
    urls: list[str]
    pages: list[str]
    summaries: list[str]
    verdicts: list[str]
    report: str
    payment: str
    email: str


Ask = Callable[[str, str], str]
"""``ask(task, user_message)``: one model call, its text answer."""


class HookedSaver(SqliteSaver):
    """A SqliteSaver with kill points after each saved checkpoint and each task's saved writes."""

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        saved = super().put(config, checkpoint, metadata, new_versions)
        reach("checkpoint")
        return saved

    def put_writes(
        self, config: Any, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        super().put_writes(config, writes, task_id, task_path)
        reach("writes")


class HookedRequestsClient(stripe.RequestsClient):
    """The Stripe SDK's HTTP client with a kill point once a charge request was answered."""

    def request(self, method: str, url: str, headers: Mapping[str, str] | None, post_data: Any = None) -> Any:
        answer = super().request(method, url, headers, post_data)
        if method.lower() == "post" and urllib.parse.urlsplit(url).path == "/v1/payment_intents":
            reach("charge_applied", numbered=False)
        return answer


def _on_model_response(response: httpx.Response) -> None:
    if response.request.method == "POST" and response.request.url.path.endswith("/chat/completions"):
        reach("model_answered")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


def build(config: Mapping[str, Any], mode: str, folder: Path) -> tuple[Any, Callable[[], None]]:
    """The compiled graph for ``mode`` and a function that closes what it opened."""
    client = openai.OpenAI(
        api_key="sk-local",
        base_url=config["model_base_url"],
        max_retries=0,
        http_client=httpx.Client(event_hooks={"response": [_on_model_response]}, timeout=30),
    )
    payments = stripe.StripeClient(
        config["stripe_api_key"],
        base_addresses={"api": config["stripe_api_base"]},
        max_network_retries=0,
        http_client=HookedRequestsClient(timeout=30),
    )
    tools_url = config["tools_url"]
    closers: list[Callable[[], None]] = []

    def messages(task: str, user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": f"TASK {task}. You are a research assistant."},
                {"role": "user", "content": user}]  # fmt: skip

    if mode == "sagaguard":
        from sagaguard.connectors.email import Email, EmailEffects, SmtpSettings
        from sagaguard.connectors.frameworks.langgraph import task_scoped
        from sagaguard.connectors.llm import ChatJournal
        from sagaguard.connectors.stripe import StripeEffects
        from sagaguard.idempotency import Guard
        from sagaguard.idempotency.errors import OutcomeUnknown
        from sagaguard.idempotency.stores.sql import SqlStore

        store = SqlStore(f"sqlite:///{folder / 'effects.db'}")
        # Guard's defaults, as docs/frameworks/langgraph.md shows it: a resume at once on this host
        # takes the dead process's claims over at once, no short lease needed.
        guard = Guard(store, namespace="research")
        closers += [guard.close, store.close]
        journal = ChatJournal(guard, client)

        class HookedEmail(EmailEffects):
            def _transmit(self, message: Email) -> Any:
                sent = super()._transmit(message)
                reach("email_sent", numbered=False)
                return sent

        mail = HookedEmail(guard, SmtpSettings(config["smtp_host"], int(config["smtp_port"])), sender=SENDER)
        stripe_effects = StripeEffects(guard, payments)

        def ask(task: str, user: str) -> str:
            reply = journal.create(model=MODEL, messages=messages(task, user))
            return str(reply.choices[0].message.content)

        def charge(description: str) -> str:
            return stripe_effects.charge(
                REPORT_PRICE, "usd", payment_method="pm_card_visa", description=description
            ).id

        def send(subject: str, text: str) -> str:
            try:
                mail.send_now(Email(to=[RECIPIENT], subject=subject, text=text))
            except OutcomeUnknown:  # sent or not, SMTP cannot tell: parked for an operator, not re-sent
                return "in_doubt"
            return "sent"

        wrap: Callable[[Callable[[Research], Research]], Callable[[Research], Research]] = task_scoped
    else:

        def ask(task: str, user: str) -> str:
            reply = client.chat.completions.create(model=MODEL, messages=messages(task, user))  # type: ignore[arg-type]
            return str(reply.choices[0].message.content)

        def charge(description: str) -> str:
            params = {"amount": REPORT_PRICE, "currency": "usd", "payment_method": "pm_card_visa",
                      "confirm": True, "description": description}  # fmt: skip
            return str(payments.v1.payment_intents.create(params).id)  # type: ignore[arg-type]

        def send(subject: str, text: str) -> str:
            message = EmailMessage()
            message["From"], message["To"], message["Subject"] = SENDER, RECIPIENT, subject
            message.set_content(text)
            with smtplib.SMTP(config["smtp_host"], int(config["smtp_port"]), timeout=30) as smtp:
                smtp.send_message(message)
            reach("email_sent", numbered=False)
            return "sent"

        def wrap(fn: Callable[[Research], Research]) -> Callable[[Research], Research]:
            return fn

    def node(name: str, body: Callable[[Research], Research]) -> Callable[[Research], Research]:
        def run(state: Research) -> Research:
            reach(f"enter:{name}", numbered=False)
            update = body(state)
            reach(f"exit:{name}", numbered=False)
            return update

        run.__name__ = name
        return wrap(run)

    def model(task: str, user: str) -> str:
        answer = ask(task, user)
        reach("model_returned")
        return answer

    def search(state: Research) -> Research:
        found = _get(f"{tools_url}/search?" + urllib.parse.urlencode({"q": state["topic"]}))
        reach("searched", numbered=False)
        return {"urls": [r["url"] for r in found["results"]]}

    def fetch(state: Research) -> Research:
        pages = []
        for url in state["urls"]:
            pages.append(_get(f"{tools_url}/fetch?" + urllib.parse.urlencode({"url": url}))["text"])
            reach("fetched")
        return {"pages": pages}

    def summarize(state: Research) -> Research:
        return {"summaries": [model("summarize", page) for page in state["pages"]]}

    def cross_check(state: Research) -> Research:
        return {"verdicts": [model("check", check_prompt(claim)) for claim in claims_for(state["topic"])]}

    def write(state: Research) -> Research:
        return {"report": model("write", write_prompt(state["topic"], state["summaries"], state["verdicts"]))}

    def pay(state: Research) -> Research:
        payment = charge(f"Research report {report_digest(state['report'])}")
        reach("charge_returned", numbered=False)
        return {"payment": payment}

    def email(state: Research) -> Research:
        status = send(f"Research report {report_digest(state['report'])}", state["report"])
        reach("email_returned", numbered=False)
        return {"email": status}

    bodies = {"search": search, "fetch": fetch, "summarize": summarize, "cross_check": cross_check,
              "write": write, "pay": pay, "email": email}  # fmt: skip
    graph = StateGraph(Research)
    for name in NODES:
        graph.add_node(name, node(name, bodies[name]))  # type: ignore[call-overload]
    graph.add_edge(START, NODES[0])
    for before, after in itertools.pairwise(NODES):
        graph.add_edge(before, after)
    graph.add_edge(NODES[-1], END)
    conn = sqlite3.connect(folder / "checkpoints.db", check_same_thread=False)
    closers.append(conn.close)

    def close() -> None:
        for closer in closers:
            closer()

    return graph.compile(checkpointer=HookedSaver(conn)), close


def main(mode: str, config: Mapping[str, Any]) -> int:
    """Run (or resume) the research graph once; print the JSON result line."""
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, not {mode!r}")
    folder = Path(config["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    graph, close = build(config, mode, folder)
    run = {"configurable": {"thread_id": THREAD}}
    try:
        saved = graph.get_state(run)
        # A run killed before its first checkpoint left nothing to resume: start it again.
        inputs = None if config["action"] == "resume" and saved.values else {"topic": config["topic"]}
        state = graph.invoke(inputs, run, durability="sync")
    finally:
        close()
    report = state.get("report", "")
    result = {
        "report": report,
        "digest": report_digest(report),
        "payment": state.get("payment"),
        "email": state.get("email"),
        "status": "finished" if state.get("email") else "unfinished",
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
