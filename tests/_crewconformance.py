"""CrewAI's harnesses of the tool-call conformance table (tests/test_toolcall_conformance.py).

CrewAI pins openai<3 and the main environment has openai>=3 (the Agents SDK), so these harnesses
run only where CrewAI is importable: in ``.venv-crewai`` (``make .venv-crewai/.installed``), where
``test_the_crewai_rows_in_their_own_venv`` runs the table file again and reports each of its rows.
Elsewhere :func:`crew_harnesses` is empty.

The tools are classes of this module: ``Crew.from_checkpoint`` rebuilds a crew's tools from their
class names, so a tool's body cannot live on the instance (the running test's is in ``_BODY``).
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib.util
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.connectors.in_doubt import OnDoubt
from sagaguard.saga.agent import AgentSaga, UndoRegistry

CREW_HERE = importlib.util.find_spec("crewai") is not None
"""CrewAI is importable here: its harnesses run."""

_BODY: list[Callable[[str], str]] = []
"""The running test's body of ``book``."""

_CRASHES: list[int] = []
"""Non-empty: the next run of ``crash`` dies (the process stopping after ``book`` returned)."""

UNDOS = UndoRegistry()


@UNDOS.register
def cancel(arguments: dict[str, Any], result: Any | None) -> None:
    """The undo of ``book`` (a failed kickoff's run is undone with it: nothing to do)."""


SAGA = AgentSaga("conformance-crew", UNDOS)


class CrewCrash(BaseException):
    """The process dying in a kickoff: a ``BaseException``, so neither CrewAI nor the kickoff's run
    takes it for a failure (the run stays open, as a killed process leaves it)."""


if CREW_HERE:
    from crewai.tools import BaseTool

    class Book(BaseTool):
        """``book``: runs the test's body."""

        name: str = "book"
        description: str = "Book an item."

        def _run(self, item: str) -> str:
            return _BODY[-1](item)

    class Crash(BaseTool):
        """``crash``: unguarded; the process dies here once, after ``book`` returned."""

        name: str = "crash"
        description: str = "Finish the booking."

        def _run(self) -> str:
            if _CRASHES:
                _CRASHES.pop()
                raise CrewCrash("the process died here")
            return "ok"


@dataclass
class CrewHarness:
    """``CrewGuard`` (guarded) or ``CrewGuard(saga=CrewSaga(...))`` (saga mode) on a real crew whose
    model (CrewAI's own OpenAI client at ``LocalChatModel``) asks for ``book``, then ``crash``, then
    answers. The crew checkpoints at ``task_started`` and says ``tool_failure_policy="raise"`` (a
    tool's failure ends the kickoff instead of going to the model, as the other harnesses let it
    reach the caller). The re-run is ``Crew.from_checkpoint`` and a kickoff, protected again (the
    restored objects are new), as a restarted process does; in saga mode it continues the
    kickoff's run, whose id is the kickoff's event id (``env.run_id`` is set to it after the turn).

    Not the adapter's (``skips``, with CrewAI's own rows in their place): the call id of
    ``execute_tool_span`` and ``scope_per_attempt``, since no tool-call id reaches a CrewAI tool
    (the call's id is the adapter's key: kickoff, task, tool, argument hash, n; never put on a
    span); and ``scope_per_attempt``'s death by the test's ``Crash``, an ``Exception``, which CrewAI
    takes for the tool's failure (ending the kickoff, its run undone): CrewAI's row dies by a
    ``BaseException``. With no run open (the saga row ``no_open_run``) the tool runs outside any
    kickoff, in a scope, as an agent used on its own runs it.
    ``run_async`` kicks off with ``akickoff``.
    """

    name: str
    saga: bool
    run_async: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    """``CrewGuard``'s ``**options`` (its options for every tool)."""
    skips: tuple[str, ...] = ("execute_tool_span", "scope_per_attempt")
    why: dict[str, str] = field(
        default_factory=lambda: {
            "execute_tool_span": "no tool-call id reaches a CrewAI tool: "
            "test_crewai_execute_tool_span_has_no_call_id is CrewAI's row",
            "scope_per_attempt": "no call id is current in a CrewAI tool, and a tool's Exception ends the "
            "kickoff (its run undone): test_crewai_a_scope_per_attempt is CrewAI's row",
        }
    )

    def turn(
        self, env: Any, body: Callable[[str], str], declaration: ToolDeclaration, on_doubt: OnDoubt, *,
        rerun: bool, open_run: bool = True,
    ) -> list[str]:  # fmt: skip
        from crewai import Crew
        from crewai.state.checkpoint_config import CheckpointConfig

        from sagaguard.connectors.frameworks.crewai import CrewGuard
        from sagaguard.connectors.frameworks.crewai_saga import CrewSaga
        from sagaguard.connectors.testing import LocalChatModel
        from sagaguard.idempotency.keys import scope

        crew_saga = CrewSaga(env.runner, SAGA) if self.saga else None
        _BODY.append(_in_run(body, crew_saga))
        seen: list[str] = []

        def crew_guard() -> CrewGuard:
            declare, options = {"book": declaration}, self.options
            return CrewGuard(
                env.guard, declare=declare, on_doubt=on_doubt, saga=crew_saga, exclude={"crash"}, **options
            )

        if not open_run:
            with scope(env.run_id):
                return [crew_guard().guard_tool(Book()).run(item="room")]
        _CRASHES[:] = [1] if rerun else []
        script = [[{"name": "book", "args": {"item": "room"}}], [{"name": "crash", "args": {}}]]
        folder = Path(tempfile.mkdtemp(prefix="crew-conformance-"))
        errors: list[BaseException] = []
        crews: list[Any] = []

        def first() -> None:
            crews.append(_crew(model.base_url, folder))
            self._kickoff(_seen(crew_guard().protect(crews[-1]), seen, errors))

        def again() -> None:  # a restarted process: the crew restored from its newest checkpoint
            newest = sorted((folder / "checkpoints").rglob("*.json"), key=lambda p: p.stat().st_mtime_ns)
            assert newest, sorted(str(p) for p in folder.rglob("*"))
            crews.append(Crew.from_checkpoint(CheckpointConfig(restore_from=str(newest[-1]))))
            self._kickoff(_seen(crew_guard().protect(crews[-1]), seen, errors))

        with LocalChatModel(script=script, in_process=True) as model:
            try:
                _process(first, errors)
            except BaseException as exc:
                # The process died: in ``crash``, or in ``book`` (the test's own Crash).
                if not (rerun and (isinstance(exc, CrewCrash) or type(exc.__cause__).__name__ == "Crash")):
                    raise
                _CRASHES.clear()  # the process died once: the re-run finishes
                _process(again, errors)
            finally:
                if crew_saga is not None and crews:
                    env.run_id = crew_saga.run_id(crews[-1]) or env.run_id  # the run is the kickoff
        return seen

    def _kickoff(self, crew: Any) -> Any:
        # protect made the task wait for its checkpoint: the restore always has one
        return asyncio.run(crew.akickoff()) if self.run_async else crew.kickoff()


