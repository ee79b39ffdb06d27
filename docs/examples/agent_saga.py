"""Agent sagas: an agent books a hotel and charges the card, then a later tool fails.

The run's tool calls are undone in reverse order, each once. A second run stops at a human's
approval and is rejected: its calls are undone too. The "agent" here is a plain loop over the tool
calls a model chose; with LangGraph or the Agents SDK the tools call ``current_run().call`` the same
way (see docs/agent_sagas.md).
"""

import os
from typing import Any

from sagaguard.idempotency import Guard, open_store
from sagaguard.saga import SagaRegistry, SagaState
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry, current_run
from sagaguard.saga.journals import open_journal

world: list[str] = []  # stands in for the hotel and the card processor
undos = UndoRegistry()  # filled at import, so the worker (another process) finds the same undos


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    # result is None when the call's outcome was never recorded: find the booking by its key
    # (sagaguard.saga.agent.undoing().key) then.
    world.append(f"cancel {result['booking'] if result else arguments['hotel']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    world.append(f"refund {arguments['amount']}")


def book_hotel(hotel: str) -> dict[str, str]:
    return current_run().call("book_hotel", lambda: _book(hotel), {"hotel": hotel}, undo="cancel_booking")


def charge(amount: int) -> dict[str, Any]:
    return current_run().call("charge", lambda: _charge(amount), {"amount": amount}, undo="refund")


def _book(hotel: str) -> dict[str, str]:
    world.append(f"book {hotel}")
    return {"booking": f"bk-{hotel}"}


def _charge(amount: int) -> dict[str, Any]:
    world.append(f"charge {amount}")
    return {"charge": "ch-1", "amount": amount}


def book_flight() -> None:
    raise RuntimeError("no seats left")


trip_agent = AgentSaga("trip_agent", undos)
registry = SagaRegistry(trip_agent)  # what `sagaguard sagas worker` is given

url = os.environ.get("SAGAGUARD_STORE", "sqlite:///agent.db")
journal = open_journal(url)
runner = AgentRunner(journal, Guard(open_store(url)))

try:
    with runner.run(trip_agent, "thread-1"):  # the framework's durable run id (a thread_id)
        book_hotel("Ritz")
        charge(420)
        book_flight()
except RuntimeError as exc:
    print("the run failed:", exc)
print(world)
assert world == ["book Ritz", "charge 420", "refund 420", "cancel bk-Ritz"]
snapshot = journal.load("thread-1")
assert snapshot is not None and snapshot.saga.state is SagaState.COMPENSATED

world.clear()
with runner.run(trip_agent, "thread-2") as run:
    book_hotel("Savoy")
    run.pause()  # the graph stopped at an approval (a LangGraph interrupt); no process is held
outcome = runner.reject(trip_agent, "thread-2", "the manager said no")
print(outcome.state.value, world)
assert outcome.state is SagaState.COMPENSATED and world == ["book Savoy", "cancel bk-Savoy"]
runner.close()
