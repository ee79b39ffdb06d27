"""The CrewAI agent-saga recipe with the declarations exactly as docs/agent_sagas.md writes them,
run as a real process by ``.venv-crewai/bin/python`` for tests/test_agent_saga_declared.py.

One agent (CrewAI's own OpenAI client pointed at ``sagaguard.connectors.testing.LocalChatModel``,
``$AGENT_MODEL``: it calls the task's tool, then answers) and two tasks: ``book`` (``book_hotel``,
declared on its class with its undo, as the page does) and ``pay`` (``charge``, declared by name at
the adapter); no ``policy=``. The tools' bodies and undos are the booking world's
(``tests/_declaredworld.py``, killed at ``in_booking``: CrewAI has not finished the tool). The crew
checkpoints at task boundaries, as the page asks; the checkpoints, the effects and the journal
live in ``$AGENT_DIR``.

``python tests/_crewaisagadeclared.py`` kicks off a new crew, or, when a checkpoint is there (a
killed process left it), restores the crew from the newest one (``Crew.from_checkpoint``) and
kicks it off: the same run. Prints the run's state and the crew's answer as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from _crewaichild import checkpoints
from _declaredworld import FOLDER, book, guard, pay, undos
from crewai import LLM, Agent, Crew, Task
from crewai.state.checkpoint_config import CheckpointConfig
from crewai.tools import BaseTool

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.crewai import CrewGuard
from sagaguard.connectors.frameworks.crewai_saga import CrewSaga
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentRunner, AgentSaga
from sagaguard.saga.journals import open_journal


@changes_world(undo="cancel_booking")  # on the class: it survives Crew.from_checkpoint
class BookHotel(BaseTool):
    name: str = "book_hotel"
    description: str = "Book the hotel."

    def _run(self, hotel: str = "ritz") -> str:
        return json.dumps(book(hotel))  # protect made the task wait: its checkpoint is on disk


class Charge(BaseTool):
    name: str = "charge"
    description: str = "Charge the card."

    def _run(self, amount: int = 420) -> str:
        return json.dumps(pay(amount))


journal = open_journal(f"sqlite:///{FOLDER / 'agent.db'}")
trip_crew = AgentSaga("trip_crew", undos)
registry = SagaRegistry(trip_crew)
crew_saga = CrewSaga(AgentRunner(journal, guard), trip_crew)  # the defaults
crew_guard = CrewGuard(guard, saga=crew_saga, declare={"charge": changes_world(undo="refund")})


def build() -> Crew:
    llm = LLM(model="gpt-4o-mini", base_url=os.environ["AGENT_MODEL"], api_key="sk-local", max_retries=0)
    agent = Agent(role="travel agent", goal="Book trips", backstory="Careful.", llm=llm, max_iter=3)
    tasks = [
        Task(description=f"Use {tool.name}.", expected_output="Done.", agent=agent, tools=[tool])
        for tool in (BookHotel(), Charge())
    ]
    events: list[Any] = ["task_started", "task_completed"]
    checkpoint = CheckpointConfig(location=str(FOLDER / "checkpoints"), on_events=events)
    return Crew(agents=[agent], tasks=tasks, tool_failure_policy="raise", checkpoint=checkpoint)


def main() -> int:
    found = checkpoints(FOLDER)
    restored = Crew.from_checkpoint(CheckpointConfig(restore_from=str(found[-1]))) if found else None
    crew = crew_guard.protect(restored or build())
    try:
        answer = crew.kickoff().raw
    finally:
        crew_saga.runner.close()
    run_id = crew_saga.run_id(crew)
    snapshot = journal.load(run_id) if run_id else None
    state = snapshot.saga.state.value if snapshot else "?"
    print(json.dumps({"state": state, "answer": answer, "restored": restored is not None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
