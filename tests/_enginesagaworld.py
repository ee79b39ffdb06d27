"""The trip agent's world for the DBOS and Temporal agent-saga tests, shared by their child processes.

The agent books a hotel at a local HTTP API (``$TRIP_API``, a ``sagaguard.connectors.testing`` server that
counts what it applied), charges a card through the real ``stripe`` SDK at the local Stripe server
(``$TRIP_STRIPE``), then its flight tool fails (``$TRIP_MODE=fail``) or books (``complete``). The
undos refund through ``StripeEffects`` (a guarded effect under a key derived from what it undoes)
and cancel at the HTTP API under an ``Idempotency-Key``. Kill points, by ``$TRIP_KILL``:
``after_charge`` (the charge tool returned and its row is recorded, the engine has not recorded
the step/activity), ``in_refund`` (the refund reached Stripe and is recorded, the compensation is
not finished); each fires once (a marker file in ``$TRIP_MARKS``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx

from sagaguard.connectors.stripe import StripeEffects
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal

API = os.environ.get("TRIP_API", "http://127.0.0.1:9")
STRIPE = os.environ.get("TRIP_STRIPE", "http://127.0.0.1:9")
STRIPE_KEY = os.environ.get("TRIP_STRIPE_KEY", "sk_test_local")
DB = os.environ.get("TRIP_DB", "sqlite:///trip.db")
KILL = os.environ.get("TRIP_KILL", "")
MARKS = Path(os.environ.get("TRIP_MARKS", "."))
MODE = os.environ.get("TRIP_MODE", "fail")
LEASE = 5.0
"""The run's lease, as the docs recommend for engines (a re-run after a crash waits it out)."""
CARD = "pm_card_visa"


def die_once(point: str) -> None:
    """SIGKILL this process at ``point`` if the test asked for it, the first time only."""
    mark = MARKS / f"killed-{point}"
    if point == KILL and not mark.exists():
        mark.write_text("1")
        os.kill(os.getpid(), signal.SIGKILL)


def post(path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    reply = httpx.post(f"{API}{path}", json=body, headers={"Idempotency-Key": f'"{key}"'}, timeout=10)
    reply.raise_for_status()
    return dict(reply.json())


guard = Guard(open_store(DB))  # the defaults a user gets
payments = StripeEffects(guard, api_key=STRIPE_KEY, api_base=STRIPE)
undos = UndoRegistry()


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    post("/cancellations", {"hotel": arguments["hotel"]}, f"cancel-{arguments['run']}-{arguments['hotel']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    assert result is not None, "the charge's result is recorded before any kill point"
    intent = result["payment_intent"]
    payments.refund(intent, key=f"undo/{intent}")
    die_once("in_refund")


trip_agent = AgentSaga("engine_trip", undos)
registry = SagaRegistry(trip_agent)  # what `sagaguard sagas worker --app` is given


def runner() -> AgentRunner:
    return AgentRunner(open_journal(DB), guard, lease=LEASE)


def book_hotel(run: str, hotel: str) -> dict[str, Any]:
    made = post("/bookings", {"hotel": hotel}, f"book-{run}-{hotel}")
    return {"booking": made["id"], "hotel": hotel}


def charge(amount: int) -> dict[str, Any]:
    payment = payments.charge(amount, "usd", payment_method=CARD)  # keyed on the step's scope
    return {"payment_intent": payment.id, "amount": amount}


def book_flight(run: str) -> str:
    if MODE == "fail":
        raise RuntimeError("no seats left on the flight")
    return "flight-1"
