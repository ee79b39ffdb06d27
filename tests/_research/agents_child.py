"""The research agent on the OpenAI Agents SDK, run as a child process of the sweep (``_research.sweep``).

``python tests/_research/agents_child.py MODE '<config json>'`` with MODE ``sagaguard``, ``plain`` or
``fanout`` (``sagaguard`` with the world's fan-out plan, ``TASK agent_fanout``: the summaries and the
claim checks asked for as parallel tool calls, so their model calls are in flight at once).
One ``Agent`` (model: ``OpenAIChatCompletionsModel`` against the world, system prompt ``TASK agent``)
with seven function tools, driven by the world's fixed plan (:func:`_research.world.agent_step`, one
tool call per answer)::

    search -> fetch x11 -> summarize x11 -> check_claim x15 -> write_report -> pay -> send_email -> text

``summarize``, ``check_claim`` and ``write_report`` call the model themselves (``TASK summarize``,
``TASK check``, ``TASK write``), so a clean run pays :data:`~_research.world.AGENT_MODEL_CALLS` model
calls (42 for the loop, 27 in the tools). The conversation lives in an ``SQLiteSession``, which the
SDK writes to after each step of the loop (the model's answer and the tool outputs of that step, once
the tools finished), so a fresh process can go on from it.

- ``plain``: the SDK alone with its session, as its docs recommend: plain tools (``urllib``, the
  ``openai`` SDK, the ``stripe`` SDK with its own random idempotency key per request, ``smtplib``);
  the resume runs the agent on the session with no new input, so the model continues from the last
  saved step (a session that already ends with the agent's final text is a finished run: the
  resume calls nothing, :func:`final_text`).
- ``sagaguard``: the same agent wrapped by :class:`sagaguard.connectors.frameworks.openai_agents.AgentRun`
  under the run key :data:`RUN_KEY`: loop model calls journaled (run key + model-call ordinal), every tool a
  guarded effect (run key + ``tool_call_id``). A tool's body runs in the scope of its effect, so
  what it does inside is keyed on the tool call too: its model call is journaled
  (:class:`sagaguard.connectors.llm.ChatJournal`), the charge is a
  :class:`sagaguard.connectors.stripe.StripeEffects` effect (provider key + reconciler), the email an
  :class:`sagaguard.connectors.email.EmailEffects` inline send (at most once: a send whose answer was lost is
  parked for an operator, ``"in_doubt"``, never re-sent). Every world-changing call inside a tool is guarded,
  so the tools themselves are ``at_least_once``: a tool left in doubt by a crash runs its body again and each
  inner effect replays or settles itself. The resume goes on from the session like ``plain`` and continues the
  model-call ordinals after the answers the session holds (:func:`answers_in`): the answer the
  session had not saved is then the same call (same ordinal, same input), replayed from the journal
  with its ``tool_call_id`` when it was recorded (so its tool finds its record), asked again when it
  was still in flight. Effects are recorded in a SQLite :class:`~sagaguard.idempotency.stores.sql.SqlStore`
  beside the session.

The config JSON: ``dir`` (session and effects live there), ``action`` (``start``: run the topic;
``resume``: go on from the session, or start when the killed run saved nothing), ``topic``, and the
world's ``model_base_url``, ``tools_url``, ``stripe_api_base``, ``stripe_api_key``, ``smtp_host``,
``smtp_port`` (:func:`_research.sweep.world_config`).

Kill points (:func:`_research.points.reach`; the process dies where ``$SAGAGUARD_CRASH_AT`` says),
named as in the LangGraph child where they mean the same:

- ``model_answered#k``: the k-th model answer (loop or tool) arrived, before anything recorded it;
- ``model_returned#k``: the k-th model answer was handed back (journaled under sagaguard): to the
  SDK's loop, or to the tool that asked;
- ``body:<tool>#k``: the first line of the k-th run of the tool's body (claimed under sagaguard, not
  run yet); the first run also reaches ``enter:<tool>``, which starts the tool's phase in the
  sweep's per-step table (:meth:`_research.sweep.SweepResult.phase`);
- ``searched``, ``fetched#k``, ``charge_applied`` (Stripe answered, before any record),
  ``email_sent`` (the SMTP server accepted the message, before any record);
- ``exit:<tool>#k``: the SDK holds the tool's output (recorded under sagaguard), before the session
  saved the step;
- ``session_saved#k``: the session saved its k-th batch (the input, then one per step).

Prints one JSON line: ``report`` (the ``write_report`` output in the session), ``digest``,
``payment`` (the ``pay`` output), ``email`` (``sent`` or ``in_doubt``), ``final`` (the agent's final
text), ``paid`` / ``replayed`` (loop model calls, sagaguard only), ``status`` (``finished``).

:func:`variants` plugs both modes into the sweep (:data:`_research.sweep.PLUGINS`), forked from a
zygote (:mod:`_research.zygote`: :func:`main` in a fresh child process per run), both killed at
:data:`SWEEP_POINTS`: every point of 12 of the plan's 42 steps (76 of the 277 a clean run reaches; the
steps left out repeat the same points under other numbers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import smtplib
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from email.message import EmailMessage
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
for entry in (HERE.parent.parent, HERE.parent):  # the project root and tests/, when run as a script
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

import httpx  # noqa: E402
import openai  # noqa: E402
import stripe  # noqa: E402
from agents import (  # noqa: E402
    Agent,
    FunctionTool,
    OpenAIChatCompletionsModel,
    Runner,
    SQLiteSession,
    function_tool,
    set_tracing_disabled,
)
from agents.models.interface import Model  # noqa: E402

from _research.points import reach  # noqa: E402
from _research.sweep import SDK_PRELOAD, Variant  # noqa: E402
from _research.world import SENDER, TOOL_NAMES, check_prompt, report_digest, write_prompt  # noqa: E402
from sagaguard.connectors.email import Email, EmailEffects, Sent, SmtpSettings  # noqa: E402
from sagaguard.connectors.frameworks.openai_agents import AgentRun  # noqa: E402
from sagaguard.connectors.llm import ChatJournal  # noqa: E402
from sagaguard.connectors.stripe import StripeEffects  # noqa: E402
from sagaguard.idempotency import Guard, current_effect, scope  # noqa: E402
from sagaguard.idempotency.errors import OutcomeUnknown  # noqa: E402
from sagaguard.idempotency.stores.sql import SqlStore  # noqa: E402

MODES = ("sagaguard", "plain", "fanout")
"""``fanout``: ``sagaguard`` with the fan-out plan (:data:`FANOUT_INSTRUCTIONS`)."""
SESSION = "research-1"
"""The session id (one conversation)."""
RUN_KEY = f"{SESSION}/turn-1"
"""The sagaguard run key: the session and the user turn (the research request is turn 1)."""
MODEL = "research-model"
MAX_TURNS = 100
"""The SDK's default (10) is far below the plan's 42 answers."""
INSTRUCTIONS = (
    "TASK agent. You are a research agent: search, fetch every page, summarize each, check each "
    "claim, write the report, pay for it and email it."
)
FANOUT_INSTRUCTIONS = INSTRUCTIONS.replace("TASK agent.", "TASK agent_fanout.")
"""The world's model then asks for the 11 summaries in one answer and the 15 claim checks in another
(parallel tool calls, which the SDK runs at once: their model calls are in flight together)."""
_MODEL_ITEMS = ("function_call", "message", "reasoning")
T = TypeVar("T")


def _step_points(step: int) -> list[str]:
    """The kill points of the plan's ``step`` (1..42, :func:`_research.world.agent_step`), in run order:
    from the session save before its model call to its tool's exit."""
    inner_before = max(0, min(step - 1, 39) - 12)  # tools' own model calls: steps 13..39, one each
    answer = step + inner_before  # model_answered number of the loop's answer for this step
    found = [f"session_saved#{step}", f"model_answered#{answer}", f"model_returned#{answer}"]
    if step == 42:  # the final text: no tool; the session saves it
        return [*found, "session_saved#43"]
    tool, nth = (
        ("search", 1) if step == 1 else ("fetch", step - 1) if step <= 12
        else ("summarize", step - 12) if step <= 23 else ("check_claim", step - 23) if step <= 38
        else ("write_report", 1) if step == 39 else ("pay", 1) if step == 40 else ("send_email", 1)
    )  # fmt: skip
    found.append(f"body:{tool}#{nth}")
    if 13 <= step <= 39:
        found += [f"model_answered#{answer + 1}", f"model_returned#{answer + 1}"]
    found += {"search": ["searched"], "fetch": [f"fetched#{nth}"], "pay": ["charge_applied"],
              "send_email": ["email_sent"]}.get(tool, [])  # fmt: skip
    return [*found, f"exit:{tool}#{nth}"]


