"""``make demo``: an agent books two trips as sagas, is SIGKILLed, recovers; then a naive loop does the same.

Everything runs on 127.0.0.1 with embedded SQLite files in a temporary directory, in well under a
minute. Local services, kept by this supervisor process so that they count what the outside world
saw whatever happens to the workers: :class:`~sagaguard.connectors.testing.LocalStripe` (the card),
:class:`~sagaguard.connectors.testing.LocalIdempotentApi` (the hotel; "sold-out-inn" answers 410),
:class:`~sagaguard.connectors.testing.LocalChatModel` (the model that plans the trip) and
:class:`~sagaguard.connectors.testing.smtp.SmtpSink` (the mail server).

With sagaguard, a trip is the saga ``book_trip``: *plan* (a journaled model call), *charge_card*
(Stripe; compensation: refund), *reserve_hotel* (the pivot), *email_confirmation* (enqueued in the
transactional outbox; a relay sends it). Trip 1's worker is SIGKILLed after Stripe charged, before
the charge was recorded; a fresh worker recovers the saga (the reconciler finds the charge at
Stripe), finishes it and relays the email. Trip 2's hotel is sold out: the saga refunds the charge.

The naive side makes the same calls with the plain SDKs and a retry loop, killed at the same point
and restarted: it plans (and pays the model) again, charges again, and leaves trip 2's charge
unrefunded. The supervisor prints what the services counted, side by side, then each saga's
timeline, and exits 0 only when the counts are the expected ones. ``--trace FILE`` writes the
OpenTelemetry spans of every process as JSON lines. Also ``python -m sagaguard.connectors.demo``.

``sagaguard demo agent`` (``make agent-demo``) runs the agent demo instead: a LangGraph agent whose
tool calls are undone by an agent saga (:mod:`sagaguard.connectors.demo.agent`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Count", "main", "say_timelines"]

SOLD_OUT = "sold-out-inn"
KILL = "store.complete#2:before"
"""The saga kill point of trip 1: the second guarded effect (the Stripe charge) ran, its record is
not written yet."""
_WORKER = "worker"
_NEEDS = ("aiosmtpd", "httpx", "openai", "stripe")
"""What the demo's services and workers import (the ``demo`` extra; ``--trace`` also needs its SDK)."""
_TRIPS = {
    1: {"traveller": "Ana", "email": "ana@example.com", "destination": "Lisbon", "hotel": "casa-azul",
        "nights": 3, "amount": 42000},
    2: {"traveller": "Bo", "email": "bo@example.com", "destination": "Porto", "hotel": SOLD_OUT,
        "nights": 2, "amount": 38000},
}  # fmt: skip


@dataclass
class Count:
    """What the services counted during one trip."""

    charges: int = 0
    refunds: int = 0
    hotel: int = 0
    emails: int = 0
    model_calls: int = 0
    tokens: int = 0


@dataclass
class _Run:
    label: str
    returncode: int
    events: list[dict[str, Any]]
    stderr: str

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL

    def find(self, event: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == event), None)


@dataclass
class _Side:
    label: str
    counts: dict[int, Count] = field(default_factory=dict)
    runs: dict[int, list[_Run]] = field(default_factory=dict)
    saga_ids: dict[int, str] = field(default_factory=dict)


class _Services:
    """The local services and how to snapshot their counters."""

    def __init__(self, stack: ExitStack) -> None:
        from sagaguard.connectors.testing import LocalChatModel, LocalIdempotentApi, LocalStripe
        from sagaguard.connectors.testing.smtp import SmtpSink

        self.stripe = stack.enter_context(LocalStripe(in_process=True))
        self.hotel = stack.enter_context(LocalIdempotentApi(require_key=False, in_process=True))
        self.chat = stack.enter_context(LocalChatModel(in_process=True))
        self.smtp = stack.enter_context(SmtpSink())
        self.hotel.fault("fail", f"/hotels/{SOLD_OUT}/", method="POST", times=1000, status=410)

    def config(self) -> dict[str, Any]:
        return {
            "stripe_base": self.stripe.api_base,
            "stripe_key": self.stripe.api_key,
            "hotel_url": self.hotel.url,
            "chat_url": self.chat.base_url,
            "smtp_host": self.smtp.host,
            "smtp_port": self.smtp.port,
        }

    def snapshot(self) -> Count:
        stripe, chat = self.stripe.counters(), self.chat.counters()
        tokens = chat.get("prompt_tokens", 0) + chat.get("completion_tokens", 0)
        return Count(
            charges=stripe.get("charges", 0),
            refunds=stripe.get("refunds", 0),
            hotel=self.hotel.counters().get("applied", 0),
            emails=self.smtp.count(),
            model_calls=chat.get("completions", 0),
            tokens=tokens,
        )


def _diff(after: Count, before: Count) -> Count:
    a, b = asdict(after), asdict(before)
    return Count(**{name: a[name] - b[name] for name in a})


