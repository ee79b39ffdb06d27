"""The figures of docs/frameworks/crewai.md#checkpoints-at-task-boundaries: how often a crew killed in
its first task finds the checkpoint of that task's start, and what waiting for it costs.

::

    .venv/bin/python bench/crewai_checkpoint.py --runs 10 --hogs 2
    .venv-crewai/bin/python bench/crewai_checkpoint.py --cost 10

``--runs``: the scenario of tests/test_crewai_checkpoint.py (its child, ``tests/_crewaifirstcheckpoint.py``,
under ``.venv-crewai/bin/python``: a protected two-task crew SIGKILLed inside the first task's tool
once the charge reached the counting service, then restarted), N times, with ``--hogs`` CPU-hog
processes running meanwhile. Prints, per run, where the child looked for the running task's
``task_started`` checkpoint and whether it was on disk, whether the restart restored a checkpoint,
the charges counted, and how many checkpoint writes panicked; then the totals. For the other side,
take the ``wait_for_task_checkpoints(crew)`` line out of ``CrewGuard.protect`` and run it again.

``--cost`` (in ``.venv-crewai``): kickoffs of a small protected crew (two tasks, checkpoints at both
boundaries, ``LocalChatModel``), alternately with the wait and with its hook unregistered; prints
the kickoffs' median times and the wait's own time per task start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "_crewaifirstcheckpoint.py"
CREW_PYTHON = ROOT / ".venv-crewai" / "bin" / "python"
sys.path.insert(0, str(ROOT / "tests"))  # the children's environment

from _crewenv import OFFLINE, busy_cores  # noqa: E402


def runs(count: int, hogs: int) -> None:
    from sagaguard.connectors.testing import LocalChatModel
    from sagaguard.idempotency.testing import CounterService

    env = os.environ | OFFLINE | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    totals: dict[str, int] = {"runs": 0, "step_look_missed": 0, "tool_look_missed": 0, "restored": 0,
                              "charged_twice": 0, "runs_with_a_panic": 0}  # fmt: skip
    with CounterService() as service, LocalChatModel() as model:
        for index in range(count):
            folder, run = Path(tempfile.mkdtemp(prefix="crew-first-")), f"b{uuid.uuid4().hex[:6]}"
            plan = [{"dir": str(folder), "run": run, "action": "start", "crash": "after_effect"},
                    {"dir": str(folder), "run": run, "action": "resume"}]  # fmt: skip
            config = {"service": service.url, "model": model.base_url, "steps": plan}
            with busy_cores(hogs):
                done = subprocess.run(
                    [str(CREW_PYTHON), str(CHILD), json.dumps(config)], env=env, stdin=subprocess.DEVNULL,
                    capture_output=True, text=True, timeout=900, check=False,
                )  # fmt: skip
            printed = done.stdout.splitlines()
            lines: list[dict[str, Any]] = [json.loads(x) for x in printed if x.startswith("{")]
            looks = [(x["step"], x["look"], x["task"], x["on_disk"]) for x in lines if "look" in x]
            restored = [x["restored"] for x in lines if "kickoff" in x]
            charges = service.count(f"pay:{run}")
            panics = done.stderr.count("dictionary changed size")
            print(json.dumps({"run": index, "looks": looks, "restored": restored, "charges": charges,
                              "panic_lines": panics}), flush=True)  # fmt: skip
            first = {(look[1]): look[3] for look in looks if look[0] == 0 and look[2] == "pay"}
            totals["runs"] += 1
            totals["step_look_missed"] += not first.get("step", False)
            totals["tool_look_missed"] += not first.get("tool", False)
            totals["restored"] += bool(restored and restored[0])
            totals["charged_twice"] += charges > 1
            totals["runs_with_a_panic"] += panics > 0
    print(json.dumps(totals))


def cost(count: int) -> None:
    for name, value in OFFLINE.items():
        os.environ[name] = value
    from crewai import LLM, Agent, Crew, Task
    from crewai.hooks import InterceptionPoint, on, unregister_hook
    from crewai.state.checkpoint_config import CheckpointConfig
    from crewai.tools import BaseTool

    from sagaguard.connectors.frameworks._crewai_checkpoint import _wait_for_checkpoint
    from sagaguard.connectors.frameworks.crewai import CrewGuard
    from sagaguard.connectors.testing import LocalChatModel
    from sagaguard.idempotency import Guard, open_store

    class Lookup(BaseTool):
        name: str = "lookup"
        description: str = "Look up."

        def _run(self) -> str:
            return "ok"

    waits: list[float] = []

    def timed(step: Any) -> None:  # the adapter's hook, timed
        started = time.perf_counter()
        _wait_for_checkpoint(step)
        waits.append(time.perf_counter() - started)

    folder = Path(tempfile.mkdtemp(prefix="crew-cost-"))
    store = open_store(f"sqlite:///{folder / 'effects.db'}")
    guard = Guard(store)
    times: dict[str, list[float]] = {"with": [], "without": []}
    with LocalChatModel() as model:

        def kickoff(mode: str, name: str) -> float:
            llm = LLM(model="gpt-4o-mini", base_url=model.base_url, api_key="sk-local", max_retries=0)
            agent = Agent(role="clerk", goal="Look things up", backstory="Careful.", llm=llm, max_iter=3)
            tasks = [Task(description=f"Look up {n}.", expected_output="It.", agent=agent, tools=[Lookup()])
                     for n in range(2)]  # fmt: skip
            events: list[Any] = ["task_started", "task_completed"]
            checkpoint = CheckpointConfig(location=str(folder / name), on_events=events)
            crew = CrewGuard(guard).protect(Crew(agents=[agent], tasks=tasks, checkpoint=checkpoint))
            unregister_hook(InterceptionPoint.PRE_STEP, _wait_for_checkpoint)
            if mode == "with":
                on(InterceptionPoint.PRE_STEP)(timed)
            try:
                started = time.perf_counter()
                crew.kickoff()
                return time.perf_counter() - started
            finally:
                unregister_hook(InterceptionPoint.PRE_STEP, timed)

        kickoff("with", "warm-with")
        kickoff("without", "warm-without")
        waits.clear()
        for index in range(count):
            for mode in ("with", "without") if index % 2 == 0 else ("without", "with"):
                times[mode].append(kickoff(mode, f"{mode}-{index}"))
    guard.close()
    store.close()
    for mode, found in times.items():
        print(f"kickoff {mode} the wait: median {statistics.median(found):.3f} s over {len(found)}")
    print(f"the wait per task start: median {statistics.median(waits) * 1000:.1f} ms, "
          f"max {max(waits) * 1000:.1f} ms over {len(waits)}")  # fmt: skip


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--runs", type=int, default=0, help="runs of the kill-and-restart scenario")
    parser.add_argument("--hogs", type=int, default=2, help="CPU-hog processes during each run")
    parser.add_argument("--cost", type=int, default=0, help="kickoffs each way (in .venv-crewai)")
    args = parser.parse_args()
    if args.runs:
        runs(args.runs, args.hogs)
    if args.cost:
        cost(args.cost)


if __name__ == "__main__":
    main()
