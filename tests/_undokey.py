"""The world of the "answer lost" tests (issue 26, items 10-12), shared by every framework's child:
tools whose guarded effects go to a local counting API (``$AGENT_API``, a
``sagaguard.connectors.testing.LocalIdempotentApi``) under their provider keys, and the undos the worker
runs (``--app _undokey:registry``, or :func:`sagaguard.saga.recover` in the test's process).

The charge is made inside the tool's body by a guarded effect (``payments.charge``) under the
provider key of the body's scope; the process is SIGKILLed right after the API applied it, before
the tool returned (``$AGENT_KILL=in_charge``). The charge's answer is then lost: its undo
(:func:`refund_lost`) finds the charge at the API by ``provider_key("payments.charge")``, which
holds only when ``undoing().key`` is the scope the body really ran in. The confirmation email (the
pivot) is an at-most-once guarded effect; ``$AGENT_KILL=in_email`` kills right after the API took it.

Kills happen once per ``$AGENT_MARKS`` folder (a mark file says it happened).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx

from sagaguard.idempotency import Guard, current_effect
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentSaga, UndoRegistry, provider_key

CONFIG: dict[str, str] = {
    "api": os.environ.get("AGENT_API", "http://127.0.0.1:9"),
    "kill": os.environ.get("AGENT_KILL", ""),
    "marks": os.environ.get("AGENT_MARKS", "."),
}


def configure(**values: str) -> None:
    """Point the tools and undos elsewhere (an in-process test)."""
    CONFIG.update(values)


def die_once(point: str) -> None:
    """SIGKILL this process at ``point`` when ``$AGENT_KILL`` names it, once per marks folder."""
    mark = Path(CONFIG["marks"]) / f"killed-{point}"
    if CONFIG["kill"] == point and not mark.exists():
        mark.write_text("1")
        os.kill(os.getpid(), signal.SIGKILL)


def post(path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    """POST to the counting API with an ``Idempotency-Key``."""
    reply = httpx.post(
        f"{CONFIG['api']}{path}", json=body, headers={"Idempotency-Key": f'"{key}"'}, timeout=10
    )
    reply.raise_for_status()
    return dict(reply.json())


def made_under(key: str) -> list[dict[str, Any]]:
    """What the API applied under the provider key ``key``."""
    reply = httpx.get(f"{CONFIG['api']}/resources", params={"key": key}, timeout=10)
    reply.raise_for_status()
    return list(reply.json()["resources"])


class NoSeats(Exception):
    """The airline refused: nothing was booked."""


def book_hotel(hotel: str) -> dict[str, Any]:
    return post("/bookings", {"hotel": hotel}, f"book-{hotel}")


def _sent(path: str, body: dict[str, Any], point: str) -> dict[str, Any]:
    reply = post(path, body, current_effect().provider_key)
    die_once(point)  # the API applied it; its answer is lost (its record stays in progress)
    return reply


def charge(guard: Guard, amount: int) -> dict[str, Any]:
    """Charge under the provider key of the body's scope (``in_charge``: die once it is applied)."""
    return guard.run("payments.charge", lambda: _sent("/charges", {"amount": amount}, "in_charge"))


def send_email(guard: Guard, to: str) -> dict[str, Any]:
    """The confirmation email (the pivot): at most once, under its provider key (``in_email``)."""
    return guard.run("email.send", lambda: _sent("/emails", {"to": to}, "in_email"), policy="at_most_once")


def book_flight(to: str) -> dict[str, Any]:
    raise NoSeats(f"no seats to {to}")


undos = UndoRegistry()


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    post("/cancellations", {"hotel": arguments["hotel"]}, f"cancel-{arguments['hotel']}")


@undos.register
def refund_lost(arguments: dict[str, Any], result: Any | None) -> None:
    """Refund the charge made by the undone call's body, found at the API by the provider key it
    was sent under (its answer may never have been recorded: ``result`` is None then)."""
    for found in made_under(provider_key("payments.charge")):
        post("/refunds", {"charge": found["id"]}, f"refund-{found['id']}")


@undos.register
def cancel_flight(arguments: dict[str, Any], result: Any | None) -> None:
    post("/flight-cancellations", {"to": arguments["to"]}, f"cancel-flight-{arguments['to']}")


trip = AgentSaga("lost_answers", undos)
registry = SagaRegistry(trip)


def applied() -> dict[str, list[dict[str, Any]]]:
    """What the API applied, by path."""
    found: dict[str, list[dict[str, Any]]] = {}
    for resource in made_under_all():
        found.setdefault(resource["path"], []).append(resource)
    return found


def made_under_all() -> list[dict[str, Any]]:
    reply = httpx.get(f"{CONFIG['api']}/resources", timeout=10)
    reply.raise_for_status()
    return list(reply.json()["resources"])
