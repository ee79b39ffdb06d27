"""The trip agent as a DBOS workflow on SQLite, run as a real process by tests/test_dbos_temporal_saga.py.

``python tests/_dbossagachild.py start`` launches DBOS and runs the workflow ``trip-1``;
``... recover`` launches DBOS, which recovers the workflow a killed process left, and waits for it.
Either prints ``{"result": ...}`` or ``{"error": ...}`` as JSON on its last line.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from _enginesagaworld import DB, book_flight, book_hotel, charge, die_once, runner, trip_agent
from dbos import DBOS, SetWorkflowID

from connectors.dbos_saga import DbosSagaTools
from connectors.declare import changes_world

WORKFLOW_ID = "trip-1"
tools = DbosSagaTools(runner(), trip_agent)


@DBOS.step()
@tools.tool
@changes_world(undo="cancel_booking")
def book_hotel_step(run: str, hotel: str) -> dict[str, Any]:
    return book_hotel(run, hotel)


@tools.tool(name="charge")
@changes_world(undo="refund")
def _charge(amount: int) -> dict[str, Any]:
    return charge(amount)


@DBOS.step()
def charge_step(amount: int) -> dict[str, Any]:
    value = _charge(amount)
    die_once("after_charge")  # the tool's row is recorded, DBOS has not recorded the step
    return value


@DBOS.step()
@tools.tool
def book_flight_step(run: str) -> str:  # read-only: nothing to undo
    return book_flight(run)


@DBOS.workflow()
@tools.workflow
def trip(hotel: str, amount: int) -> str:
    book_hotel_step(WORKFLOW_ID, hotel)
    charge_step(amount)
    return book_flight_step(WORKFLOW_ID)


def main(mode: str) -> int:
    directory = DB.removeprefix("sqlite:///").rsplit("/", 1)[0]
    DBOS(config={"name": "sagaguard-agent-test", "system_database_url": f"sqlite:///{directory}/dbos.sqlite"})
    DBOS.launch()  # recovers the workflows a killed process left
    try:
        if mode == "start":
            with SetWorkflowID(WORKFLOW_ID):
                handle = DBOS.start_workflow(trip, "ritz", 420)
        else:
            handle = DBOS.retrieve_workflow(WORKFLOW_ID)
        try:
            print(json.dumps({"result": handle.get_result()}), flush=True)
        except Exception as exc:
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 0
    finally:
        DBOS.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
