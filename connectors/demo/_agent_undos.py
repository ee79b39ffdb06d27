"""The agent demo's undos, and the saga type its runs are: what the worker imports.

``sagaguard sagas worker --app sagaguard.connectors.demo._agent_undos:registry`` finishes a compensation the
agent's process left (it imports no LangGraph: only what the undos call). Each undo reaches the
world once however often it runs: the hotel API and Stripe deduplicate by ``Idempotency-Key``, and
the email's correction is enqueued once per compensation (:mod:`sagaguard.connectors.email_correction`).
The services' addresses come from ``$SAGAGUARD_AGENT_DEMO`` (a JSON config).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import httpx
import stripe

from sagaguard.connectors.demo._worker import Trip
from sagaguard.connectors.demo.agent import CONFIG_ENV, THREAD, mailer
from sagaguard.connectors.email import Email
from sagaguard.idempotency.testing import crash_point
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentSaga, UndoRegistry

__all__ = [
    "cancel_booking",
    "correct_email",
    "demo_config",
    "outbox_mail",
    "payments",
    "post",
    "refund",
    "registry",
    "the_trip",
    "trip_agent",
    "undos",
]


@functools.cache
def demo_config() -> dict[str, Any]:
    """This process's config (``$SAGAGUARD_AGENT_DEMO``), read once."""
    found: dict[str, Any] = json.loads(os.environ[CONFIG_ENV])
    return found


def the_trip() -> Trip:
    """What the traveller asked for."""
    return Trip(**demo_config()["trip"])


def payments() -> stripe.StripeClient:
    """The ``stripe`` SDK's client, on the local Stripe server."""
    config = demo_config()
    return stripe.StripeClient(config["stripe_key"], base_addresses={"api": config["stripe_base"]})


def post(path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    """A write to the hotel and flight API, under an ``Idempotency-Key``."""
    reply = httpx.post(
        f"{demo_config()['api_url']}{path}", json=body, headers={"Idempotency-Key": f'"{key}"'}, timeout=10
    )
    reply.raise_for_status()
    return dict(reply.json())


@functools.cache
def outbox_mail() -> Any:
    """The sagaguard side's guard, store, outbox engine, outbox and email connector, built once."""
    return mailer(demo_config())


# ------------------------------------------------------------------------------ the undos

undos = UndoRegistry()


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    """Cancel the hotel booking (found by its key when the booking's answer was never recorded)."""
    booking = result["id"] if result else _booked(arguments["hotel"])
    if booking is not None:
        post("/cancellations", {"booking": booking}, f"cancel-{booking}")


def _booked(hotel: str) -> str | None:
    found = httpx.get(
        f"{demo_config()['api_url']}/resources", params={"key": f"{THREAD}-book-{hotel}"}, timeout=10
    )
    resources = found.json()["resources"]
    return str(resources[0]["id"]) if resources else None


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    """Refund the charge, under a Stripe idempotency key: run again after a crash, Stripe answers
    with the refund it already made."""
    intent = result["id"] if result else None
    if intent is None:
        found = payments().v1.payment_intents.search(params={"query": f"metadata['run']:'{THREAD}'"})
        intent = found.data[0].id if found.data else None
    if intent is not None:
        payments().v1.refunds.create(
            params={"payment_intent": intent}, options={"idempotency_key": f"refund-{intent}"}
        )
    crash_point("agent_after_refund")


def _cancelled(arguments: dict[str, Any], original: str) -> Email:
    trip = the_trip()
    return Email(
        to=[trip.email],
        subject=f"Cancelled: your trip to {trip.destination}",
        text="The flight was sold out: the hotel is cancelled and the card refunded.",
    )


@undos.register
def correct_email(arguments: dict[str, Any], result: Any | None) -> None:
    """The confirmation's correction: never delivered before the confirmation (the outbox)."""
    _, _, engine, _, mail = outbox_mail()
    mail.correction_undo(_cancelled, engine=engine)(arguments, result)


trip_agent = AgentSaga("trip_agent", undos)
registry = SagaRegistry(trip_agent)
"""What ``sagaguard sagas worker --app sagaguard.connectors.demo._agent_undos:registry`` runs."""
