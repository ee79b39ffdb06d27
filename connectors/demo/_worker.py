"""The demo's worker processes: the trip booked as a sagaguard saga, and the same trip done naively.

A worker is started by the supervisor (:mod:`sagaguard.connectors.demo`) as ``python -m
sagaguard.connectors.demo worker CONFIG`` with a JSON config, prints JSON events on stdout, and may be
SIGKILLed on purpose:

- ``saga``: run trip ``saga_id`` with :class:`~sagaguard.saga.runner.SagaRunner` (optionally dying at a saga
  kill point, e.g. ``store.complete#2:before``: Stripe charged, its record not written);
- ``recover``: a fresh process sweeps with :func:`sagaguard.saga.recovery.recover` until the dead worker's
  saga is finished, then runs the outbox relay until it is idle (the confirmation email);
- ``naive``: the same calls with the plain SDKs and a per-call retry loop, no guard, no saga.
"""

from __future__ import annotations

import contextlib
import json
import smtplib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any, TypeVar

import httpx
import openai
import sqlalchemy as sa
import stripe
import tenacity
from sqlalchemy.orm import Session

from sagaguard.connectors.email import Email, EmailEffects, SmtpSettings
from sagaguard.connectors.errors import ProviderRejected
from sagaguard.connectors.http import IdempotentHttp
from sagaguard.connectors.llm import ChatJournal
from sagaguard.connectors.stripe import CHARGE, Payment, StripeEffects, refund_compensation
from sagaguard.idempotency import Guard, Retry, open_store
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.outbox import Outbox
from sagaguard.idempotency.testing import crash_point
from sagaguard.saga import Saga, SagaRunner, StepContext, recover
from sagaguard.saga.journals import open_journal
from sagaguard.saga.testing import CrashingSagaStore, KillPoint, Tripwire

__all__ = ["LEASE", "NAIVE_CRASH", "Plan", "Trip", "run_worker"]

LEASE = 0.5
"""Seconds a saga's and an effect's lease lasts in the demo (default 60): how long a dead worker
blocks the recovery."""
NAIVE_CRASH = "naive_after_charge"
"""The :func:`~sagaguard.idempotency.testing.crash_point` the naive worker dies at (right after the
charge)."""
_QUICK = Retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_fixed(0.05))
T = TypeVar("T")


@dataclass
class Trip:
    """What the traveller asked for."""

    traveller: str
    email: str
    destination: str
    hotel: str
    nights: int
    amount: int


@dataclass
class Plan:
    """What the model decided: the tool it called, with the call's id."""

    tool: str
    tool_call_id: str


_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book_trip",
            "description": "Charge the card, reserve the hotel and email the confirmation.",
            "parameters": {"type": "object", "properties": {"hotel": {"type": "string"}}},
        },
    }
]


def _messages(trip: Trip) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a travel agent. Book trips with the book_trip tool."},
        {
            "role": "user",
            "content": f"Book {trip.nights} nights at {trip.hotel} in {trip.destination} for "
            f"{trip.traveller}; budget {trip.amount / 100:.2f} EUR.",
        },
    ]


def _emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


# ------------------------------------------------------------------------------ with sagaguard


@contextlib.contextmanager
def _world(config: dict[str, Any]) -> Iterator[tuple[SagaRunner, Saga[Trip], Outbox, sa.Engine, ChatJournal]]:
    """The store, journal, outbox, connectors and saga of a guarded worker; closed on exit."""
    store = open_store(config["store"])
    if config.get("kill"):
        store = CrashingSagaStore(store, Tripwire(KillPoint.parse(config["kill"])))
    guard = Guard(store, namespace="demo", lease=LEASE, wait=20 * LEASE)
    journal = open_journal(config["journal"])
    engine = sa.create_engine(config["outbox"])
    outbox = Outbox()
    outbox.create_tables(engine)
    payments = StripeEffects(guard, api_key=config["stripe_key"], api_base=config["stripe_base"], timeout=5)
    hotels = httpx.Client(base_url=config["hotel_url"], timeout=5)
    model = openai.OpenAI(api_key="sk-local", base_url=config["chat_url"])
    chat = ChatJournal(guard, model, name="llm.plan")
    smtp = SmtpSettings(config["smtp_host"], int(config["smtp_port"]))
    mail = EmailEffects(guard, smtp, outbox=outbox, sender="trips@agent.example")
    trip = _trip_saga(payments, IdempotentHttp(guard, hotels), chat, mail, engine)
    runner = SagaRunner(journal, guard, lease=LEASE, wait=20 * LEASE)
    try:
        yield runner, trip, outbox, engine, chat
    finally:
        runner.close()
        hotels.close()
        model.close()
        engine.dispose()
        journal.close()
        guard.close()
        store.close()


