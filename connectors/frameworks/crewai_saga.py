"""CrewAI crews in an agent saga: each call of a tool declared with an undo (or as the pivot) is a
step of the kickoff's run, registered before the tool runs.

::

    @changes_world(undo="cancel_booking")     # a name in the saga's UndoRegistry; on the class, it
    class BookHotel(BaseTool): ...            # survives Crew.from_checkpoint (new tool objects)

    trip_crew = AgentSaga("trip_crew", undos)                     # register it with the worker too
    crew_saga = CrewSaga(AgentRunner(journal, guard), trip_crew)
    crew_guard = CrewGuard(guard, saga=crew_saga, declare={"charge": changes_world(undo="refund")})
    crew = crew_guard.protect(Crew(agents=[...], tasks=[...], checkpoint=CheckpointConfig(...)))
    crew.kickoff()        # returned: COMPLETED, effects kept; raised: the steps undone in reverse

**The run is the kickoff.** Its saga id is the kickoff's event id (``crew_kickoff_started``), which
``Crew.from_checkpoint`` restores, so a restored crew's kickoff continues the same run: its replayed
tool calls find their steps (and the guard replays their results). The saga is started by the
kickoff's first step (a kickoff that calls no declared tool has no saga); a restored kickoff whose
run is in the journal attaches to it when it starts, taking it back from the worker if the worker
had parked it. A restart that cannot restore a checkpoint kicks off a new run: the old one, whose
process is gone, is undone by the worker once its abandon deadline has passed (``abandon_after``,
recorded with the run: :data:`ABANDON_AFTER` by default), so its effects are not left in place.

**A call's id** is the adapter's key of the tool run (kickoff, task, tool, argument hash, n: no
tool-call id reaches CrewAI tools, see :mod:`sagaguard.connectors.frameworks.crewai`). The undo receives the
call's arguments by name and the tool's output (read back as JSON when it is JSON text), as every
framework's adapter gives them, so the same undo functions serve every framework. The tool's body
runs in the scope ``{run id}/{call id}``, the undone call's ``undoing().key``.

**Triggers.** An exception escaping ``kickoff`` undoes the run (``AgentSaga(on_failure=...)``:
``"compensate"`` by default, ``"leave"`` parks it for an operator). A tool's own exception is
handed to the model by CrewAI unless the crew, agent, task or tool says
``tool_failure_policy="raise"``. ``sagaguard sagas cancel RUN`` stops a live kickoff at its next
declared tool call (:class:`~sagaguard.saga.agent.errors.AgentRunCancelled`) and undoes it; the worker undoes
a run whose process is gone. A human who says no at an approval (:meth:`CrewSaga.approval`, a task
guardrail) undoes the run at once, and :meth:`CrewSaga.reject` undoes it from any process.

A declared tool's runs are steps through ``_run`` (which CrewAI's agents call, in ``kickoff`` and
``akickoff`` alike) and through its own ``_arun`` where it has one (a direct ``await
tool.arun(...)``: :meth:`AgentRun.acall <sagaguard.saga.agent.AgentRun.acall>`, journal writes off the loop).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from crewai import Crew

from sagaguard.connectors.declare import recorded_output
from sagaguard.connectors.frameworks._crewai_patch import is_marked, mark, shadow
from sagaguard.connectors.frameworks.crewai import kickoff_id
from sagaguard.idempotency.checks import seconds
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.saga.agent import AgentRun, AgentRunner, AgentRunRejected, AgentSaga, current_run
from sagaguard.saga.records import SagaOutcome

__all__ = ["ABANDON_AFTER", "CrewSaga", "KickoffRejected", "tool_output"]

ABANDON_AFTER = 600.0
"""The default abandon deadline of a kickoff's run, in seconds (see :class:`CrewSaga`)."""

_RUN_ID = "__sagaguard_run_id__"
"""Set on a crew instance: the saga id of its latest kickoff that made a step."""


class KickoffRejected(AgentRunRejected):
    """A human rejected the kickoff at an approval (:meth:`CrewSaga.approval`). Its run is undone
    before this escapes ``kickoff``; the run's saga records the rejection as its cause.

    Attributes:
        reason: what the human said.
    """


tool_output = recorded_output
"""What a step records of a tool's result for its undo: JSON text read back as JSON (CrewAI tools
return strings), anything else as it is (:func:`sagaguard.connectors.declare.recorded_output`)."""


class _Kickoff:
    """The agent run of one kickoff, opened on its first step (or at once for a restored one).

    The run is entered and left in a context of its own: CrewAI runs tools in copies of the
    kickoff's context (parallel tool calls, async tasks, timeouts), so the step that opens the run
    is not where the kickoff ends, and a run's context must be left where it was entered.
    """

    def __init__(self, saga: CrewSaga, crew: Crew) -> None:
        self.saga = saga
        self.crew = crew
        self.run: AgentRun | None = None
        self._lock = threading.Lock()
        self._context = contextvars.Context()

    def open(self, run_id: str) -> AgentRun:
        with self._lock:
            if self.run is None:
                run = self.saga.runner.run(self.saga.agent, run_id, abandon_after=self.saga.abandon_after)
                self._context.run(run.__enter__)
                self.run = run
                shadow(self.crew, _RUN_ID, run_id)
            elif self.run.run_id != run_id:
                raise ConfigurationError(
                    f"a kickoff's run is {self.run.run_id!r}, a step asks for {run_id!r}: "
                    "protect each crew with its own kickoff"
                )
            return self.run

    def close(self, exc: BaseException | None) -> None:
        """End the run as the kickoff ended: returned, raised, or rejected by a human."""
        run = self.run
        if run is None:
            return
        if isinstance(exc, KickoffRejected):
            self._context.run(run.reject, exc.reason)
        tb: TracebackType | None = None if exc is None else exc.__traceback__
        self._context.run(run.__exit__, None if exc is None else type(exc), exc, tb)


