"""The DBOS agent-saga recipe with the declarations exactly as docs/agent_sagas.md writes them, run
as a real process for tests/test_agent_saga_declared.py.

A workflow books a hotel, then charges a card: the trip succeeds. Its steps are declared as the
page declares them (``@DBOS.step()`` over ``@tools.tool`` over an undo by name, no ``policy=``),
the runner has the page's short lease, and the tools' bodies change the world only through a
guarded connector (``IdempotentHttp``, each request under its effect's ``Idempotency-Key``) at a
local API that counts what it applied (``$AGENT_API``). DBOS's system database, the effects and
the journal live in ``$AGENT_DIR``.

Kill point (``$SAGAGUARD_CRASH_AT``, :func:`sagaguard.idempotency.testing.crash_point`):
``in_booking`` (the API applied the booking, its record is not written: the booking's effect and
the tool's claim are both in progress, DBOS has not recorded the step).

``python tests/_dbossagadeclared.py`` launches DBOS (which recovers the workflow a killed process
left), runs (or waits for) the workflow ``trip-1`` and prints its result and the run's state as
JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
from dbos import DBOS, SetWorkflowID

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.dbos_saga import DbosSagaTools
from sagaguard.connectors.http import IdempotentHttp
from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.testing import crash_point
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal

API = os.environ.get("AGENT_API", "http://127.0.0.1:9")
FOLDER = Path(os.environ.get("AGENT_DIR", "."))
DB = f"sqlite:///{FOLDER / 'agent.db'}"
WORKFLOW_ID = "trip-1"


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


trip_agent = AgentSaga("dbos_trip", undos)
registry = SagaRegistry(trip_agent)
journal = open_journal(DB)
tools = DbosSagaTools(AgentRunner(journal, guard, lease=5.0), trip_agent)


@DBOS.step()
@tools.tool
@changes_world(undo="cancel_booking")
def book_hotel(hotel: str) -> dict[str, Any]:
    return dict(api.post("/bookings", json={"hotel": hotel}, name="booking.hotel").json())


@DBOS.step()
@tools.tool
@changes_world(undo="refund")
def charge(amount: int) -> dict[str, Any]:
    return dict(api.post("/charges", json={"amount": amount}, name="payments.charge").json())


@DBOS.workflow()
@tools.workflow
def trip(hotel: str, amount: int) -> str:
    book_hotel(hotel)
    charge(amount)
    return "booked"


def main() -> int:
    DBOS(config={"name": "sagaguard-declared", "system_database_url": f"sqlite:///{FOLDER / 'dbos.sqlite'}"})
    DBOS.launch()  # recovers the workflow a killed process left
    try:
        if DBOS.get_workflow_status(WORKFLOW_ID) is not None:  # recovered: wait for it
            result = DBOS.retrieve_workflow(WORKFLOW_ID).get_result()
        else:
            with SetWorkflowID(WORKFLOW_ID):
                result = trip("ritz", 420)
    finally:
        DBOS.destroy()
    found = journal.load(WORKFLOW_ID)
    print(json.dumps({"result": result, "state": found.saga.state.value if found else "?"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