def _spawn(label: str, config: dict[str, Any], crash: str | None = None) -> _Run:
    from sagaguard.idempotency.testing import CRASH_ENV, child_environment

    env = child_environment()
    env.pop(CRASH_ENV, None)
    if crash:
        env[CRASH_ENV] = crash
    done = subprocess.run(
        [sys.executable, "-m", "sagaguard.connectors.demo", _WORKER, json.dumps(config)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return _Run(label, done.returncode, events, done.stderr)


def _say_run(side: str, run: _Run, say: Callable[[str], None]) -> None:
    if run.killed:
        where = next((ln for ln in run.stderr.splitlines() if "SIGKILL at" in ln), "SIGKILL")
        say(f"  [{side}] {run.label}: killed ({where.split('sagaguard.testing: ')[-1]})")
        return
    if run.returncode != 0:
        last = run.stderr.strip().splitlines()[-1:] or [f"exit {run.returncode}"]
        say(f"  [{side}] {run.label}: FAILED: {last[0]}")
        return
    parts = []
    if run.find("recovered"):
        parts.append("took over the dead worker's saga once its lease ran out")
        record = run.find("charge_record")
        if record and record["claims"] > 1:
            parts.append("its in-doubt charge was settled at Stripe by its key, not charged again")
    outcome = run.find("outcome")
    if outcome:
        parts.append(f"saga {outcome['state']}")
    relay = run.find("relay")
    if relay:
        parts.append(f"relay delivered {relay['delivered']} email(s)")
    model = run.find("model")
    if model and model["saved"]:
        parts.append(f"{model['saved']} model call(s) replayed from the journal")
    failed = run.find("failed")
    if failed:
        parts.append(f"{failed['step']} answered {failed['status']} after retries; gave up")
    if run.find("emailed"):
        parts.append("booked and emailed")
    say(f"  [{side}] {run.label}: " + ("; ".join(parts) or "done"))


def _table(guarded: _Side, naive: _Side, say: Callable[[str], None]) -> None:
    rows = [
        ("charges", "charges"),
        ("refunds", "refunds"),
        ("hotel bookings", "hotel"),
        ("emails", "emails"),
        ("model calls", "model_calls"),
        ("tokens paid", "tokens"),
    ]
    titles = {1: "trip 1: worker SIGKILLed right after the charge", 2: "trip 2: hotel sold out"}
    say(f"  {'what the services saw':<24}{guarded.label:>12}{naive.label:>20}")
    for trip in (1, 2):
        say(f"  {titles[trip]}")
        g, n = asdict(guarded.counts[trip]), asdict(naive.counts[trip])
        for title, name in rows:
            note = "   <-" if g[name] != n[name] else ""
            say(f"    {title:<22}{g[name]:>12}{n[name]:>20}{note}")


def _check(guarded: _Side, naive: _Side) -> list[str]:
    want_g = {1: Count(1, 0, 1, 1, 1), 2: Count(1, 1, 0, 0, 1)}
    want_n = {1: Count(2, 0, 1, 1, 2), 2: Count(1, 0, 0, 0, 1)}
    problems = []
    for side, want in ((guarded, want_g), (naive, want_n)):
        for trip, expected in want.items():
            got = asdict(side.counts[trip])
            for name, value in asdict(expected).items():
                if name != "tokens" and got[name] != value:
                    problems.append(f"{side.label}, trip {trip}: {got[name]} {name}, expected {value}")
        if not side.runs[1][0].killed:
            problems.append(f"{side.label}: trip 1's first worker was not killed")
    if guarded.counts[1].tokens >= naive.counts[1].tokens:
        problems.append("sagaguard paid as many model tokens as the naive loop on trip 1")
    return problems


def _sagaguard(services: _Services, base: dict[str, Any], say: Callable[[str], None]) -> _Side:
    side = _Side("sagaguard")
    suffix = os.urandom(2).hex()
    for trip in (1, 2):
        saga_id = side.saga_ids[trip] = f"trip-{suffix}-{trip}"
        config = {**base, "saga_id": saga_id, "trip": _TRIPS[trip]}
        before = services.snapshot()
        if trip == 1:
            runs = [_spawn("trip 1, worker 1", {**config, "mode": "saga", "kill": KILL})]
            _say_run(side.label, runs[0], say)
            runs.append(_spawn("trip 1, worker 2 (fresh process)", {**config, "mode": "recover"}))
        else:
            runs = [_spawn("trip 2, worker 3", {**config, "mode": "saga"})]
        _say_run(side.label, runs[-1], say)
        side.runs[trip] = runs
        side.counts[trip] = _diff(services.snapshot(), before)
    return side


def _naive(services: _Services, base: dict[str, Any], say: Callable[[str], None]) -> _Side:
    from sagaguard.connectors.demo._worker import NAIVE_CRASH

    side = _Side("naive retry loop")
    for trip in (1, 2):  # (the demo's trips 1 and 2, by the naive loop against its own services)
        config = {**base, "mode": "naive", "trip": _TRIPS[trip]}
        before = services.snapshot()
        runs = [_spawn(f"trip {trip}, run 1", config, crash=NAIVE_CRASH if trip == 1 else None)]
        if runs[0].killed:
            _say_run(side.label, runs[0], say)
            runs.append(_spawn(f"trip {trip}, run 2 (restarted)", config))
        _say_run(side.label, runs[-1], say)
        side.runs[trip] = runs
        side.counts[trip] = _diff(services.snapshot(), before)
    return side


def _timelines(journal_url: str, guarded: _Side, say: Callable[[str], None]) -> None:
    titled = []
    for trip in (1, 2):
        saga_id = guarded.saga_ids[trip]
        titled.append((saga_id, f"timeline of {saga_id} ({_TRIPS[trip]['destination']}):"))
    say_timelines(journal_url, titled, say)


def say_timelines(journal_url: str, sagas: list[tuple[str, str]], say: Callable[[str], None]) -> None:
    """Say each saga's timeline (``sagaguard sagas show``) under its title: ``(saga id, title)``."""
    from sagaguard.saga import render
    from sagaguard.saga.journals import open_journal

    journal = open_journal(journal_url)
    try:
        for saga_id, title in sagas:
            snapshot = journal.load(saga_id)
            say(title)
            for line in (render(snapshot) if snapshot is not None else "not found").splitlines():
                say(f"  {line}")
    finally:
        journal.close()


def main(argv: list[str] | None = None) -> int:
    """Run the demo (or, with ``worker CONFIG``, one worker); 0 when the services counted as expected."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    if args_list[:1] == [_WORKER]:
        from sagaguard.connectors.demo._worker import run_worker

        return run_worker(json.loads(args_list[1]))
    if args_list[:1] == ["agent"]:  # the agent demo (sagaguard.connectors.demo.agent), with its own extras
        from sagaguard.connectors.demo.agent import main as agent_demo

        return agent_demo(args_list[1:])
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:  # one line naming the extra, not a traceback from a worker process
        print(f"sagaguard demo needs the 'demo' extra (missing: {', '.join(missing)}): "
              "pip install 'sagaguard[demo]' (or run the small demo: sagaguard demo --small)",
              file=sys.stderr)  # fmt: skip
        return 2
    parser = argparse.ArgumentParser(
        prog="sagaguard demo",
        description="Book trips as sagas, SIGKILL the worker, recover; compare with a naive retry loop.",
    )
    parser.add_argument("--trace", metavar="FILE", help="write the OpenTelemetry spans here (JSON lines)")
    args = parser.parse_args(args_list)

    def say(line: str) -> None:
        print(line, flush=True)

    started = time.monotonic()
    provider = None
    if args.trace:
        from sagaguard.connectors.demo._trace import install

        Path(args.trace).write_text("", encoding="utf-8")
        provider = install(args.trace, "sagaguard-demo")
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="sagaguard-demo-"))
        services, naive_services = _Services(stack), _Services(stack)  # one set per side
        journal_url = f"sqlite:///{tmp}/journal.db"
        base: dict[str, Any] = {
            "store": f"sqlite:///{tmp}/store.db",
            "journal": journal_url,
            "outbox": f"sqlite:///{tmp}/outbox.db",
            "trace": str(Path(args.trace).resolve()) if args.trace else None,
        }
        say("sagaguard demo: an agent books two trips (plan with a model, charge the card, reserve the")
        say("hotel, email the confirmation). Trip 1's worker is SIGKILLed right after Stripe charged;")
        say("trip 2's hotel is sold out. Local Stripe, hotel API, model and SMTP; SQLite in a temp dir.")
        say("")
        # The two sides run at once, each against its own services; their narration is kept apart.
        naive_lines: list[str] = []
        with ThreadPoolExecutor(1) as pool:
            naive_config = {**base, **naive_services.config()}
            naive_side = pool.submit(_naive, naive_services, naive_config, naive_lines.append)
            guarded = _sagaguard(services, {**base, **services.config()}, say)
            naive = naive_side.result()
        for line in naive_lines:
            say(line)
        say("")
        _table(guarded, naive, say)
        say("")
        _timelines(journal_url, guarded, say)
    if provider is not None:
        provider.shutdown()
    say("")
    problems = _check(guarded, naive)
    for problem in problems:
        say(f"UNEXPECTED: {problem}")
    if problems:
        return 1
    say("OK: with sagaguard trip 1 was charged once, its plan paid once, one email went out, and trip 2's")
    say("charge was refunded; the naive loop charged trip 1 twice, paid the model twice and left trip 2's")
    say(f"charge unrefunded. ({time.monotonic() - started:.1f} s)")
    return 0
