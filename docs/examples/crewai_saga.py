"""CrewAI in an agent saga: a crew books a hotel and charges the card, then its flight tool fails.
The kickoff's tool calls are undone in reverse order, each once. Needs crewai
(``pip install 'sagaguard[crewai]'``); without it, the example says so and exits."""

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

try:
    from crewai import LLM, Agent, Crew, Task
    from crewai.tools import BaseTool
except ImportError:
    print("crewai is not installed here: pip install 'sagaguard[crewai]' to run this example")
    sys.exit(0)

from sagaguard.connectors.frameworks.crewai import CrewGuard
from sagaguard.connectors.frameworks.crewai_saga import CrewSaga
from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.testing import LocalChatModel
from sagaguard.idempotency import Guard, open_store
from sagaguard.saga import SagaState
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal

world: list[str] = []  # stands in for the hotel and the card processor
undos = UndoRegistry()  # the same undos serve every framework: (arguments, the tool's output)


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    world.append(f"cancel {result['booking'] if result else arguments['hotel']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    world.append(f"refund {arguments['amount']}")


@changes_world(undo="cancel_booking")  # on the class: it survives Crew.from_checkpoint
class BookHotel(BaseTool):
    name: str = "book_hotel"
    description: str = "Book the hotel."

    def _run(self, hotel: str = "Ritz") -> str:
        world.append(f"book {hotel}")
        return json.dumps({"booking": f"bk-{hotel}"})


class Charge(BaseTool):
    name: str = "charge"
    description: str = "Charge the card."

    def _run(self, amount: int = 420) -> str:
        world.append(f"charge {amount}")
        return json.dumps({"charge": "ch-1", "amount": amount})


class BookFlight(BaseTool):
    name: str = "book_flight"
    description: str = "Book the flight."

    def _run(self) -> str:
        raise RuntimeError("no seats left")


folder = Path(tempfile.mkdtemp())
url = os.environ.get("SAGAGUARD_STORE", f"sqlite:///{folder / 'agent.db'}")
journal, guard = open_journal(url), Guard(open_store(url))
trip_crew = AgentSaga("trip_crew", undos)  # register it with the worker: SagaRegistry(trip_crew)
crew_saga = CrewSaga(AgentRunner(journal, guard), trip_crew)
crew_guard = CrewGuard(guard, saga=crew_saga, declare={"charge": changes_world(undo="refund")})

with LocalChatModel() as model:  # an OpenAI-compatible model that calls the task's tool
    llm = LLM(model="gpt-4o-mini", base_url=model.base_url, api_key="sk-local")
    agent = Agent(role="travel agent", goal="Book trips", backstory="Careful.", llm=llm)
    tasks = [
        Task(description=f"Use {tool.name}.", expected_output="Done.", agent=agent, tools=[tool])
        for tool in (BookHotel(), Charge(), BookFlight())
    ]
    # tool_failure_policy="raise": a failing tool ends the kickoff (by default the model reads it).
    crew = crew_guard.protect(Crew(agents=[agent], tasks=tasks, tool_failure_policy="raise"))
    try:
        crew.kickoff()
    except Exception as exc:
        print("the kickoff failed:", exc)

run_id = crew_saga.run_id(crew)  # the kickoff's event id: sagaguard sagas show RUN_ID
snapshot = journal.load(run_id) if run_id else None
print(world)
assert world == ["book Ritz", "charge 420", "refund 420", "cancel bk-Ritz"]
assert snapshot is not None and snapshot.saga.state is SagaState.COMPENSATED
print(f"run {run_id}: {snapshot.saga.state.value}")
crew_saga.runner.close()
