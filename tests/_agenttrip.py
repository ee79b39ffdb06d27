"""The trip agent's world, shared by the agent-saga tests of every framework: the tools' bodies, the
undos (the same functions for the Agents SDK and for ``create_agent``) and the saga type the worker
runs (``sagaguard sagas worker --app _agenttrip:registry``).

The tools book a hotel at a local HTTP API, charge a card through the real ``stripe`` SDK at the
local Stripe server and book a flight, which fails (``flight="fails"``: :class:`NoSeats`, sure not
to have booked), needs a human's approval (``"approval"``) or succeeds (``"ok"``). The undos cancel
the booking and refund the charge, each with an idempotency key derived from what it undoes.

Configuration, read from the environment at import (the in-process tests call :func:`configure`):
``AGENT_API``, ``STRIPE_BASE``, ``STRIPE_KEY``, ``AGENT_FLIGHT``, and ``AGENT_DIR`` (where
:func:`kill_once` leaves its marks). Kill points (``$SAGAGUARD_CRASH_AT``, once per test data set):
``in_model`` (the framework's child asks its model for the second answer: the booking and the
charge are done) and ``in_refund`` (right after the local Stripe server applied the refund, in
whichever process undoes the charge).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import stripe

from sagaguard.idempotency.testing import crash_at, sigkill
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentSaga, UndoRegistry

RUN = "trip-1"
TEXT = "book my trip to Oslo"
CONFIG: dict[str, str] = {
    "api": os.environ.get("AGENT_API", "http://127.0.0.1:9"),
    "stripe_base": os.environ.get("STRIPE_BASE", "http://127.0.0.1:9"),
    "stripe_key": os.environ.get("STRIPE_KEY", "sk_test_local"),
    "flight": os.environ.get("AGENT_FLIGHT", "fails"),
    "dir": os.environ.get("AGENT_DIR", "."),
}
BOOK_AND_PAY: list[tuple[str, dict[str, Any]]] = [
    ("book_hotel", {"hotel": "ritz"}),
    ("charge", {"amount": 420, "order": "trip-1"}),
]
PLAN: dict[int, list[tuple[str, dict[str, Any]]]] = {0: BOOK_AND_PAY, 2: [("book_flight", {"to": "Oslo"})]}
"""What the scripted models ask for, by the number of tool results the run holds (else: "done")."""


def configure(**values: str) -> None:
    """Point the tools and undos at other servers (the in-process tests)."""
    CONFIG.update(values)


def kill_once(point: str) -> None:
    """SIGKILL this process at ``point`` when ``$SAGAGUARD_CRASH_AT`` names it, once per
    ``AGENT_DIR`` (a mark there says it happened: the next process, a worker, goes on)."""
    mark = Path(CONFIG["dir"]) / f"killed-{point}"
    if crash_at() == point and not mark.exists():
        mark.write_text("1")
        sigkill(point)


def post(path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    """POST to the counting HTTP API with an ``Idempotency-Key``."""
    headers = {"Idempotency-Key": f'"{key}"'}
    reply = httpx.post(f"{CONFIG['api']}{path}", json=body, headers=headers, timeout=10)
    reply.raise_for_status()
    return dict(reply.json())


def payments() -> stripe.StripeClient:
    """The real Stripe SDK, at the local Stripe server."""
    return stripe.StripeClient(CONFIG["stripe_key"], base_addresses={"api": CONFIG["stripe_base"]})


class NoSeats(Exception):
    """The airline refused: nothing was booked."""


def book_hotel(hotel: str) -> dict[str, Any]:
    """Book a hotel."""
    return post("/bookings", {"hotel": hotel}, f"book-{hotel}")


def charge(amount: int, order: str) -> dict[str, Any]:
    """Charge the card."""
    intent = payments().v1.payment_intents.create(
        {"amount": amount, "currency": "eur", "payment_method": "pm_card_visa", "confirm": True,
         "metadata": {"order": order}},
        {"idempotency_key": f"charge-{order}"},
    )  # fmt: skip
    return {"payment_intent": intent.id, "amount": intent.amount}


def book_flight(to: str) -> dict[str, Any]:
    """Book a flight."""
    if CONFIG["flight"] == "fails":
        raise NoSeats(f"no seats to {to}")
    return post("/flights", {"to": to}, f"fly-{to}")


undos = UndoRegistry()


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    post("/cancellations", {"hotel": arguments["hotel"]}, f"cancel-{arguments['hotel']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    client = payments()
    if result is None:  # the charge's answer was never recorded: find it by its order
        found = [p for p in client.v1.payment_intents.list() if p.metadata.get("order") == arguments["order"]]
        if not found:
            return
        intent = found[0].id
    else:
        intent = result["payment_intent"]
    client.v1.refunds.create({"payment_intent": intent}, {"idempotency_key": f"refund-{intent}"})
    kill_once("in_refund")


@undos.register
def cancel_flight(arguments: dict[str, Any], result: Any | None) -> None:
    post("/flight-cancellations", {"to": arguments["to"]}, f"cancel-flight-{arguments['to']}")


trip_agent = AgentSaga("trip_agent", undos)
registry = SagaRegistry(trip_agent)  # the worker's guard comes from $SAGAGUARD_STORE
