"""Agent sagas on DBOS: a workflow books a hotel and charges the card, then its flight step fails.

The run's saga is keyed on the workflow id; each tool step registers its undo before it runs and
holds the run only while it calls. The failed workflow's end step undoes the charge, then the
booking, each once; a second workflow completes and keeps its effects. DBOS runs on SQLite here.
"""

import os
from typing import Any

from dbos import DBOS, SetWorkflowID

from sagaguard.connectors.frameworks.dbos_saga import DbosSagaTools
from sagaguard.connectors.declare import changes_world
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga import SagaRegistry, SagaState
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal

world: list[str] = []  # stands in for the hotel and the card processor
undos = UndoRegistry()


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    world.append(f"cancel {arguments['hotel']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    world.append(f"refund {arguments['amount']}")


trip_agent = AgentSaga("dbos_trip", undos)
registry = SagaRegistry(trip_agent)  # what `sagaguard sagas worker` is given

url = os.environ.get("SAGAGUARD_STORE", "sqlite:///agent.db")
journal = open_journal(url)
tools = DbosSagaTools(AgentRunner(journal, Guard(open_store(url)), lease=5.0), trip_agent)


@DBOS.step()
@tools.tool
@changes_world(undo="cancel_booking")
def book_hotel(hotel: str) -> dict[str, str]:
    world.append(f"book {hotel}")
    return {"booking": f"bk-{hotel}"}


@DBOS.step()
@tools.tool
@changes_world(undo="refund")
def charge(amount: int) -> dict[str, int]:
    world.append(f"charge {amount}")
    return {"amount": amount}


@DBOS.step()
def book_flight(full: bool) -> str:
    if full:
        raise RuntimeError("no seats left")
    return "flight-1"


@DBOS.workflow()
@tools.workflow
def trip(hotel: str, amount: int, full: bool) -> str:
    book_hotel(hotel)
    charge(amount)
    return book_flight(full)


DBOS(config={"name": "dbos-agent-saga", "system_database_url": "sqlite:///dbos.sqlite"})
DBOS.launch()
try:
    with SetWorkflowID("trip-1"):  # the run's id
        trip("Ritz", 420, True)
except RuntimeError as exc:
    print("the workflow failed:", exc)
print(world)
assert world == ["book Ritz", "charge 420", "refund 420", "cancel Ritz"]
failed = journal.load("trip-1")
assert failed is not None and failed.saga.state is SagaState.COMPENSATED

world.clear()
with SetWorkflowID("trip-2"):
    assert trip("Savoy", 99, False) == "flight-1"
completed = journal.load("trip-2")
assert completed is not None and completed.saga.state is SagaState.COMPLETED
assert world == ["book Savoy", "charge 99"]  # a completed run keeps its effects
DBOS.destroy()
