"""The child side of test_crewai.py: real CrewAI crews, run by ``.venv-crewai/bin/python``.

CrewAI needs openai<3 and the main environment has openai>=3, so the crews run here, in their own
environment, and the test (in the main one) reads what this prints and what the services counted.

The crew: one agent whose model is CrewAI's own OpenAI client pointed at
``sagaguard.connectors.testing.LocalChatModel`` (it calls the first tool offered, then answers text), and two
tasks with checkpoints on ``task_started`` and ``task_completed``: ``lookup`` (a read, counted at the
counting service) and ``pay`` (a charge at the counting service). With ``sagaguard`` the crew is
protected by :class:`sagaguard.connectors.frameworks.crewai.CrewGuard` and the charge is a guarded effect with
a reconciler; ``plain`` is CrewAI and its checkpoints alone.

Run as ``python tests/_crewaichild.py '<json>'``; the JSON holds ``service`` (counter URL), ``model``
(the chat server's base URL) and ``steps``, each played in a fresh process (see :func:`main`), with
``dir``, ``run`` (names what the service counts), ``mode`` (one, or several separated by commas: one
crew each, in turn, in ``dir/MODE``, counted as ``RUN-MODE``), ``action`` and optionally ``crash``:

- ``start``: a new crew's kickoff. With ``"crash": "after_effect"`` it dies by SIGKILL in ``pay``
  after the charge reached the service, before anything recorded it (the checkpoint taken when
  ``pay`` started is on disk: ``protect`` makes a task wait for it, and the ``plain`` crew waits as
  a protected one would, see ``tests/_crewcheckpoint.py``).
- ``resume``: ``Crew.from_checkpoint`` from the newest checkpoint, then ``kickoff()``.
- ``replay``: a clean kickoff, then a restore from the *first* checkpoint (``lookup`` started) and a
  kickoff in the same process: the whole crew runs again from its start.

Prints one JSON line per kickoff: the step, the mode, the crew's output, the task outputs, the model
calls the chat server answered during the kickoff and the kickoff's event id.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
import urllib.request
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

# Offline, quiet, and nothing written outside the test's folder: before crewai is imported.
for _name in ("CREWAI_DISABLE_TELEMETRY", "CREWAI_DISABLE_TRACKING", "OTEL_SDK_DISABLED",
              "CREWAI_DISABLE_VERSION_CHECK"):  # fmt: skip
    os.environ[_name] = "true"
os.environ["CREWAI_TRACING_ENABLED"] = "false"

from _crewcheckpoint import checkpoints_written  # noqa: E402
from crewai import LLM, Agent, Crew, Task  # noqa: E402
from crewai.events.event_bus import crewai_event_bus  # noqa: E402
from crewai.state.checkpoint_config import CheckpointConfig  # noqa: E402
from crewai.tools import BaseTool  # noqa: E402

from sagaguard.idempotency import Guard  # noqa: E402
from sagaguard.idempotency.effect import current_effect  # noqa: E402
from sagaguard.idempotency.stores.sql import SqlStore  # noqa: E402
from sagaguard.idempotency.testing import CRASH_ENV, Charge, CounterClient, crash_point  # noqa: E402

NAMESPACE = "crewai-crash"
AMOUNT = 1000
GUARDS: list[Guard | None] = [None]
"""The guard of the crew being played (``sagaguard`` mode): the tools' inner effects run under it."""


class LookupTool(BaseTool):
    """Reads the invoice (counted at the service, as a paid API would)."""

    name: str = "lookup"
    description: str = "Look up the invoice to pay."
    service: str
    run_name: str

    def _run(self) -> str:
        CounterClient(self.service).charge(f"lookup:{self.run_name}", 1)
        return f"invoice {self.run_name}: {AMOUNT}"


