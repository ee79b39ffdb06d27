"""``make agent-demo``: a LangGraph agent books and pays, then a later tool fails; sagaguard undoes it.

Everything runs on 127.0.0.1 with SQLite files in a temporary directory, in under a minute. The
supervisor (this process) keeps the local services, so they count what the outside world saw
whatever happens to the agent's processes: :class:`~sagaguard.connectors.testing.LocalStripe` (the card,
through the real ``stripe`` SDK), :class:`~sagaguard.connectors.testing.LocalIdempotentApi` (the hotel and
the airline, whose flight is sold out), :class:`~sagaguard.connectors.testing.LocalChatModel` (the model,
scripted to plan: book the hotel, charge the card, email the confirmation, book the flight) and
:class:`~sagaguard.connectors.testing.smtp.SmtpSink` (the mail server).

The agent (:mod:`sagaguard.connectors.demo._agent_graph`) is one LangGraph graph on a SQLite checkpointer,
run twice, each side against its own services:

- **with sagaguard**: its tools run in an agent saga (``SagaTools``, each tool declared with its
  undo), its model is journaled, its email goes through the transactional outbox. The agent's
  process is SIGKILLed after the email (a relay delivers the confirmation meanwhile) and resumed
  from its checkpoint; the flight is sold out, so the run undoes its calls in reverse, and its
  process is SIGKILLed again in the middle of that, right after Stripe refunded the charge. A fresh
  process, ``sagaguard sagas worker``, finishes the compensation; the relay then delivers the
  correction, after the confirmation.
- **with the checkpointer alone**: the same graph, killed and resumed the same way; the flight is
  sold out and the run ends with the error. Everything it did stays in place.

The supervisor prints what the services saw side by side and the run's saga timeline, and exits 0
only when the counts are the expected ones. Also ``sagaguard demo agent`` and ``python -m
sagaguard.connectors.demo agent``. Needs the ``demo`` and ``langgraph`` extras.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

from sagaguard.connectors.demo import _Run, say_timelines

__all__ = ["CONFIG_ENV", "THREAD", "Count", "mailer", "main"]

CONFIG_ENV = "SAGAGUARD_AGENT_DEMO"
"""The environment variable that hands an agent process (and the worker) its JSON config."""
THREAD = "trip-to-oslo"
"""The graph's ``thread_id``, which is also the agent run's saga id."""
LEASE = 30.0
"""Seconds the agent run's lease lasts in the demo: the default. The killed process's run is not
waited for: the worker, on the same host, takes over a run whose holder is provably dead at once."""
_NEEDS = ("aiosmtpd", "httpx", "openai", "stripe", "langgraph", "langchain_openai")
"""What the demo's services and processes import: the ``demo`` and ``langgraph`` extras."""
_SCRIPT = [
    [{"name": "book_hotel", "args": {"hotel": "grand-oslo", "nights": 3}}],
    [{"name": "charge_card", "args": {"amount": 64000}}],
    [{"name": "email_confirmation", "args": {"to": "ana@example.com"}}],
    [{"name": "book_flight", "args": {"to": "Oslo"}}],
]
"""The model's plan, one tool call a turn."""
_TRIP = {"traveller": "Ana", "email": "ana@example.com", "destination": "Oslo", "hotel": "grand-oslo",
         "nights": 3, "amount": 64000}  # fmt: skip
_SIDES = ("sagaguard", "checkpointer")
_LABELS = {"sagaguard": "sagaguard", "checkpointer": "checkpointer alone"}


@dataclass
class Count:
    """What the services saw."""

    bookings: int = 0
    cancellations: int = 0
    charges: int = 0
    refunds: int = 0
    emails: int = 0
    model_calls: int = 0
    subjects: list[str] = field(default_factory=list)