_kickoff: contextvars.ContextVar[_Kickoff | None] = contextvars.ContextVar(
    "sagaguard_crewai_kickoff", default=None
)


class CrewSaga:
    """Runs a protected crew's kickoffs as agent runs of ``agent``. Give it to
    ``CrewGuard(guard, saga=...)``; :meth:`CrewGuard.protect` then wraps the crew's ``kickoff`` and
    ``akickoff`` (in place, as it guards tools) and makes the declared tools' calls steps.

    Args:
        runner: opens the runs (its guard runs the steps and the undos; give the worker a guard on
            the same store and namespace).
        agent: the saga type of the crew's runs, with its undos (register it with the worker).
        abandon_after: seconds a kickoff's run whose process is gone may stay un-resumed before the
            worker compensates it (default :data:`ABANDON_AFTER`, 10 minutes), recorded with each
            run, so the worker needs no setting; the saga type's own ``abandon_after`` wins when
            it has one. A kickoff that could not restore its checkpoint is a new run: this bounds
            how long the old one keeps its effects. None waits for ever.

    Raises:
        ConfigurationError: a negative or non-finite ``abandon_after``.
    """

    def __init__(
        self, runner: AgentRunner, agent: AgentSaga, *, abandon_after: float | None = ABANDON_AFTER
    ) -> None:
        self.runner = runner
        self.agent = agent
        self.abandon_after = None if abandon_after is None else seconds("abandon_after", abandon_after)

    # -- wiring (called by CrewGuard) ----------------------------------------------------------

    def attach(self, crew: Crew) -> Crew:
        """Wrap ``crew.kickoff`` and ``crew.akickoff`` so each kickoff is the run; returns ``crew``.
        Wrapping twice is harmless."""
        if is_marked(crew, "kickoff"):
            return crew
        kickoff, akickoff = crew.kickoff, crew.akickoff

        @functools.wraps(kickoff)
        def saga_kickoff(*args: Any, **kwargs: Any) -> Any:
            held = self._begin(crew)
            token = _kickoff.set(held)
            try:
                result = kickoff(*args, **kwargs)
            except BaseException as exc:
                held.close(exc)
                raise
            finally:
                _kickoff.reset(token)
            held.close(None)
            return result

        @functools.wraps(akickoff)
        async def saga_akickoff(*args: Any, **kwargs: Any) -> Any:
            # Journal I/O and a compensation's undos are sync: off the event loop.
            held = await asyncio.to_thread(self._begin, crew)
            token = _kickoff.set(held)
            try:
                result = await akickoff(*args, **kwargs)
            except BaseException as exc:
                await asyncio.to_thread(held.close, exc)
                raise
            finally:
                _kickoff.reset(token)
            await asyncio.to_thread(held.close, None)
            return result

        for name, fn in (("kickoff", saga_kickoff), ("akickoff", saga_akickoff)):
            shadow(crew, name, mark(fn))
        return crew

    def _begin(self, crew: Crew) -> _Kickoff:
        held = _Kickoff(self, crew)
        restored = getattr(crew, "checkpoint_kickoff_event_id", None)
        if isinstance(restored, str) and self.runner.journal.load(restored) is not None:
            # A restored kickoff continues its run: held (and taken back from the worker) from
            # the start, so a cancellation or a failure before its next step still reaches it.
            held.open(restored)
        return held

    # -- the run -------------------------------------------------------------------------------

    def current(self) -> AgentRun:
        """The run of the current kickoff (started by its first step), or, outside a protected
        crew's kickoff, the run open in this context (``with runner.run(agent, run_id)``).

        Raises:
            LookupError: outside a kickoff and no run is open.
        """
        held = _kickoff.get()
        found = kickoff_id()
        if held is None or found is None:
            return current_run()
        return held.open(found)

    def run_id(self, crew: Crew) -> str | None:
        """The saga id of ``crew``'s latest kickoff in this process that made a step (its kickoff
        event id: ``sagaguard sagas show ID``), or None."""
        found = crew.__dict__.get(_RUN_ID)
        return found if isinstance(found, str) else None

    def reject(self, run_id: str, reason: str = "rejected") -> SagaOutcome:
        """A human rejected the run: undo its steps now, in reverse order, from any process (the
        run's own process may be gone). See :meth:`~sagaguard.saga.agent.AgentRunner.reject`."""
        return self.runner.reject(self.agent, run_id, reason)

    def approval(self, decide: Callable[[Any], bool | str]) -> Callable[[Any], tuple[bool, Any]]:
        """A task guardrail that asks a human: ``Task(..., guardrail=crew_saga.approval(ask))``.

        ``decide(output)`` gets the task's ``TaskOutput`` and returns True to approve (the output
        goes on), or False or a reason to reject: the guardrail raises :class:`KickoffRejected`,
        which CrewAI lets through, and the kickoff undoes its run before the exception escapes.
        CrewAI drops callable guardrails from its checkpoints: give it again to a restored task.
        """

        def guardrail(output: Any) -> tuple[bool, Any]:
            verdict = decide(output)
            if verdict is True:
                return True, output
            raise KickoffRejected(verdict if isinstance(verdict, str) and verdict else "rejected")

        # CrewAI checks a guardrail's signature at runtime: one parameter, no string annotations.
        guardrail.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter("output", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        )
        return guardrail