SWEEP_STEPS = (1, 2, 12, 13, 23, 24, 31, 38, 39, 40, 41, 42)
"""The plan steps the full sweep kills at every point of: the search, the first and last fetch and
summarize, the first, a middle and the last claim check, the report, the payment, the email and the
final answer (the steps left out are more of the same, with other numbers)."""

SWEEP_POINTS: tuple[str, ...] = tuple(p for step in SWEEP_STEPS for p in _step_points(step))
"""The kill points of the full sweep: every point of each of :data:`SWEEP_STEPS` (76 points)."""


def variants() -> list[Variant]:
    """The OpenAI Agents SDK with sagaguard, and the SDK alone with its session (the sweep's plug-in).

    Runs are forked from a zygote that imported this module (``entry``): a fresh process per run
    without the SDKs' seconds of imports.
    """
    child = str(Path(__file__).resolve())
    entry = "_research.agents_child:main"
    return [
        Variant(
            "OpenAI Agents SDK + sagaguard", (sys.executable, child, "sagaguard"), SWEEP_POINTS, guarded=True,
            entry=entry, preload=SDK_PRELOAD,
        ),
        Variant(
            "OpenAI Agents SDK alone (session)", (sys.executable, child, "plain"), SWEEP_POINTS,
            entry=entry, preload=SDK_PRELOAD,
        ),
    ]  # fmt: skip


