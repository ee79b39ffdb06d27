"""The child side of test_crewai_checkpoint.py: a protected crew killed inside its FIRST task, run by
``.venv-crewai/bin/python``.

One agent (CrewAI's own OpenAI client pointed at ``sagaguard.connectors.testing.LocalChatModel``: it
calls the task's tool, then answers) and two tasks, checkpointed on ``task_started`` and
``task_completed``: ``pay`` (a charge at the counting service, as a guarded effect with a
reconciler inside the tool) and ``notify`` (a read). The crew is protected by
:class:`~sagaguard.connectors.frameworks.crewai.CrewGuard` and nothing else: no flush of CrewAI's
event bus anywhere, so the checkpoints on disk are those CrewAI wrote while the crew ran.

What the child looks at, in the kickoff's own thread: whether the checkpoint taken at the running
task's ``task_started`` event is on disk (a file whose event record holds that event) when the
task's step starts (a ``pre_step`` hook registered after ``protect``, so it runs after the
adapter's) and when the task's tool is first called.

Run as ``python tests/_crewaifirstcheckpoint.py '<json>'``: ``service`` (counter URL), ``model``
(the chat server's base URL) and ``steps``, each played in a fresh fork (``tests/_crewaichild.py``'s
:func:`main`) with ``dir``, ``run`` and ``action``:

- ``start``: a new crew's kickoff; with ``"crash": "after_effect"`` it dies by SIGKILL in ``pay``
  once the charge reached the service, before anything recorded it.
- ``resume``: what a restarted program does: ``Crew.from_checkpoint`` from the newest checkpoint,
  or, when there is none, a new crew (a new kickoff: new keys). Then ``kickoff()``.
- ``hooks``: no kickoff; crews protected in turn, and how many ``pre_step`` hooks CrewAI holds.

``async`` kicks off with ``akickoff``. Prints one JSON line per look (``{"look": "step" | "tool",
"task": ..., "on_disk": bool}``), per kickoff (``{"kickoff": ..., "restored": bool, ...}``) and for
``hooks``, each with the step's number.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

# Offline, quiet, and nothing written outside the test's folder: before crewai is imported.
for _name in ("CREWAI_DISABLE_TELEMETRY", "CREWAI_DISABLE_TRACKING", "OTEL_SDK_DISABLED",
              "CREWAI_DISABLE_VERSION_CHECK"):  # fmt: skip
    os.environ[_name] = "true"
os.environ["CREWAI_TRACING_ENABLED"] = "false"

from _crewaichild import checkpoints, main  # noqa: E402
from crewai import LLM, Agent, Crew, Task  # noqa: E402
from crewai.context import capture_execution_context  # noqa: E402
from crewai.hooks import InterceptionPoint, on  # noqa: E402
from crewai.state.checkpoint_config import CheckpointConfig  # noqa: E402
from crewai.tools import BaseTool  # noqa: E402

from sagaguard.connectors.frameworks.crewai import CrewGuard  # noqa: E402
from sagaguard.idempotency import Guard  # noqa: E402
from sagaguard.idempotency.effect import current_effect  # noqa: E402
from sagaguard.idempotency.stores.sql import SqlStore  # noqa: E402
from sagaguard.idempotency.testing import Charge, CounterClient, crash_point  # noqa: E402

AMOUNT = 1000
FOLDER: list[Path] = []
"""The checkpoints' folder of the step being played."""
GUARD: list[Guard] = []
STEP = [0]
"""The number of the step being played (on each line the child prints)."""


def task_started_on_disk() -> bool:
    """Whether the checkpoint CrewAI takes at the running task's ``task_started`` event is on disk:
    a checkpoint file whose event record holds that event (the innermost ``task_started`` of the
    kickoff's event scopes, read through CrewAI's public execution-context capture)."""
    stack = capture_execution_context().event_id_stack
    started = next((event_id for event_id, kind in reversed(stack) if kind == "task_started"), None)
    for path in checkpoints(FOLDER[0]):
        try:
            data = json.loads(path.read_text())
        except ValueError:  # being written: not there yet
            continue
        if data.get("trigger") == "task_started" and started in data["event_record"]["nodes"]:
            return True
    return False


def say(line: dict[str, Any]) -> None:
    print(json.dumps({"step": STEP[0], **line}), flush=True)


def look(where: str, task: str) -> None:
    say({"look": where, "task": task, "on_disk": task_started_on_disk()})