def _trip_saga(
    payments: StripeEffects, hotels: IdempotentHttp, chat: ChatJournal, mail: EmailEffects, engine: sa.Engine
) -> Saga[Trip]:
    trip: Saga[Trip] = Saga("book_trip", version=1, input=Trip)

    @trip.step(compensate=None, retry=_QUICK)  # a journaled model call: nothing to undo
    def plan(ctx: StepContext, t: Trip) -> Plan:
        reply = chat.completions.create(model="local", messages=_messages(t), tools=_TOOLS)
        calls = reply.choices[0].message.tool_calls or []
        return Plan(tool=calls[0].function.name, tool_call_id=calls[0].id)

    @trip.step(compensate=refund_compensation(payments), retry=_QUICK)
    def charge_card(ctx: StepContext, t: Trip) -> Payment:
        card = "pm_card_visa"
        return payments.charge(t.amount, "eur", payment_method=card, description=f"trip {ctx.saga_id}")

    @trip.pivot(not_applied=(ProviderRejected,), retry=_QUICK)  # sold out: nothing to undo there
    def reserve_hotel(ctx: StepContext, t: Trip) -> str:
        body = {"traveller": t.traveller, "nights": t.nights, "tool_call_id": ctx.result(plan).tool_call_id}
        answer = hotels.post(f"/hotels/{t.hotel}/reservations", json=body, name="hotel.reserve")
        return str(answer.json()["id"])

    @trip.retriable(retry=_QUICK)  # after the pivot: only forward
    def email_confirmation(ctx: StepContext, t: Trip) -> str:
        confirmation = Email(
            to=[t.email],
            subject=f"Your trip to {t.destination} is booked",
            text=f"Hotel {t.hotel}, reservation {ctx.result(reserve_hotel)}, {t.amount / 100:.2f} EUR.",
        )
        with Session(engine) as session:  # once per step: a re-run gets the message it enqueued
            message_id = mail.send(session, confirmation)
            session.commit()
        return message_id

    return trip


def _guarded(config: dict[str, Any]) -> None:
    with _world(config) as (runner, trip, outbox, engine, chat):
        saga_id = config["saga_id"]
        if config["mode"] == "recover":
            deadline = time.monotonic() + 40 * LEASE
            while time.monotonic() < deadline:
                report = recover(runner.journal, runner.guard, trip, runner=runner)
                if saga_id in report.outcomes:
                    _emit("recovered", saga_id=saga_id)
                    break
                time.sleep(0.05)
        outcome = runner.run(trip, saga_id, Trip(**config["trip"]))  # a finished saga replays
        charged = EffectIdentity.of("demo", f"{saga_id}/charge_card", CHARGE, 0)
        record = runner.guard.store.get(charged.key)
        if record is not None:
            _emit("charge_record", state=record.state.value, claims=record.attempts)
        _emit("outcome", state=outcome.state.value, replayed=outcome.replayed)
        stats = outbox.relay(engine).run(until_idle=True)
        _emit("relay", delivered=stats.delivered)
        usage = chat.usage
        _emit("model", paid=usage.calls, saved=usage.saved_calls, saved_tokens=usage.saved_tokens)


# ------------------------------------------------------------------------------ the naive loop


def _retrying(call: Callable[[], T], tries: int = 3) -> T:
    """The usual hand-written retry loop: try again on any exception, a few times."""
    for attempt in range(1, tries + 1):
        try:
            return call()
        except Exception:
            if attempt == tries:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


def _naive(config: dict[str, Any]) -> None:
    t = Trip(**config["trip"])
    model = openai.OpenAI(api_key="sk-local", base_url=config["chat_url"], max_retries=0)
    payments = stripe.StripeClient(config["stripe_key"], base_addresses={"api": config["stripe_base"]})
    with model, httpx.Client(base_url=config["hotel_url"], timeout=5) as hotels:
        messages: Any = _messages(t)
        tools: Any = _TOOLS
        reply = _retrying(
            lambda: model.chat.completions.create(model="local", messages=messages, tools=tools)
        )
        _emit("planned", completion=reply.id)
        params: Any = {"amount": t.amount, "currency": "eur", "payment_method": "pm_card_visa"}
        params["confirm"] = True
        intent = _retrying(lambda: payments.v1.payment_intents.create(params=params))
        _emit("charged", payment_intent=intent.id)
        crash_point(NAIVE_CRASH)  # SIGKILL here on the first run: charged, the job's state lost

        def reserve() -> httpx.Response:
            answer = hotels.post(f"/hotels/{t.hotel}/reservations", json={"traveller": t.traveller})
            return answer.raise_for_status()

        try:
            reservation = _retrying(reserve)
        except httpx.HTTPStatusError as exc:
            _emit("failed", step="reserve_hotel", status=exc.response.status_code)
            return  # nobody remembers to refund the charge
        _emit("reserved", reservation=reservation.json()["id"])
        message = EmailMessage()
        message["From"], message["To"] = "trips@agent.example", t.email
        message["Subject"] = f"Your trip to {t.destination} is booked"
        message.set_content(f"Hotel {t.hotel}, {t.amount / 100:.2f} EUR.")

        def send() -> None:
            with smtplib.SMTP(config["smtp_host"], int(config["smtp_port"]), timeout=5) as smtp:
                smtp.send_message(message)

        _retrying(send)
        _emit("emailed")


def run_worker(config: dict[str, Any]) -> int:
    """Run one worker as ``config["mode"]`` says (``saga``, ``recover`` or ``naive``); returns 0."""
    provider = None
    if config.get("trace"):
        from sagaguard.connectors.demo._trace import install

        provider = install(config["trace"], f"sagaguard-demo-{config['mode']}")
    try:
        if config["mode"] == "naive":
            _naive(config)
        else:
            _guarded(config)
    finally:
        if provider is not None:
            provider.shutdown()
    return 0
