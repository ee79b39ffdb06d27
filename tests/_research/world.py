"""The fake world the research agents run against: a model, search and fetch, Stripe, SMTP.

::

    with ResearchWorld() as world:
        client = openai.OpenAI(api_key="sk-local", base_url=world.model_base_url)
        payments = stripe.StripeClient(world.stripe.api_key, base_addresses={"api": world.stripe.api_base})
        ...                                     # run the agent (in a child process, to SIGKILL it)
        world.counters()["charges"]             # what the world saw: the evidence survives the kill
        world.reset()                           # between runs

:class:`ResearchWorld` (context manager) starts

- the research server, in its own process (it survives a SIGKILLed agent): an OpenAI-compatible
  ``POST {model_base_url}/chat/completions`` (non-streaming, ``tools`` supported, ``store=true`` with
  ``metadata`` and ``GET .../chat/completions?metadata[k]=v`` as OpenAI's stored completions, so
  ``sagaguard.connectors.llm.ChatJournal(store_at_provider=True)`` can reconcile), ``GET
  {tools_url}/search?q=`` (``{"query", "results": [{"url", "title"}] * N_PAGES}``) and ``GET
  {tools_url}/fetch?url=`` (``{"url", "text"}``: :func:`page_text`); a review desk, ``POST
  {tools_url}/bookings`` (``{"reviewer", "slot", "reference"}`` -> ``{"booking", ...}``) and ``POST
  {tools_url}/bookings/cancel`` (``{"booking"}`` or ``{"reference"}``: every booking it names), both
  honouring an ``Idempotency-Key`` header as Stripe does (the first answer replayed to the same
  key); and a publisher that is down (``POST {tools_url}/publish`` answers 503);
- a :class:`~sagaguard.connectors.testing.LocalStripe` in its own process (``world.stripe``: ``api_key``,
  ``api_base``);
- a :class:`~sagaguard.connectors.testing.smtp.SmtpSink` in this process (``smtp_host``, ``smtp_port``;
  ``world.emails()`` lists what it accepted).

``counters()`` merges them: ``model_calls`` (answers generated: what is paid for), ``prompt_tokens``,
``completion_tokens``, ``model_calls_<task>`` per task kind, ``searches``, ``fetches``, ``charges``
(Stripe card charges), ``payment_intents``, ``refunds`` (Stripe refunds made), ``emails``,
``bookings`` (made), ``cancellations`` (cancel requests the desk carried out, replays of a key not
counted), ``cancellations_repeated`` (those of them that found every booking they named cancelled
already: an undo that reached the world twice), ``bookings_active`` (made and never cancelled),
``publishes`` (publish attempts, all refused); :meth:`ResearchWorld.left_in_place` counts what was
done and not undone (charges not fully refunded, bookings not cancelled), read off the servers.
``reset()`` forgets everything everywhere.

The model. Deterministic in content, fresh in identity (random ``chatcmpl-...`` and ``call_...`` ids,
like a real provider: an answer asked again is a new answer with new ids). What it does is selected by
the first system (or developer) message, which starts with ``TASK <kind>``; the *user message* below
is the last ``user`` message of the request:

- ``TASK summarize``: answers :func:`summary_of` (user message), the user message being the page text.
- ``TASK check``: answers :func:`verdict_of` (user message), the user message being :func:`check_prompt`.
- ``TASK write``: answers :func:`report_of` (user message), the user message being :func:`write_prompt`.
- ``TASK agent``: a tool-calling agent loop. The first user message is the topic. Each answer is the
  next step of the fixed plan, read off the tool results in the conversation so far (tool results
  are matched to the assistant's ``tool_calls`` by ``tool_call_id``; one tool call per answer):

  ============== ======================================================= ==================================
  step           tool call arguments                                     the tool must return (verbatim)
  ============== ======================================================= ==================================
  1              ``search(query=<topic>)``                               anything (the URLs are
                                                                         :func:`page_urls` (topic))
  2..12          ``fetch(url=page_urls(topic)[i])``                      the page text (:func:`page_text`)
  13..23         ``summarize(url=<url i>, text=<fetch result i>)``       the model's ``TASK summarize``
                                                                         answer for ``text``
  24..38         ``check_claim(claim=claims_for(topic)[j])``             the ``TASK check`` answer for
                                                                         ``check_prompt(claim)``
  39             ``write_report(topic=<topic>, summaries=[11 summarize   the ``TASK write`` answer for
                 results], verdicts=[15 check_claim results])``          ``write_prompt(topic, s, v)``
  40             ``pay(amount=REPORT_PRICE, currency="usd",              anything (a charge id)
                 description="Research report <digest>")``
  41             ``send_email(to=RECIPIENT, subject="Research report     anything (a message id)
                 <digest>", body=<report>)``
  42             final text :func:`final_answer` (report) (no tool call)
  ============== ======================================================= ==================================

  ``<report>`` is the ``write_report`` result and ``<digest>`` its :func:`report_digest`. The clean
  run is 42 ``TASK agent`` answers + 11 summarize + 15 check + 1 write = :data:`AGENT_MODEL_CALLS`.
- ``TASK agent_fanout``: the same plan, but steps 13..23 are one answer with the 11 ``summarize``
  calls and steps 24..38 one answer with the 15 ``check_claim`` calls, parallel tool calls (a clean
  run: 18 answers + 27 model calls in the tools = :data:`FANOUT_MODEL_CALLS`).

- ``TASK agent_failing``: the failing agent (:func:`failing_step`), one tool call per answer:
  ``search(query=<topic>)``, ``fetch(url=page_urls(topic)[0])``, ``write_report(topic=<topic>,
  summaries=[summary_of(<fetch result>)], verdicts=[])``, ``book_review(reviewer=REVIEWER,
  slot=REVIEW_SLOT, reference=<ref>)``, ``pay(amount=REPORT_PRICE, currency="usd",
  description=<ref>)``, ``publish(reference=<ref>, report=<report>)``, then the final text (never
  reached: the publisher is down, every ``POST /publish`` answers 503). ``<ref>`` is
  ``"Research report <digest>"``. :data:`FAILING_STEPS` answers, :data:`FAILING_MODEL_CALLS` model
  calls with the report's.

- anything else: answers ``"ok"``.

Usage is counted as a real server reports it: ``prompt_tokens`` is the request's messages JSON
length / 4, ``completion_tokens`` the answer's.

The content functions (:func:`page_urls`, :func:`page_text`, :func:`summary_of`, :func:`claims_for`,
:func:`check_prompt`, :func:`verdict_of`, :func:`write_prompt`, :func:`report_of`,
:func:`report_digest`) are pure, so :func:`expected_report` (topic) is the clean-run report every
variant compares with. ``python tests/_research/world.py --serve`` runs the research server alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import Any, Self

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script (the server process): import this checkout
    sys.path.insert(0, str(ROOT))

from sagaguard.connectors.testing._service import LocalService, Reply, Request, serve  # noqa: E402
from sagaguard.connectors.testing.chat_server import ChatApp  # noqa: E402
from sagaguard.connectors.testing.smtp import Received, SmtpSink  # noqa: E402
from sagaguard.connectors.testing.stripe_server import LocalStripe  # noqa: E402

__all__ = [
    "AGENT_MODEL_CALLS",
    "AGENT_STEPS",
    "CLEAN_MODEL_CALLS",
    "FAILING_MODEL_CALLS",
    "FAILING_STEPS",
    "FAILING_TOOLS",
    "FANOUT_MODEL_CALLS",
    "FANOUT_STEPS",
    "N_CLAIMS",
    "N_PAGES",
    "RECIPIENT",
    "REPORT_PRICE",
    "REVIEWER",
    "REVIEW_SLOT",
    "SENDER",
    "TOOL_NAMES",
    "TOPIC",
    "ResearchApp",
    "ResearchWorld",
    "agent_step",
    "answer",
    "check_prompt",
    "claims_for",
    "expected_report",
    "failing_report",
    "failing_step",
    "final_answer",
    "page_text",
    "page_urls",
    "report_digest",
    "report_of",
    "summary_of",
    "task_of",
    "verdict_of",
    "write_prompt",
]

N_PAGES = 11
"""Pages the search returns, fetched and summarized one model call each."""
N_CLAIMS = 15
"""Claims cross-checked, one model call each."""
TOPIC = "durable execution for AI agents"
"""The default research topic (the agents' user message)."""
REPORT_PRICE = 4900
"""What the report costs, in cents (USD)."""
RECIPIENT = "reader@example.com"
"""Who the report is emailed to."""
SENDER = "research-agent@example.com"
"""Who sends it (a suggestion; the world does not check it)."""
TOOL_NAMES = ("search", "fetch", "summarize", "check_claim", "write_report", "pay", "send_email")
"""The tool names the ``TASK agent`` model calls."""
CLEAN_MODEL_CALLS = N_PAGES + N_CLAIMS + 1
"""Model calls of a clean run of a graph that calls the model per page, per claim and for the report."""
AGENT_STEPS = 1 + N_PAGES + N_PAGES + N_CLAIMS + 1 + 1 + 1 + 1
"""``TASK agent`` answers in a clean agent-loop run (the last one is the final text)."""
AGENT_MODEL_CALLS = AGENT_STEPS + CLEAN_MODEL_CALLS
"""Model calls of a clean agent-loop run: the loop's answers plus the tools' own model calls."""
FANOUT_STEPS = AGENT_STEPS - (N_PAGES - 1) - (N_CLAIMS - 1)
"""The ``TASK agent_fanout`` plan's answers: the summaries and the checks one answer each."""
FANOUT_MODEL_CALLS = FANOUT_STEPS + CLEAN_MODEL_CALLS
"""Model calls of a clean ``TASK agent_fanout`` run."""
FAILING_TOOLS = ("search", "fetch", "write_report", "book_review", "pay", "publish")
"""The tool names the ``TASK agent_failing`` model calls, in plan order."""
FAILING_STEPS = len(FAILING_TOOLS)
"""``TASK agent_failing`` answers in a run (the plan ends at ``publish``, which always fails)."""
FAILING_MODEL_CALLS = FAILING_STEPS + 1
"""Model calls of a ``TASK agent_failing`` run: the loop's answers plus the report's."""
REVIEWER = "dr-ada@reviews.example"
"""Who the failing agent books to review the report."""
REVIEW_SLOT = "2026-12-03T10:00Z"
"""The review slot it books."""

_VOCABULARY = (
    "agent checkpoint saga compensation ledger idempotency replay crash resume journal effect "
    "lease fencing token provider webhook outbox relay retry backoff timeout durable workflow "
    "activity step node graph tool model token budget invoice charge refund email report claim "
    "evidence latency throughput consistency isolation recovery operator signal deadline"
)
_WORDS = tuple(_VOCABULARY.split())


# ---------------------------------------------------------------------------------- the content


def _h(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "topic"


def page_urls(query: str) -> list[str]:
    """The :data:`N_PAGES` result URLs of a search for ``query``, in order."""
    return [f"https://papers.example/{_slug(query)}/p{i:02d}" for i in range(1, N_PAGES + 1)]


def page_text(url: str) -> str:
    """The text ``/fetch`` serves for ``url``: a title line and some deterministic prose."""
    digest = _h(url)
    words = [_WORDS[int(digest[i : i + 2], 16) % len(_WORDS)] for i in range(0, 64, 2)]
    sentences = [" ".join(words[i : i + 8]).capitalize() + "." for i in range(0, len(words), 8)]
    return f"Page {url}\n" + " ".join(sentences)


def summary_of(text: str) -> str:
    """The ``TASK summarize`` answer for a page text."""
    title = text.splitlines()[0] if text else ""
    words = sorted(set(re.findall(r"[a-z]+", text.lower())) & set(_WORDS))[:6]
    return f"Summary of {title.removeprefix('Page ')}: {', '.join(words)} [{_h(text)[:8]}]"


def claims_for(topic: str) -> list[str]:
    """The :data:`N_CLAIMS` claims to cross-check for ``topic``, in order."""
    return [
        f"Claim {j + 1}: {topic} needs {_WORDS[int(_h(f'{topic}/{j}')[:4], 16) % len(_WORDS)]}"
        for j in range(N_CLAIMS)
    ]


def check_prompt(claim: str) -> str:
    """The ``TASK check`` user message for ``claim``."""
    return f"Check this claim against the literature: {claim}"


def verdict_of(prompt: str) -> str:
    """The ``TASK check`` answer for a :func:`check_prompt`."""
    labels = ("SUPPORTED", "REFUTED", "UNCLEAR")
    claim = prompt.removeprefix("Check this claim against the literature: ")
    return f"{labels[int(_h(prompt)[:2], 16) % 3]}: {claim}"


def write_prompt(topic: str, summaries: Sequence[str], verdicts: Sequence[str]) -> str:
    """The ``TASK write`` user message."""
    return "\n".join(
        [f"TOPIC: {topic}", "SUMMARIES:", *summaries, "VERDICTS:", *verdicts, "Write the report."]
    )


def report_of(prompt: str) -> str:
    """The ``TASK write`` answer (the report) for a :func:`write_prompt`."""
    lines = prompt.splitlines()
    topic = lines[0].removeprefix("TOPIC: ") if lines else ""
    cut = lines.index("VERDICTS:") if "VERDICTS:" in lines else len(lines)
    summaries = [line for line in lines[2:cut]]
    verdicts = [line for line in lines[cut + 1 :] if line != "Write the report."]
    supported = sum(v.startswith("SUPPORTED") for v in verdicts)
    return "\n".join(
        [
            f"# Research report: {topic}",
            f"Sources: {len(summaries)}. Claims checked: {len(verdicts)}, {supported} supported.",
            "## Findings",
            *(f"- {s}" for s in summaries),
            "## Claims",
            *(f"- {v}" for v in verdicts),
            f"Evidence digest: {_h(prompt)[:16]}",
        ]
    )


def report_digest(report: str) -> str:
    """A short digest of a report (16 hex digits)."""
    return _h(report)[:16]


def final_answer(report: str) -> str:
    """The ``TASK agent`` final text once the report was written, paid and emailed."""
    return f"Done: report {report_digest(report)} written, paid for and emailed to {RECIPIENT}."


def expected_report(topic: str = TOPIC) -> str:
    """The report of a clean run: what every variant's final report must equal."""
    summaries = [summary_of(page_text(url)) for url in page_urls(topic)]
    verdicts = [verdict_of(check_prompt(claim)) for claim in claims_for(topic)]
    return report_of(write_prompt(topic, summaries, verdicts))


# ------------------------------------------------------------------------------------- the model


def _text(content: Any) -> str:
    """A message's content as text (a string, or a list of ``{"type": "text", "text": ...}`` parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _call(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _conversation(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[str]
) -> tuple[str, dict[str, list[str]]]:
    """The topic (the first user message) and, per tool name, the results of its calls so far (tool
    results matched to the assistant's ``tool_calls`` by ``tool_call_id``), in order."""
    users = [_text(m.get("content")) for m in messages if m.get("role") == "user"]
    topic = users[0].strip() if users else TOPIC
    names: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls") or ():
            names[str(call.get("id"))] = str(call.get("function", {}).get("name"))
    results: dict[str, list[str]] = {name: [] for name in tools}
    for m in messages:
        if m.get("role") == "tool":
            name = names.get(str(m.get("tool_call_id")), "")
            results.setdefault(name, []).append(_text(m.get("content")))
    return topic, results


def agent_step(messages: Sequence[Mapping[str, Any]], *, fan_out: bool = False) -> dict[str, Any]:
    """The ``TASK agent`` answer (an assistant message) for a conversation: the plan's next step.

    With ``fan_out`` (``TASK agent_fanout``), the summaries and the claim checks are each asked for
    in one answer, as parallel tool calls (every one still to do), instead of one per answer.
    """
    topic, results = _conversation(messages, TOOL_NAMES)
    urls, claims = page_urls(topic), claims_for(topic)
    done = {name: len(found) for name, found in results.items()}
    call: dict[str, Any] | None = None
    if done["search"] == 0:
        call = _call("search", {"query": topic})
    elif done["fetch"] < N_PAGES:
        call = _call("fetch", {"url": urls[done["fetch"]]})
    elif done["summarize"] < N_PAGES:
        todo = range(done["summarize"], N_PAGES if fan_out else done["summarize"] + 1)
        calls = [_call("summarize", {"url": urls[i], "text": results["fetch"][i]}) for i in todo]
        return {"role": "assistant", "content": None, "tool_calls": calls}
    elif done["check_claim"] < N_CLAIMS:
        todo = range(done["check_claim"], N_CLAIMS if fan_out else done["check_claim"] + 1)
        calls = [_call("check_claim", {"claim": claims[j]}) for j in todo]
        return {"role": "assistant", "content": None, "tool_calls": calls}
    elif done["write_report"] == 0:
        summaries, verdicts = results["summarize"][:N_PAGES], results["check_claim"][:N_CLAIMS]
        call = _call("write_report", {"topic": topic, "summaries": summaries, "verdicts": verdicts})
    else:
        report = results["write_report"][0]
        digest = report_digest(report)
        if done["pay"] == 0:
            pay = {"amount": REPORT_PRICE, "currency": "usd", "description": f"Research report {digest}"}
            call = _call("pay", pay)
        elif done["send_email"] == 0:
            args = {"to": RECIPIENT, "subject": f"Research report {digest}", "body": report}
            call = _call("send_email", args)
        else:
            return {"role": "assistant", "content": final_answer(report)}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def failing_report(topic: str = TOPIC) -> str:
    """The report the ``TASK agent_failing`` plan writes (from the first page only)."""
    return report_of(write_prompt(topic, [summary_of(page_text(page_urls(topic)[0]))], []))


def failing_step(messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``TASK agent_failing`` answer for a conversation: the next step of its plan (the module
    docstring), read off the tool results so far as :func:`agent_step` does."""
    topic, results = _conversation(messages, FAILING_TOOLS)
    if not results["search"]:
        return _ask("search", {"query": topic})
    if not results["fetch"]:
        return _ask("fetch", {"url": page_urls(topic)[0]})
    if not results["write_report"]:
        summaries = [summary_of(results["fetch"][0])]
        return _ask("write_report", {"topic": topic, "summaries": summaries, "verdicts": []})
    report = results["write_report"][0]
    reference = f"Research report {report_digest(report)}"
    if not results["book_review"]:
        return _ask("book_review", {"reviewer": REVIEWER, "slot": REVIEW_SLOT, "reference": reference})
    if not results["pay"]:
        return _ask("pay", {"amount": REPORT_PRICE, "currency": "usd", "description": reference})
    if not results["publish"]:
        return _ask("publish", {"reference": reference, "report": report})
    return {"role": "assistant", "content": f"Done: report {report_digest(report)} published."}


def _ask(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [_call(name, arguments)]}


def task_of(messages: Sequence[Mapping[str, Any]]) -> str:
    """The task kind named by the first system/developer message (``"TASK agent ..."`` -> ``agent``)."""
    for m in messages:
        if m.get("role") in ("system", "developer"):
            found = re.match(r"\s*TASK\s+(\w+)", _text(m.get("content")))
            return found.group(1) if found else ""
    return ""


def answer(messages: Sequence[Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The task kind and the assistant message the model answers ``messages`` with."""
    task = task_of(messages)
    users = [_text(m.get("content")) for m in messages if m.get("role") == "user"]
    last = users[-1] if users else ""
    if task in ("agent", "agent_fanout"):
        return task, agent_step(messages, fan_out=task == "agent_fanout")
    if task == "agent_failing":
        return task, failing_step(messages)
    pure = {"summarize": summary_of, "check": verdict_of, "write": report_of}
    content = pure[task](last) if task in pure else "ok"
    return task, {"role": "assistant", "content": content}


_planned = answer  # the module's answer, for the method of the same name below


class ResearchApp(ChatApp):
    """The research server: the :class:`ChatApp` protocol with the research model, plus search/fetch,
    the review desk (bookings) and the publisher (down)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.bookings: dict[str, dict[str, Any]] = {}
        self.keys: dict[str, Reply] = {}

    def reset(self) -> None:
        super().reset()
        self.bookings.clear()
        self.keys.clear()

    def counters(self) -> dict[str, int]:
        with self.lock:
            found = dict(self.count)
            found["bookings_active"] = sum(not b["cancelled"] for b in self.bookings.values())
        return found

    def _desk(self, request: Request) -> Reply:
        """``POST /bookings`` and ``POST /bookings/cancel``: the first answer to an
        ``Idempotency-Key`` is kept and replayed to the same key, as Stripe does."""
        try:
            body = json.loads(request.body or b"{}")
        except ValueError:
            return Reply(HTTPStatus.BAD_REQUEST, {"error": "the body is not JSON"})
        key = request.headers.get("idempotency-key")
        with self.lock:
            if key and key in self.keys:
                self._inc("desk_replays")
                return self.keys[key]
            reply = self._book(body) if request.path == "/bookings" else self._cancel(body)
            if key and reply.status == HTTPStatus.OK:
                self.keys[key] = reply
            return reply

    def _book(self, body: Mapping[str, Any]) -> Reply:
        if not body.get("reviewer") or not body.get("slot"):
            return Reply(HTTPStatus.BAD_REQUEST, {"error": "reviewer and slot are required"})
        booking = {
            "booking": f"bk_{uuid.uuid4().hex[:16]}",
            "reviewer": str(body["reviewer"]),
            "slot": str(body["slot"]),
            "reference": str(body.get("reference") or ""),
            "cancelled": 0,
        }
        self.bookings[booking["booking"]] = booking
        self._inc("bookings")
        return Reply(HTTPStatus.OK, {k: v for k, v in booking.items() if k != "cancelled"})

    def _cancel(self, body: Mapping[str, Any]) -> Reply:
        if body.get("booking"):
            named = [b for b in self.bookings.values() if b["booking"] == body["booking"]]
        elif body.get("reference"):
            named = [b for b in self.bookings.values() if b["reference"] == body["reference"]]
        else:
            return Reply(HTTPStatus.BAD_REQUEST, {"error": "booking or reference is required"})
        if named:
            self._inc("cancellations")
            if all(b["cancelled"] for b in named):
                self._inc("cancellations_repeated")
            for b in named:
                b["cancelled"] += 1
        return Reply(HTTPStatus.OK, {"cancelled": [b["booking"] for b in named]})

    def handle(self, request: Request) -> Reply:
        if request.method == "POST" and request.path in ("/bookings", "/bookings/cancel"):
            with self.lock:
                self._inc("requests")
            return self._desk(request)
        if request.method == "POST" and request.path == "/publish":
            with self.lock:
                self._inc("requests")
                self._inc("publishes")
            return Reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "the publisher is down"})
        if request.method == "GET" and request.path in ("/search", "/fetch"):
            params = dict(urllib.parse.parse_qsl(request.query))
            with self.lock:
                self._inc("requests")
                self._inc("searches" if request.path == "/search" else "fetches")
            if request.path == "/search":
                query = params.get("q", "")
                results = [{"url": u, "title": f"{query} ({i + 1})"} for i, u in enumerate(page_urls(query))]
                return Reply(HTTPStatus.OK, {"query": query, "results": results})
            url = params.get("url", "")
            if not url:
                return Reply(HTTPStatus.BAD_REQUEST, {"error": "url is required"})
            return Reply(HTTPStatus.OK, {"url": url, "text": page_text(url)})
        return super().handle(request)

    def answer(self, body: Mapping[str, Any], messages: list[Any]) -> tuple[dict[str, Any], str | None]:
        """The planned answer (:func:`answer`), counted under its task (``completions_search``, ...)."""
        task, message = _planned(messages)
        return message, task or "other"


# ------------------------------------------------------------------------------------ the world


class _ResearchService(LocalService):
    """The research server in its own process (this file run as a script)."""

    def __init__(self) -> None:
        super().__init__("research")

    def command(self) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--serve"]


class ResearchWorld:
    """The research server, a local Stripe (both in their own processes) and an SMTP sink (here).

    Attributes:
        model_base_url: ``openai.OpenAI(base_url=...)`` (ends in ``/v1``).
        tools_url: base of ``/search`` and ``/fetch``.
        stripe: the :class:`LocalStripe` (``api_key``, ``api_base``).
        smtp_host: the SMTP sink's host.
        smtp_port: the SMTP sink's port.
    """

    def __init__(self) -> None:
        self.research = _ResearchService()
        self.stripe = LocalStripe()
        self.smtp = SmtpSink()

    @property
    def model_base_url(self) -> str:
        return self.research.url + "/v1"

    @property
    def tools_url(self) -> str:
        return self.research.url

    @property
    def smtp_host(self) -> str:
        return self.smtp.host

    @property
    def smtp_port(self) -> int:
        return self.smtp.port

    def start(self) -> Self:
        """Start the three servers. Returns self."""
        try:
            self.research.start()
            self.stripe.start()
            self.smtp.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop them. Idempotent."""
        with contextlib.suppress(Exception):
            self.smtp.stop()
        self.stripe.stop()
        self.research.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def counters(self) -> dict[str, int]:
        """What the world counted (see the module docstring for the names)."""
        research = self.research.counters()
        stripe = self.stripe.counters()
        found = {
            "model_calls": research.get("completions", 0),
            "prompt_tokens": research.get("prompt_tokens", 0),
            "completion_tokens": research.get("completion_tokens", 0),
            "searches": research.get("searches", 0),
            "fetches": research.get("fetches", 0),
            "stored_completions": research.get("stored", 0),
            "charges": stripe.get("charges", 0),
            "payment_intents": stripe.get("payment_intents", 0),
            "refunds": stripe.get("refunds", 0),
            "emails": self.smtp.count(),
        }
        for name in ("bookings", "cancellations", "cancellations_repeated", "bookings_active", "publishes"):
            found[name] = research.get(name, 0)
        for name, value in research.items():
            if name.startswith("completions_"):
                found["model_calls_" + name.removeprefix("completions_")] = value
        return found

    def left_in_place(self) -> dict[str, int]:
        """What was done and not undone, read off the servers: ``charges`` (succeeded PaymentIntents
        not fully refunded, listed from the local Stripe) and ``bookings`` (never cancelled)."""
        intents = self._stripe_list("/v1/payment_intents")
        refunded: dict[str, int] = {}
        for refund in self._stripe_list("/v1/refunds"):
            refunded[refund["payment_intent"]] = refunded.get(refund["payment_intent"], 0) + refund["amount"]
        charges = sum(
            i["status"] == "succeeded" and refunded.get(i["id"], 0) < i["amount_received"] for i in intents
        )
        return {"charges": charges, "bookings": self.research.counters().get("bookings_active", 0)}

    def _stripe_list(self, path: str) -> list[dict[str, Any]]:
        """Every object of a Stripe list endpoint (pages of 100)."""
        found: list[dict[str, Any]] = []
        params = {"limit": "100"}
        while True:
            request = urllib.request.Request(
                f"{self.stripe.api_base}{path}?{urllib.parse.urlencode(params)}",
                headers={"Authorization": f"Bearer {self.stripe.api_key}"},
            )
            with urllib.request.urlopen(request, timeout=30) as answer:
                page = json.loads(answer.read())
            found += page["data"]
            if not page.get("has_more") or not page["data"]:
                return found
            params["starting_after"] = page["data"][-1]["id"]

    def emails(self) -> list[Received]:
        """The messages the SMTP sink accepted, oldest first."""
        return self.smtp.messages

    def reset(self) -> None:
        """Forget every completion, counter, charge, key and email."""
        self.research.reset()
        self.stripe.reset()
        self.smtp.reset()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve(ResearchApp({}), exit_on_stdin_eof=True)
    else:
        sys.exit("usage: python tests/_research/world.py --serve")