class PayTool(BaseTool):
    """Charges the customer at the counting service, as a guarded effect with a reconciler."""

    name: str = "pay"
    description: str = "Charge the customer for the invoice."
    service: str
    run_name: str

    def _run(self) -> str:
        look("tool", "pay")
        client = CounterClient(self.service)
        key = f"pay:{self.run_name}"

        @GUARD[0].effect("charge", reconciler=client.reconciler())
        def charge(amount: int) -> Charge:
            result = client.charge(key, amount, provider_key=current_effect().provider_key)
            crash_point("after_effect")  # the charge is made, nothing recorded it
            return result

        return charge(AMOUNT).charge_id


class NotifyTool(BaseTool):
    """Reads the receipt back (counted at the service)."""

    name: str = "notify"
    description: str = "Tell the customer the invoice is paid."
    service: str
    run_name: str

    def _run(self) -> str:
        look("tool", "notify")
        CounterClient(self.service).charge(f"notify:{self.run_name}", 1)
        return "told"


def build(config: dict[str, Any], *, checkpointed: bool = True) -> Crew:
    run, service = config["run"], config["service"]
    llm = LLM(model="gpt-4o-mini", base_url=config["model"], api_key="sk-local", max_retries=0)
    agent = Agent(role="billing clerk", goal="Settle invoices", backstory="Careful.", llm=llm, max_iter=3)
    pay = Task(name="pay", description="Pay the invoice.", expected_output="A receipt.", agent=agent,
               tools=[PayTool(service=service, run_name=run)])  # fmt: skip
    notify = Task(name="notify", description="Tell the customer.", expected_output="Done.", agent=agent,
                  tools=[NotifyTool(service=service, run_name=run)])  # fmt: skip
    events: list[Any] = ["task_started", "task_completed"]
    checkpoint = CheckpointConfig(location=str(FOLDER[0] / "checkpoints"), on_events=events)
    return Crew(agents=[agent], tasks=[pay, notify], checkpoint=checkpoint if checkpointed else None)


def hooks(config: dict[str, Any], crew_guard: CrewGuard) -> None:
    """How many ``pre_step`` hooks CrewAI holds as crews are protected, and which tasks wait."""
    from crewai.hooks import clear_all_hooks, get_hooks

    from sagaguard.connectors.frameworks._crewai_checkpoint import waits_for_checkpoint

    def count() -> int:
        return len(get_hooks(InterceptionPoint.PRE_STEP))

    counts = {"unprotected": count()}
    bare = crew_guard.protect(build(config, checkpointed=False))
    counts["without_checkpoint"] = count()
    crew = build(config)
    crew_guard.protect(crew)
    CrewGuard(GUARD[0]).protect(crew)  # another CrewGuard: still one hook
    crew_guard.protect(crew)
    counts["protected_three_times"] = count()
    clear_all_hooks()
    crew_guard.protect(crew)
    counts["after_clear_all_hooks"] = count()
    waits = {"without_checkpoint": [waits_for_checkpoint(t) for t in bare.tasks],
             "checkpointed": [waits_for_checkpoint(t) for t in crew.tasks]}  # fmt: skip
    say({"hooks": counts, "waits": waits})


def play(config: dict[str, Any]) -> None:
    """One step: a new crew's kickoff, or a restarted program's (see the module docstring)."""
    folder = Path(config["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    FOLDER[:] = [folder]
    STEP[0] = config["step"]
    store = SqlStore(f"sqlite:///{folder / 'effects.db'}")
    guard = Guard(store, namespace="crewai-first-checkpoint", lease=0.5, wait=20.0)
    GUARD[:] = [guard]
    crew_guard = CrewGuard(guard)
    try:
        if config["action"] == "hooks":
            hooks(config, crew_guard)
            return
        found = checkpoints(folder) if config["action"] == "resume" else []
        if found:
            crew = crew_guard.protect(Crew.from_checkpoint(CheckpointConfig(restore_from=str(found[-1]))))
        else:
            crew = crew_guard.protect(build(config))

        # Registered after protect: runs after the adapter's hook (hooks run in registration order).
        @on(InterceptionPoint.PRE_STEP)
        def at_step(step: Any) -> None:
            if step.kind == "task":
                look("step", str(step.task.name))

        output = asyncio.run(crew.akickoff()) if config.get("async") else crew.kickoff()
        say({"kickoff": config["action"], "restored": bool(found), "output": output.raw})
    finally:
        guard.close()
        store.close()


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1]), play))