def mailer(config: dict[str, Any]) -> tuple[Any, Any, Any, Any, Any]:
    """The guard, store, outbox engine, outbox and email connector of the sagaguard side (the agent
    process, the worker's undo and the supervisor's relay each build their own)."""
    import sqlalchemy as sa

    from sagaguard.connectors.email import EmailEffects, SmtpSettings
    from sagaguard.idempotency import Guard, open_store
    from sagaguard.idempotency.outbox import Outbox

    store = open_store(config["store"])
    guard = Guard(store)
    engine = sa.create_engine(config["outbox"])
    outbox = Outbox()
    outbox.create_tables(engine)
    smtp = SmtpSettings(config["smtp_host"], int(config["smtp_port"]), timeout=10)
    mail = EmailEffects(guard, smtp, outbox=outbox, sender="trips@agent.example")
    return guard, store, engine, outbox, mail


class _Services:
    """One side's local services and what they counted."""

    def __init__(self, stack: ExitStack) -> None:
        from sagaguard.connectors.testing import LocalChatModel, LocalIdempotentApi, LocalStripe
        from sagaguard.connectors.testing.smtp import SmtpSink

        self.stripe = stack.enter_context(LocalStripe(in_process=True))
        self.api = stack.enter_context(LocalIdempotentApi(require_key=False, in_process=True))
        self.chat = stack.enter_context(LocalChatModel(script=_SCRIPT, in_process=True))
        self.smtp = stack.enter_context(SmtpSink())
        self.api.fault("fail", "/flights", method="POST", times=1000, status=410)  # sold out

    def config(self) -> dict[str, Any]:
        return {
            "stripe_base": self.stripe.api_base,
            "stripe_key": self.stripe.api_key,
            "api_url": self.api.url,
            "chat_url": self.chat.base_url,
            "smtp_host": self.smtp.host,
            "smtp_port": self.smtp.port,
        }

    def count(self) -> Count:
        import httpx

        resources = httpx.get(f"{self.api.url}/resources", timeout=10).json()["resources"]
        paths = [r["path"] for r in resources]
        stripe = self.stripe.counters()
        return Count(
            bookings=paths.count("/bookings"),
            cancellations=paths.count("/cancellations"),
            charges=stripe.get("charges", 0),
            refunds=stripe.get("refunds", 0),
            emails=self.smtp.count(),
            model_calls=self.chat.counters().get("completions", 0),
            subjects=[m.subject or "" for m in self.smtp.messages],
        )


def _describe(run: _Run) -> str:
    """What became of one process, in a few words."""
    if run.killed:
        where = next((ln for ln in run.stderr.splitlines() if "SIGKILL at" in ln), "SIGKILL")
        return f"killed (SIGKILL at {where.split('SIGKILL at ')[-1].split(' (')[0]})"
    if run.returncode != 0:
        last = run.stderr.strip().splitlines()[-1:] or [f"exit {run.returncode}"]
        return f"FAILED: {last[0]}"
    failed = run.find("failed")
    if failed is not None:
        return f"resumed from its checkpoint; {failed['error']}"
    return "; ".join(e["event"] for e in run.events) or "done"


def _env(config: dict[str, Any], crash: str | None) -> dict[str, str]:
    from sagaguard.idempotency.testing import CRASH_ENV, child_environment

    env = child_environment(**{CONFIG_ENV: json.dumps(config)})
    env.pop(CRASH_ENV, None)
    if crash:
        env[CRASH_ENV] = crash
    return env


def _spawn(label: str, argv: list[str], config: dict[str, Any], crash: str | None = None) -> _Run:
    done = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=_env(config, crash),
        timeout=90, check=False,
    )  # fmt: skip
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return _Run(label, done.returncode, events, done.stderr)


_AGENT = [sys.executable, "-m", "sagaguard.connectors.demo._agent_graph"]
_CLI = "import sys; from sagaguard.idempotency.cli import main; sys.exit(main(sys.argv[1:]))"