def answers_in(items: Sequence[Mapping[str, Any]]) -> int:
    """How many model answers a session's items hold.

    An answer is a run of consecutive model output items (function calls, assistant messages,
    reasoning) between inputs and tool outputs: the SDK saves one answer and its tool outputs per
    step, so the count is the ordinal of the next model call of the run.
    """
    answers, inside = 0, False
    for item in items:
        produced = item.get("type") in _MODEL_ITEMS and item.get("role", "assistant") == "assistant"
        if produced and not inside:
            answers += 1
        inside = produced
    return answers


def final_text(items: Sequence[Mapping[str, Any]]) -> str | None:
    """The agent's final answer when a session's items end with it (the run is done), else None."""
    last = items[-1] if items else {}
    if last.get("type", "message") != "message" or last.get("role") != "assistant":
        return None
    content = last.get("content")
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _call_output(items: Sequence[Mapping[str, Any]], tool: str) -> str | None:
    """The output of the (first) call of ``tool`` in a session's items, as text."""
    ids = {
        item.get("call_id")
        for item in items
        if item.get("type") == "function_call" and item.get("name") == tool
    }
    for item in items:
        if item.get("type") == "function_call_output" and item.get("call_id") in ids:
            output = item.get("output")
            if isinstance(output, list):
                return "".join(str(part.get("text", "")) for part in output if isinstance(part, dict))
            return str(output)
    return None


def _entered(tool: str) -> None:
    """The kill points at the first line of a tool's body."""
    # Un-numbered, so only the tool's first run marks it: the tools run in blocks (11 fetches, then
    # 11 summaries, ...), and the sweep groups the points from one tool's first run to the next's.
    reach(f"enter:{tool}", numbered=False)
    reach(f"body:{tool}")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


@dataclasses.dataclass
class Effects:
    """What the tools do to the world, per mode: the tools themselves are the same in both."""

    ask: Callable[[str, str], str]
    """``ask(task, user_message)``: one model call (``TASK <task>``), its text answer."""
    charge: Callable[[int, str, str], str]
    """``charge(amount, currency, description)``: a Stripe charge, its PaymentIntent id."""
    send: Callable[[str, str, str], str]
    """``send(to, subject, body)``: an email; ``"sent ..."`` or ``"in_doubt"``."""
    run: Any = None
    """The sagaguard :class:`~sagaguard.connectors.frameworks.openai_agents.AgentRun` (None in ``plain``)."""
    closers: list[Callable[[], None]] = dataclasses.field(default_factory=list)


def _messages(task: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"TASK {task}. You are a research assistant."},
            {"role": "user", "content": user}]  # fmt: skip


def _plain_effects(config: Mapping[str, Any], client: Any, payments: Any) -> Effects:
    """The SDK alone: the ``openai`` and ``stripe`` SDKs and ``smtplib``, nothing recorded."""

    def ask(task: str, user: str) -> str:
        reply = client.chat.completions.create(model=MODEL, messages=_messages(task, user))
        reach("model_returned")
        return str(reply.choices[0].message.content)

    def charge(amount: int, currency: str, description: str) -> str:
        params = {"amount": amount, "currency": currency, "payment_method": "pm_card_visa",
                  "confirm": True, "description": description}  # fmt: skip
        return str(payments.v1.payment_intents.create(params).id)

    def send(to: str, subject: str, body: str) -> str:
        message = EmailMessage()
        message["From"], message["To"], message["Subject"] = SENDER, to, subject
        message.set_content(body)
        with smtplib.SMTP(config["smtp_host"], int(config["smtp_port"]), timeout=30) as smtp:
            smtp.send_message(message)
        reach("email_sent", numbered=False)
        return "sent"

    return Effects(ask, charge, send)