def _process(work: Callable[[], None], errors: list[BaseException]) -> None:
    """Run ``work`` as a process of its own would: in a fresh context (a kickoff that died leaves
    CrewAI's event scopes, context variables, open where it died; a restore sets the kickoff's in
    the context that kicks off).

    CrewAI's ``ToolExecutionFailedError`` (``tool_failure_policy="raise"``) carries the tool's
    exception by its class name only (``record.failure.code``, no ``__cause__``): when it names
    what the adapter raised to CrewAI, that exception is chained as its cause, so the table's error
    types are the adapter's (what it raised), checked against what CrewAI said."""
    from crewai.tools.tool_failure import ToolExecutionFailedError

    try:
        contextvars.Context().run(work)
    except ToolExecutionFailedError as exc:
        raised = errors[-1] if errors else None
        if raised is not None and exc.record.failure.code == type(raised).__name__:
            raise exc from raised
        raise


def _in_run(body: Callable[[str], str], crew_saga: Any) -> Callable[[str], str]:
    """The body with the kickoff's run current, for what the test reads of it (``current_run()``,
    as the other harnesses' bodies run inside ``with runner.run(...)``): a kickoff's run is open in
    a context of its own, which a tool's body is not in."""
    if crew_saga is None:
        return body

    def in_run(item: str) -> str:
        from sagaguard.saga.agent.run import _current

        token = _current.set(crew_saga.current())
        try:
            return body(item)
        finally:
            _current.reset(token)

    return in_run


def _crew(base_url: str, folder: Path) -> Any:
    from crewai import LLM, Agent, Crew, Task
    from crewai.state.checkpoint_config import CheckpointConfig

    llm = LLM(model="gpt-4o-mini", base_url=base_url, api_key="sk-local", max_retries=0)
    agent = Agent(
        role="booker", goal="Book the room", backstory="Careful.", llm=llm, max_iter=4, max_retry_limit=0,
    )  # fmt: skip
    tools = [Book(), Crash()]
    task = Task(description="Book a room.", expected_output="The booking.", agent=agent, tools=tools)
    checkpoint = CheckpointConfig(location=str(folder / "checkpoints"), on_events=["task_started"])
    return Crew(agents=[agent], tasks=[task], checkpoint=checkpoint, tool_failure_policy="raise")


def _seen(crew: Any, seen: list[str], errors: list[BaseException]) -> Any:
    """Keep what ``book``'s guarded run returned to CrewAI (the tool results the framework saw), or
    what it raised."""
    from sagaguard.connectors.frameworks._crewai_patch import shadow

    for task in crew.tasks:
        for tool in task.tools or []:
            if tool.name == "book":
                guarded = tool._run

                def run(*args: Any, _guarded: Any = guarded, **kwargs: Any) -> Any:
                    try:
                        result = _guarded(*args, **kwargs)
                    except Exception as exc:
                        errors.append(exc)
                        raise
                    seen.append(str(result))
                    return result

                shadow(tool, "_run", run)
    return crew


def crew_harnesses() -> list[Any]:
    """CrewAI's harnesses where CrewAI is importable, else none."""
    if not CREW_HERE:
        return []
    return [
        CrewHarness("crewai", saga=False),
        CrewHarness("crewai-saga", saga=True),
        CrewHarness("crewai-saga-akickoff", saga=True, run_async=True),
    ]