def _relay(config: dict[str, Any]) -> int:
    """Run the outbox relay until it is idle (a relay process would run all along); returns how
    many emails it delivered."""
    guard, store, engine, outbox, _ = mailer(config)
    try:
        return int(outbox.relay(engine).run(until_idle=True).delivered)
    finally:
        engine.dispose()
        guard.close()
        store.close()


def _run_state(config: dict[str, Any]) -> str:
    from sagaguard.saga.journals import open_journal

    journal = open_journal(config["store"])
    try:
        found = journal.load(THREAD)
        return "missing" if found is None else found.saga.state.value
    finally:
        journal.close()


def _worker(config: dict[str, Any]) -> list[_Run]:
    """``sagaguard sagas worker --once`` in fresh processes until the run's compensation ended."""
    argv = [sys.executable, "-c", _CLI, "sagas", "worker"]
    argv += ["--app", "sagaguard.connectors.demo._agent_undos:registry"]
    argv += ["--store", config["store"], "--once", "--lease", str(LEASE)]
    runs: list[_Run] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        run = _spawn("sagaguard sagas worker (fresh process)", argv, config)
        runs.append(run)
        state = _run_state(config)
        if run.returncode != 0 or state not in ("running", "compensating"):
            break
        # A run held elsewhere waits for its lease on the wall clock: poll (one pass takes a dead
        # holder's run on this host at once).
        time.sleep(0.2)
    return runs


def _sagaguard(config: dict[str, Any], say: Callable[[str], None]) -> list[_Run]:
    side = "  [sagaguard]"
    runs = [_spawn("agent, process 1", _AGENT, config, crash="agent_after_email")]
    say(f"{side} agent, process 1: booked the hotel, charged the card, queued the email;")
    say(f"{side}   {_describe(runs[0])}")
    say(f"{side} the outbox relay delivered {_relay(config)} email (the confirmation) meanwhile")
    runs.append(_spawn("agent, process 2", _AGENT, config, crash="agent_after_refund"))
    say(f"{side} agent, process 2: resumed from its checkpoint; the flight is sold out, so it undoes the")
    say(f"{side}   trip in reverse (the email's correction queued, the charge refunded):")
    say(f"{side}   {_describe(runs[1])}")
    workers = _worker(config)
    runs += workers
    state = _run_state(config)
    say(f"{side} sagaguard sagas worker, a fresh process ({len(workers)} run(s)): the run is {state}")
    say(f"{side} the outbox relay delivered {_relay(config)} email (the correction, after the confirmation)")
    return runs


def _alone(config: dict[str, Any], say: Callable[[str], None]) -> list[_Run]:
    side = "  [checkpointer alone]"
    runs = [_spawn("agent, process 1", _AGENT, config, crash="agent_after_email")]
    say(f"{side} agent, process 1: booked the hotel, charged the card, sent the email;")
    say(f"{side}   {_describe(runs[0])}")
    runs.append(_spawn("agent, process 2", _AGENT, config))
    say(f"{side} agent, process 2: {_describe(runs[1])};")
    say(f"{side}   the run ends there, everything it did left in place")
    return runs


_ROWS = (
    ("hotel bookings", "bookings"),
    ("hotel cancellations", "cancellations"),
    ("card charges", "charges"),
    ("refunds", "refunds"),
    ("emails", "emails"),
    ("model calls", "model_calls"),
)
_WANT = {
    "sagaguard": Count(1, 1, 1, 1, 2, 4),
    "checkpointer": Count(1, 0, 1, 0, 1, 4),
}


def _table(counts: dict[str, Count], say: Callable[[str], None]) -> None:
    say(f"  {'what the services saw':<26}{_LABELS['sagaguard']:>12}{_LABELS['checkpointer']:>22}")
    g, n = asdict(counts["sagaguard"]), asdict(counts["checkpointer"])
    for title, name in _ROWS:
        note = "   <-" if g[name] != n[name] else ""
        say(f"    {title:<24}{g[name]:>12}{n[name]:>22}{note}")
    for side in _SIDES:
        say(f"  emails {_LABELS[side]} sent, in the order they arrived:")
        for number, subject in enumerate(counts[side].subjects, 1):
            say(f"    {number}. {subject}")