def _guarded_effects(config: Mapping[str, Any], client: Any, payments: Any, folder: Path) -> Effects:
    """sagaguard: the run's :class:`AgentRun` and, inside each tool, effects keyed on its tool call."""
    store = SqlStore(f"sqlite:///{folder / 'effects.db'}")
    # Guard's defaults, as docs/frameworks/openai_agents.md shows it: a resume at once on this host
    # takes the dead process's claims over at once, no short lease needed.
    guard = Guard(store, namespace="research")
    journal = ChatJournal(guard, client)
    stripe_effects = StripeEffects(guard, payments)

    class HookedEmail(EmailEffects):
        def _transmit(self, message: Email) -> Sent:
            sent = super()._transmit(message)
            reach("email_sent", numbered=False)
            return sent

    mail = HookedEmail(guard, SmtpSettings(config["smtp_host"], int(config["smtp_port"])), sender=SENDER)

    def in_tool_scope(body: Callable[[], T]) -> T:
        # The tool call's effect key names what its body does: when the tool was left in doubt and
        # its body runs again, each inner effect maps to the record of its first run.
        with scope(current_effect().key):
            return body()

    def ask(task: str, user: str) -> str:
        reply = in_tool_scope(lambda: journal.create(model=MODEL, messages=_messages(task, user)))
        reach("model_returned")
        return str(reply.choices[0].message.content)

    def charge(amount: int, currency: str, description: str) -> str:
        return in_tool_scope(
            lambda: stripe_effects.charge(
                amount, currency, payment_method="pm_card_visa", description=description
            )
        ).id

    def send(to: str, subject: str, body: str) -> str:
        try:
            sent = in_tool_scope(lambda: mail.send_now(Email(to=[to], subject=subject, text=body)))
        except OutcomeUnknown:  # sent or not, SMTP cannot tell: parked for an operator, never re-sent
            return "in_doubt"
        return f"sent {sent.message_id}"

    # Every world-changing call inside a tool is an effect of its own, so a tool left in doubt may
    # run its body again (at least once): the inner effects replay or settle themselves.
    run = AgentRun(guard, RUN_KEY, tool_options={name: {"policy": "at_least_once"} for name in TOOL_NAMES})
    return Effects(ask, charge, send, run, [guard.close, store.close])


def _tools(effects: Effects, tools_url: str) -> list[Any]:
    """The seven function tools of the plan."""

    @function_tool
    def search(query: str) -> str:
        """Search the literature; returns the result URLs, one a line."""
        _entered("search")
        found = _get(f"{tools_url}/search?" + urllib.parse.urlencode({"q": query}))
        reach("searched", numbered=False)
        return "\n".join(r["url"] for r in found["results"])

    @function_tool
    def fetch(url: str) -> str:
        """Fetch a page; returns its text."""
        _entered("fetch")
        text = str(_get(f"{tools_url}/fetch?" + urllib.parse.urlencode({"url": url}))["text"])
        reach("fetched")
        return text

    @function_tool
    def summarize(url: str, text: str) -> str:
        """Summarize a fetched page."""
        _entered("summarize")
        return effects.ask("summarize", text)

    @function_tool
    def check_claim(claim: str) -> str:
        """Cross-check a claim against the literature; returns the verdict."""
        _entered("check_claim")
        return effects.ask("check", check_prompt(claim))

    @function_tool
    def write_report(topic: str, summaries: list[str], verdicts: list[str]) -> str:
        """Write the report from the summaries and the verdicts."""
        _entered("write_report")
        return effects.ask("write", write_prompt(topic, summaries, verdicts))

    @function_tool
    def pay(amount: int, currency: str, description: str) -> str:
        """Pay for the report (amount in cents); returns the payment id."""
        _entered("pay")
        return effects.charge(amount, currency, description)

    @function_tool
    def send_email(to: str, subject: str, body: str) -> str:
        """Email the report; returns what happened to the message."""
        _entered("send_email")
        return effects.send(to, subject, body)

    return [search, fetch, summarize, check_claim, write_report, pay, send_email]


def _with_exit_points(agent: Any) -> Any:
    """``agent`` with kill points where the SDK holds a model answer or a tool output, before the
    session saved them (outside sagaguard's wrapping: journaled and recorded by then)."""

    class Returned(Model):
        def __init__(self, inner: Model) -> None:
            self.inner = inner

        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            response = await self.inner.get_response(*args, **kwargs)
            reach("model_returned")
            return response

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("the research agent does not stream")

        async def close(self) -> None:
            await self.inner.close()

    def exiting(tool: FunctionTool) -> FunctionTool:
        invoke = tool.on_invoke_tool

        async def on_invoke(ctx: Any, arguments: str) -> Any:
            output = await invoke(ctx, arguments)
            reach(f"exit:{tool.name}")
            return output

        return dataclasses.replace(tool, on_invoke_tool=on_invoke)

    tools = [exiting(t) if isinstance(t, FunctionTool) else t for t in agent.tools]
    return agent.clone(model=Returned(agent.model), tools=tools)


