"""The trip agent as a DBOS workflow on SQLite, run as a real process by tests/test_dbos_temporal_saga.py.

``python tests/_dbossagachild.py start`` launches DBOS and runs the workflow ``trip-1``;
``... cancel`` starts it and cancels it (``DBOS.cancel_workflow``) once its charge is recorded;
``... recover`` launches DBOS, which recovers the workflow a killed process left, and waits for it.
Either prints ``{"result": ...}`` or ``{"error": ...}`` as JSON on its last line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from _enginesagaworld import DB, MARKS, book_flight, book_hotel, charge, die_once, runner, trip_agent
from dbos import DBOS, SetWorkflowID

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.dbos_saga import DbosSagaTools
from sagaguard.saga.journals import open_journal
from sagaguard.saga.records import RESUMABLE_STATES, StepState

WORKFLOW_ID = "trip-1"
LIVE = RESUMABLE_STATES  # running, compensating, waiting
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


@DBOS.step()
def hold_step() -> None:
    """An approval that never comes: it returns once the test has cancelled the workflow."""
    while not (MARKS / "go").exists():
        time.sleep(0.05)


@DBOS.workflow()
@tools.workflow
def trip(hotel: str, amount: int, wait: bool = False) -> str:
    book_hotel_step(WORKFLOW_ID, hotel)
    charge_step(amount)
    if wait:
        hold_step()
    return book_flight_step(WORKFLOW_ID)


def cancel_once_charged() -> str:
    """Cancel the workflow once its charge is recorded; wait for its run to end; its state."""
    journal = open_journal(DB)
    try:
        while not any(
            row.name.startswith("tool.charge.") and row.state is StepState.SUCCEEDED
            for row in getattr(journal.load(WORKFLOW_ID), "steps", ())
        ):
            time.sleep(0.05)
        DBOS.cancel_workflow(WORKFLOW_ID)
        (MARKS / "go").write_text("1")
        while (found := journal.load(WORKFLOW_ID)) is None or found.saga.state in LIVE:
            time.sleep(0.05)  # the cancelled workflow undoes its run inline: let it finish
        return found.saga.state.value
    finally:
        journal.close()


def main(mode: str) -> int:
    directory = DB.removeprefix("sqlite:///").rsplit("/", 1)[0]
    DBOS(config={"name": "sagaguard-agent-test", "system_database_url": f"sqlite:///{directory}/dbos.sqlite"})
    DBOS.launch()  # recovers the workflows a killed process left
    try:
        if mode in ("start", "cancel"):
            with SetWorkflowID(WORKFLOW_ID):
                handle = DBOS.start_workflow(trip, "ritz", 420, mode == "cancel")
            if mode == "cancel":
                print(json.dumps({"state": cancel_once_charged()}), flush=True)
                return 0
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