def _check(counts: dict[str, Count], runs: dict[str, list[_Run]]) -> list[str]:
    problems = []
    for side, want in _WANT.items():
        got = asdict(counts[side])
        for name, value in asdict(want).items():
            if name != "subjects" and got[name] != value:
                problems.append(f"{_LABELS[side]}: {got[name]} {name}, expected {value}")
        if not runs[side][0].killed:
            problems.append(f"{_LABELS[side]}: the agent's first process was not killed")
    if not runs["sagaguard"][1].killed:
        problems.append("sagaguard: the agent's process was not killed in the middle of compensation")
    subjects = counts["sagaguard"].subjects
    if len(subjects) == 2 and not (
        subjects[0].startswith("Confirmed") and subjects[1].startswith("Cancelled")
    ):
        problems.append(
            f"sagaguard: the emails arrived as {subjects}, not the confirmation then its correction"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    """Run the agent demo; 0 when the services counted what they should."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:  # one line naming the extras, not a traceback from an agent process
        names = ", ".join(missing)
        print(f"sagaguard demo agent needs the 'demo' and 'langgraph' extras (missing: {names}): "
              "pip install 'sagaguard[demo,langgraph]'", file=sys.stderr)  # fmt: skip
        return 2
    parser = argparse.ArgumentParser(
        prog="sagaguard demo agent",
        description="A LangGraph agent books and pays, then a tool fails: undone, or left in place.",
    )
    parser.parse_args(args_list)

    def say(line: str) -> None:
        print(line, flush=True)

    started = time.monotonic()
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="sagaguard-agent-demo-"))
        services = {side: _Services(stack) for side in _SIDES}
        configs = {
            side: {
                **services[side].config(), "side": side, "dir": tmp, "trip": _TRIP, "lease": LEASE,
                "store": f"sqlite:///{tmp}/sagaguard.db", "outbox": f"sqlite:///{tmp}/outbox.db",
            }
            for side in _SIDES
        }  # fmt: skip
        say("sagaguard agent demo: a LangGraph agent plans a trip with a model: book the hotel, charge")
        say("the card (Stripe), email the confirmation, book the flight. The flight is sold out.")
        say("Its process is SIGKILLed after the email and resumed from its checkpoint; with sagaguard it")
        say("is SIGKILLed again in the middle of undoing the trip. Local Stripe, hotel and airline API,")
        say("model and SMTP servers; SQLite in a temporary directory.")
        say("")
        alone_lines: list[str] = []
        with ThreadPoolExecutor(1) as pool:  # the two sides at once, their narration kept apart
            alone = pool.submit(_alone, configs["checkpointer"], alone_lines.append)
            runs = {"sagaguard": _sagaguard(configs["sagaguard"], say)}
            runs["checkpointer"] = alone.result()
        for line in alone_lines:
            say(line)
        counts = {side: services[side].count() for side in _SIDES}
        say("")
        _table(counts, say)
        say("")
        title = f"timeline of the agent run {THREAD} (sagaguard sagas show {THREAD}):"
        say_timelines(configs["sagaguard"]["store"], [(THREAD, title)], say)
    say("")
    problems = _check(counts, runs)
    for problem in problems:
        say(f"UNEXPECTED: {problem}")
    if problems:
        return 1
    say("OK: with sagaguard the booking was cancelled and the charge refunded, once each, and the")
    say("cancellation email arrived after the confirmation; with the checkpointer alone the booking,")
    took = time.monotonic() - started
    say(f"the charge and the confirmation of a trip that is not happening were left in place. ({took:.1f} s)")
    return 0
