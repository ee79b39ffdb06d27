"""The trip crew's undos, for the CrewAI agent-saga tests: imported by the crew's process
(``tests/_crewaisagachild.py``, in ``.venv-crewai``) and by ``sagaguard sagas worker --app
_crewaisaga:registry`` in the main environment, which has no CrewAI: the same undo functions serve
every framework, and the worker needs only them.

The booking goes to a local HTTP API (``$CREW_API``, a ``sagaguard.connectors.testing.LocalIdempotentApi``)
and the charge to the local Stripe (``$CREW_STRIPE``, ``sagaguard.connectors.testing.LocalStripe``) through
the real ``stripe`` SDK. The undos are idempotent as real ones are: each request carries an idempotency
key derived from what it undoes. Kill point (``$SAGAGUARD_CRASH_AT``): ``in_refund``, right after
Stripe applied the refund, once (a marker file in ``$CREW_MARKS`` says it happened).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import stripe

from sagaguard.idempotency.testing import crash_at, sigkill
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentSaga, UndoRegistry, provider_key

undos = UndoRegistry()
trip_crew = AgentSaga("trip_crew", undos)
registry = SagaRegistry(trip_crew)  # the worker's guard comes from $SAGAGUARD_STORE


def post(path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    """POST to the local HTTP API with an ``Idempotency-Key``."""
    api = os.environ["CREW_API"]
    reply = httpx.post(f"{api}{path}", json=body, headers={"Idempotency-Key": f'"{key}"'}, timeout=10)
    reply.raise_for_status()
    return dict(reply.json())


def stripe_client() -> stripe.StripeClient:
    """The real Stripe SDK, pointed at the local Stripe."""
    return stripe.StripeClient(
        "sk_test_sagaguard_local", base_addresses={"api": os.environ["CREW_STRIPE"]}, max_network_retries=0
    )


def die_once(point: str) -> None:
    """SIGKILL this process at ``point`` when ``$SAGAGUARD_CRASH_AT`` names it, the first time only."""
    mark = Path(os.environ.get("CREW_MARKS", ".")) / f"killed-{point}"
    if crash_at() == point and not mark.exists():
        mark.write_text("1")
        sigkill(point)


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    # result is None when the booking's outcome was never recorded: the API answers the booking's
    # key with the booking it made (and would make it now had it never arrived: cancelled below).
    booking = result or post("/bookings", {"hotel": arguments["hotel"]}, f"book-{arguments['hotel']}")
    post("/cancellations", {"booking": booking["id"]}, f"cancel-{booking['id']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    if result is None:  # the charge's outcome was never recorded: nothing here says which intent
        raise RuntimeError(f"charge {arguments} in doubt: find its PaymentIntent before refunding")
    stripe_client().v1.refunds.create(
        {"payment_intent": result["id"], "metadata": {"run": result["run"]}},
        {"idempotency_key": f"refund-{result['id']}"},
    )
    die_once("in_refund")


@undos.register
def refund_lost(arguments: dict[str, Any], result: Any | None) -> None:
    """Refund the charge the undone call's body made, found by the provider key it was sent under
    (``undoing().key`` is the body's scope), whether or not its answer was recorded."""
    key = provider_key("payments.charge")
    client = stripe_client()
    for intent in client.v1.payment_intents.list({"limit": 100}).data:
        metadata = intent.metadata.to_dict()
        if metadata.get("key") == key:
            client.v1.refunds.create(
                {"payment_intent": intent.id, "metadata": {"run": metadata["run"]}},
                {"idempotency_key": f"refund-{intent.id}"},
            )


@undos.register
def cancel_flight(arguments: dict[str, Any], result: Any | None) -> None:
    """The flight's undo: it failed before booking anything here, so there is nothing to cancel."""
