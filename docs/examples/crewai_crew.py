"""CrewAI: a crew restored from its first checkpoint runs its tasks again, but its tool's charge is
not made again and its model calls are answered by the journal. Needs crewai
(``pip install 'sagaguard[crewai]'``); without it, the example says so and exits."""

import os
import sys
import tempfile
from pathlib import Path

try:
    from crewai import LLM, Agent, Crew, Task
    from crewai.events.event_bus import crewai_event_bus
    from crewai.state.checkpoint_config import CheckpointConfig
    from crewai.tools import BaseTool
except ImportError:
    print("crewai is not installed here: pip install 'sagaguard[crewai]' to run this example")
    sys.exit(0)

from sagaguard.connectors.frameworks.crewai import CrewGuard
from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.testing import LocalChatModel
from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.testing import CounterClient, CounterService

folder = Path(tempfile.mkdtemp())
store = open_store(os.environ.get("SAGAGUARD_STORE", f"sqlite:///{folder / 'effects.db'}"))
guard = Guard(store)
crew_guard = CrewGuard(guard, declare={"pay": changes_world()})  # pay changes the world


class PayTool(BaseTool):
    name: str = "pay"
    description: str = "Charge the customer for the invoice."
    service: str

    def _run(self) -> str:
        return CounterClient(self.service).charge("invoice-42", 1000).charge_id  # the provider's API


with CounterService() as payments, LocalChatModel() as model:  # a charge API, an OpenAI-compatible model
    llm = LLM(model="gpt-4o-mini", base_url=model.base_url, api_key="sk-local")
    clerk = Agent(role="billing clerk", goal="Settle invoices", backstory="Careful.", llm=llm)
    pay = Task(description="Pay invoice 42.", expected_output="A receipt.", agent=clerk,
               tools=[PayTool(service=payments.url)])  # fmt: skip
    checkpoints = CheckpointConfig(
        location=str(folder / "checkpoints"), on_events=["task_started", "task_completed"]
    )
    crew = crew_guard.protect(Crew(agents=[clerk], tasks=[pay], checkpoint=checkpoints))
    crew.kickoff()
    crewai_event_bus.flush()  # CrewAI writes checkpoints from its event-bus threads

    # As after a crash: restore from the checkpoint taken when the task started, protect, kick off.
    first = min((folder / "checkpoints").rglob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    paid_before = model.counters()["completions"]
    restored = crew_guard.protect(Crew.from_checkpoint(CheckpointConfig(restore_from=str(first))))
    print(f"restored crew: {restored.kickoff().raw}")
    print(f"charges at the service: {payments.count('invoice-42')}")
    print(f"model calls paid by the restored crew: {model.counters()['completions'] - paid_before}")

guard.close()
store.close()