class PayTool(BaseTool):
    """Charges the customer at the counting service; in ``sagaguard`` mode as a guarded effect."""

    name: str = "pay"
    description: str = "Charge the customer for the invoice."
    service: str
    run_name: str

    def _run(self) -> str:
        client = CounterClient(self.service)
        key = f"pay:{self.run_name}"
        guard = GUARDS[0]
        if guard is None:
            charged = client.charge(key, AMOUNT)
            crash_point("after_effect")
            return charged.charge_id

        @guard.effect("charge", reconciler=client.reconciler())
        def charge(amount: int) -> Charge:
            result = client.charge(key, amount, provider_key=current_effect().provider_key)
            crash_point("after_effect")
            return result

        return charge(AMOUNT).charge_id


def build(folder: Path, config: dict[str, Any]) -> Crew:
    run = config["run"]
    llm = LLM(model="gpt-4o-mini", base_url=config["model"], api_key="sk-local", max_retries=0)
    agent = Agent(role="billing clerk", goal="Settle invoices", backstory="Careful.", llm=llm, max_iter=3)
    lookup = Task(description="Look up the invoice.", expected_output="The invoice.", agent=agent,
                  tools=[LookupTool(service=config["service"], run_name=run)])  # fmt: skip
    pay = Task(description="Pay the invoice.", expected_output="A receipt.", agent=agent,
               tools=[PayTool(service=config["service"], run_name=run)])  # fmt: skip
    events: list[Any] = ["task_started", "task_completed"]
    checkpoint = CheckpointConfig(location=str(folder / "checkpoints"), on_events=events)
    return Crew(agents=[agent], tasks=[lookup, pay], checkpoint=checkpoint)


def checkpoints(folder: Path) -> list[Path]:
    """The crew's checkpoint files, oldest first."""
    return sorted((folder / "checkpoints").rglob("*.json"), key=lambda p: p.stat().st_mtime_ns)


def model_calls(base_url: str) -> int:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/_sagaguard/counters", timeout=10) as r:
        return int(json.load(r).get("completions", 0))


def kickoff(crew: Crew, config: dict[str, Any]) -> None:
    before = model_calls(config["model"])
    # The crew without sagaguard waits at each task's start as a protected one does, so both rows
    # restore from the same checkpoints (CrewAI alone loses one now and then: tests/_crewcheckpoint.py).
    with checkpoints_written() if config["mode"] == "plain" else nullcontext():
        output = asyncio.run(crew.akickoff()) if config.get("async") else crew.kickoff()
    print(json.dumps({
        "step": config["step"],
        "mode": config["mode"],
        "output": output.raw,
        "tasks": [t.output.raw if t.output is not None else None for t in crew.tasks],
        "model_calls": model_calls(config["model"]) - before,
        "kickoff": crew._kickoff_event_id,
    }), flush=True)  # fmt: skip