def build(config: Mapping[str, Any], mode: str, folder: Path) -> tuple[Any, Effects]:
    """The agent for ``mode`` (hooked with kill points) and its :class:`Effects`."""

    def answered(response: httpx.Response) -> None:
        if response.request.method == "POST" and response.request.url.path.endswith("/chat/completions"):
            reach("model_answered")

    async def answered_async(response: httpx.Response) -> None:
        answered(response)

    class HookedRequestsClient(stripe.RequestsClient):
        """The Stripe SDK's HTTP client with a kill point once a charge request was answered."""

        def request(
            self, method: str, url: str, headers: Mapping[str, str] | None, post_data: Any = None
        ) -> Any:
            answer = super().request(method, url, headers, post_data)
            if method.lower() == "post" and urllib.parse.urlsplit(url).path == "/v1/payment_intents":
                reach("charge_applied", numbered=False)
            return answer

    base_url = config["model_base_url"]
    client = openai.OpenAI(
        api_key="sk-local", base_url=base_url, max_retries=0,
        http_client=httpx.Client(event_hooks={"response": [answered]}, timeout=30),
    )  # fmt: skip
    loop_client = openai.AsyncOpenAI(
        api_key="sk-local", base_url=base_url, max_retries=0,
        http_client=httpx.AsyncClient(event_hooks={"response": [answered_async]}, timeout=30),
    )  # fmt: skip
    payments = stripe.StripeClient(
        config["stripe_api_key"],
        base_addresses={"api": config["stripe_api_base"]},
        max_network_retries=0,
        http_client=HookedRequestsClient(timeout=30),
    )
    if mode != "plain":
        effects = _guarded_effects(config, client, payments, folder)
    else:
        effects = _plain_effects(config, client, payments)
    effects.closers.append(client.close)
    model = OpenAIChatCompletionsModel(MODEL, loop_client)
    instructions = FANOUT_INSTRUCTIONS if mode == "fanout" else INSTRUCTIONS
    agent = Agent(
        name="researcher", instructions=instructions, model=model, tools=_tools(effects, config["tools_url"])
    )
    if effects.run is not None:
        agent = effects.run.wrap(agent)
    return _with_exit_points(agent), effects


async def _run(mode: str, config: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    set_tracing_disabled(True)  # no OPENAI_API_KEY to export traces with

    class HookedSession(SQLiteSession):
        """An SQLiteSession with a kill point after each batch of items it saved."""

        async def add_items(self, items: list[Any]) -> None:
            await super().add_items(items)
            if items:
                reach("session_saved")

    agent, effects = build(config, mode, folder)
    run = effects.run
    session = HookedSession(SESSION, str(folder / "session.db"))
    try:
        saved = [dict(item) for item in await session.get_items()]
        # A run killed before the session saved its input left nothing to go on from: start again.
        go_on = config["action"] == "resume" and bool(saved)
        final = final_text(saved) if go_on else None
        if final is None:  # a run killed after the session saved its final answer is done
            if run is not None and go_on:
                run.model_calls = answers_in(saved)
            topic = str(config["topic"])
            result = await Runner.run(agent, [] if go_on else topic, session=session, max_turns=MAX_TURNS)
            final = result.final_output
        items = [dict(item) for item in await session.get_items()]
    finally:
        session.close()
        for close in effects.closers:
            close()

    report = _call_output(items, "write_report") or ""
    emailed = _call_output(items, "send_email") or ""
    out: dict[str, Any] = {
        "report": report,
        "digest": report_digest(report),
        "payment": _call_output(items, "pay"),
        "email": "in_doubt" if emailed == "in_doubt" else "sent" if emailed.startswith("sent") else emailed,
        "final": final,
        "status": "finished" if isinstance(final, str) and final else "unfinished",
    }
    if run is not None:
        out["paid"], out["replayed"] = run.usage.calls, run.usage.saved_calls
    return out


def main(mode: str, config: Mapping[str, Any]) -> int:
    """Run (or resume) the research agent once; print the JSON result line."""
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, not {mode!r}")
    folder = Path(config["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    print(json.dumps(asyncio.run(_run(mode, config, folder))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
