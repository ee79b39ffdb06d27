"""A DBOS workflow as an agent saga, in the world of ``tests/_undokey.py``: run as a real process by
``tests/test_agent_saga_lost_answers.py``. Its steps book a hotel, then charge the card (killed
there, ``$AGENT_KILL=in_charge``), each a declared tool of ``DbosSagaTools``.
``python tests/_undokeydbos.py`` launches DBOS on SQLite next to ``$SAGAGUARD_STORE`` and runs the
workflow ``trip-1``.
"""

from __future__ import annotations

import os
from typing import Any

import _undokey as world
from dbos import DBOS, SetWorkflowID

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.dbos_saga import DbosSagaTools
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga.agent import AgentRunner
from sagaguard.saga.journals import open_journal

DB = os.environ.get("SAGAGUARD_STORE", "sqlite:///trip.db")
guard = Guard(open_store(DB))
tools = DbosSagaTools(AgentRunner(open_journal(DB), guard, lease=5.0), world.trip)


@DBOS.step()
@tools.tool
@changes_world(undo="cancel_booking", policy="at_least_once")
def book_hotel(hotel: str) -> dict[str, Any]:
    return world.book_hotel(hotel)


@DBOS.step()
@tools.tool
@changes_world(undo="refund_lost", policy="at_least_once")
def charge(amount: int) -> dict[str, Any]:
    return world.charge(guard, amount)


@DBOS.workflow()
@tools.workflow
def trip(hotel: str, amount: int) -> str:
    book_hotel(hotel)
    charge(amount)
    return "booked"


def main() -> None:
    directory = DB.removeprefix("sqlite:///").rsplit("/", 1)[0]
    DBOS(
        config={"name": "sagaguard-lost-answers", "system_database_url": f"sqlite:///{directory}/dbos.sqlite"}
    )
    DBOS.launch()
    try:
        with SetWorkflowID("trip-1"):
            DBOS.start_workflow(trip, "ritz", 606).get_result()
    finally:
        DBOS.destroy()


if __name__ == "__main__":
    main()