def play(config: dict[str, Any]) -> None:
    """One crew of ``config["mode"]`` in ``config["dir"]``: start, resume, or replay."""
    folder = Path(config["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    protect: Callable[[Crew], Crew] = lambda crew: crew  # noqa: E731
    guard = store = None
    if config["mode"] == "sagaguard":
        from sagaguard.connectors.frameworks.crewai import CrewGuard

        store = SqlStore(f"sqlite:///{folder / 'effects.db'}")
        guard = Guard(store, namespace=NAMESPACE, lease=0.5, wait=20.0)
        # The default: pay is read-only at the tool level (undeclared); the charge inside it is a
        # guarded effect (replayed or reconciled), so a crash inside pay re-runs it.
        protect = CrewGuard(guard).protect
    GUARDS[0] = guard
    try:
        if config["action"] == "start":
            kickoff(protect(build(folder, config)), config)
        elif config["action"] == "resume":
            newest = checkpoints(folder)[-1]
            kickoff(protect(Crew.from_checkpoint(CheckpointConfig(restore_from=str(newest)))), config)
        else:  # replay
            kickoff(protect(build(folder, config)), config)
            crewai_event_bus.flush()  # the checkpoints are written from the event bus's threads
            first = checkpoints(folder)[0]
            kickoff(protect(Crew.from_checkpoint(CheckpointConfig(restore_from=str(first)))), config)
    finally:
        GUARDS[0] = None
        if guard is not None:
            guard.close()
        if store is not None:
            store.close()


class AsyncPayTool(BaseTool):
    """A tool with an async body: charges at the service."""

    name: str = "apay"
    description: str = "Charge the customer, asynchronously."
    service: str
    run_name: str

    async def _arun(self, amount: int) -> str:
        return CounterClient(self.service).charge(f"apay:{self.run_name}", amount).charge_id

    def _run(self, amount: int) -> str:
        raise NotImplementedError("async only")


def units(config: dict[str, Any]) -> None:
    """The async paths and the answer types outside a crew, under a caller's scope: each call is
    made by a first CrewGuard, then by a second one (a re-run: its counts start from zero)."""
    from sagaguard.connectors.frameworks.crewai import CrewGuard
    from sagaguard.idempotency.errors import NoScope
    from sagaguard.idempotency.keys import scope

    folder = Path(config["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    store = SqlStore(f"sqlite:///{folder / 'effects.db'}")
    guard = Guard(store, namespace=NAMESPACE)
    messages = [{"role": "user", "content": "Pay the invoice."}]
    tools = [{"type": "function", "function": {"name": "pay", "description": "Pay.", "parameters": {}}}]
    report: dict[str, Any] = {"step": config["step"], "mode": "units"}
    try:
        llm = LLM(model="gpt-4o-mini", base_url=config["model"], api_key="sk-local", max_retries=0)
        runs = []
        for _ in range(2):
            crew_guard = CrewGuard(guard)
            journaled = crew_guard.journal(llm.model_copy())
            tool = crew_guard.guard_tool(AsyncPayTool(service=config["service"], run_name=config["run"]))
            before = model_calls(config["model"])
            with scope(f"units-{config['run']}"):
                text = asyncio.run(journaled.acall(messages))
                calls = journaled.call(messages, tools=tools)
                receipt = asyncio.run(tool.arun(amount=5))
            runs.append({
                "text": text, "calls": [c.model_dump(mode="json") for c in calls],
                "call_types": sorted({type(c).__name__ for c in calls}),
                "receipt": receipt, "paid": model_calls(config["model"]) - before,
            })  # fmt: skip
        report["runs"] = runs
        try:
            CrewGuard(guard).journal(llm.model_copy()).call(messages)
        except NoScope as exc:
            report["outside"] = type(exc).__name__
    finally:
        guard.close()
        store.close()
    print(json.dumps(report), flush=True)


def step(config: dict[str, Any]) -> None:
    """Play one step (see the module docstring) for each of its modes, in turn."""
    if config["action"] == "units":
        units(config)
        return
    for mode in config["mode"].split(","):
        run = f"{config['run']}-{mode}"
        play({**config, "mode": mode, "dir": str(Path(config["dir"]) / mode), "run": run})


def main(config: dict[str, Any], play_step: Callable[[dict[str, Any]], None] = step) -> int:
    """Play ``config["steps"]`` in turn (each with ``play_step``), each in a fork of this process.

    CrewAI's import costs seconds of CPU; forked after it, each step is a fresh process all the
    same (nothing has run in this one: no crew, no event bus thread), and a SIGKILL kills the
    step's process only. After each step, one line ``{"step": i, "exit": code, "signal": n}``.
    """
    for index, spec in enumerate(config["steps"]):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the step's own process: it exits here, or is killed on the way
            code = 1
            try:
                os.environ.pop(CRASH_ENV, None)
                if spec.get("crash"):
                    os.environ[CRASH_ENV] = spec["crash"]
                os.environ["CREWAI_STORAGE_DIR"] = str(Path(spec["dir"]) / "crewai-storage")
                play_step({**config, **spec, "step": index})
                crewai_event_bus.flush()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        print(json.dumps({"step": index, "exit": code, "signal": signal}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
