"""The booking world of the declared-recipe kill tests (tests/test_agent_saga_declared.py), shared by
each framework's child (LangGraph, the OpenAI Agents SDK, DBOS, Temporal, CrewAI), which adds only
its framework and its tools' declarations, as docs/agent_sagas.md writes them.

The tools' bodies (:func:`book`, :func:`pay`) change the world only through a guarded connector
(``IdempotentHttp``, each request under its effect's ``Idempotency-Key``, keyed in the scope the
tool's body runs in) at a local API that counts what it applied (``$AGENT_API``). The guard has the
defaults a user gets; the effects and the journal live in ``$AGENT_DIR``.

Kill point (``$SAGAGUARD_CRASH_AT``, :func:`sagaguard.idempotency.testing.crash_point`):
``in_booking``, the API applied the booking and nothing recorded it yet (the booking's effect and
the tool's claim are both in progress).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from sagaguard.connectors.http import IdempotentHttp
from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.testing import crash_point
from sagaguard.saga.agent import UndoRegistry

API = os.environ.get("AGENT_API", "http://127.0.0.1:9")
FOLDER = Path(os.environ.get("AGENT_DIR", "."))
DB = f"sqlite:///{FOLDER / 'agent.db'}"


def _applied(response: httpx.Response) -> None:
    if response.request.url.path == "/bookings":
        crash_point("in_booking")  # the API applied the booking; nothing recorded it yet


guard = Guard(open_store(DB))  # the defaults a user gets
api = IdempotentHttp(guard, httpx.Client(base_url=API, timeout=10, event_hooks={"response": [_applied]}))

undos = UndoRegistry()


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    api.post("/cancellations", json={"hotel": arguments["hotel"]}, name="booking.cancel")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    api.post("/refunds", json={"amount": arguments["amount"]}, name="payments.refund")


def book(hotel: str) -> dict[str, Any]:
    """The booking tool's body: one guarded request (``booking.hotel``)."""
    return dict(api.post("/bookings", json={"hotel": hotel}, name="booking.hotel").json())


def pay(amount: int) -> dict[str, Any]:
    """The charge tool's body: one guarded request (``payments.charge``)."""
    return dict(api.post("/charges", json={"amount": amount}, name="payments.charge").json())
