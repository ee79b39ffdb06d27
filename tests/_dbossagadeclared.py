"""The DBOS agent-saga recipe with the declarations exactly as docs/agent_sagas.md writes them, run
as a real process for tests/test_agent_saga_declared.py.

A workflow books a hotel, then charges a card: the trip succeeds. Its steps are declared as the
page declares them (``@DBOS.step()`` over ``@tools.tool`` over an undo by name, no ``policy=``),
the runner has the page's short lease, and the tools' bodies and undos are the booking world's
(``tests/_declaredworld.py``, killed at ``in_booking``: DBOS has not recorded the step). DBOS's
system database, the effects and the journal live in ``$AGENT_DIR``.

``python tests/_dbossagadeclared.py`` launches DBOS (which recovers the workflow a killed process
left), runs (or waits for) the workflow ``trip-1`` and prints its result and the run's state as
JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from _declaredworld import DB, FOLDER, book, guard, pay, undos
from dbos import DBOS, SetWorkflowID

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.dbos_saga import DbosSagaTools
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentRunner, AgentSaga
from sagaguard.saga.journals import open_journal

WORKFLOW_ID = "trip-1"

trip_agent = AgentSaga("dbos_trip", undos)
registry = SagaRegistry(trip_agent)
journal = open_journal(DB)
tools = DbosSagaTools(AgentRunner(journal, guard, lease=5.0), trip_agent)


@DBOS.step()
@tools.tool
@changes_world(undo="cancel_booking")
def book_hotel(hotel: str) -> dict[str, Any]:
    return book(hotel)


@DBOS.step()
@tools.tool
@changes_world(undo="refund")
def charge(amount: int) -> dict[str, Any]:
    return pay(amount)


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
