"""Agent sagas inside a durable-execution engine: the engine-neutral part of the DBOS and Temporal
adapters (:mod:`sagaguard.connectors.frameworks.dbos_saga`,
:mod:`sagaguard.connectors.frameworks.temporal_saga`).

In an engine the durable owner of a run is the workflow, not a process: its steps (activities) may
run in different processes, one after the other or at once, and any of them may be re-run after a
crash. So no process holds the run between two tool calls. Each declared tool call *holds* the run
only while it calls: it opens the run exclusively (:meth:`sagaguard.saga.agent.AgentRunner.run`, refused
while another place holds it: the call waits, then lets the engine retry), makes the call
(:meth:`sagaguard.saga.agent.AgentRun.call`: the row and its undo committed before the body runs), and parks
the run again (WAITING, no process held). One place at a time appends the run's rows, under the
run's fencing token, so rows never collide. The end of the workflow ends the run the same way
(:meth:`EngineSaga.end`), and a compensation a killed process left is finished by whoever comes next:
the engine's re-run of the end step, or the ``sagaguard sagas worker``.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import time
import typing
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, ParamSpec, TypeVar, overload

import tenacity

from sagaguard.connectors.declare import ToolDeclaration, declaration_of
from sagaguard.connectors.in_doubt import Pending
from sagaguard.connectors.toolcall import ToolCallSite, run_tool_call
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.saga import cancel
from sagaguard.saga.agent import (
    AgentRun,
    AgentRunCancelled,
    AgentRunEnded,
    AgentRunner,
    AgentSaga,
    AgentSagaError,
)
from sagaguard.saga.errors import SagaInProgress
from sagaguard.saga.records import FINAL_STATES, SagaOutcome, SagaState

__all__ = ["AgentRunStopped", "EngineSaga", "EngineTools", "Ending", "call_arguments", "return_type"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def call_arguments(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The arguments of a call of ``fn``, by parameter name (defaults filled in): what a tool
    step records for its undo."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def return_type(fn: Callable[..., Any]) -> Any:
    """``fn``'s return annotation (the type its result is stored and replayed as), or Any."""
    try:
        return typing.get_type_hints(fn).get("return", Any)
    except (NameError, TypeError):
        return Any


class Ending(enum.StrEnum):
    """How the workflow of an agent run ended."""

    COMPLETE = "complete"
    """It returned: the run's saga is COMPLETED, its effects kept."""
    FAIL = "fail"
    """An exception ended it: the run compensates (or, with ``on_failure="leave"``, waits for an
    operator); a cancellation requested meanwhile compensates with its cause."""
    CANCEL = "cancel"
    """The engine cancelled it: the run is cancelled and compensates (after its pivot: as a failure,
    undoing only what came after the pivot)."""


class AgentRunStopped(AgentSagaError):
    """A tool step (activity) of a run that was cancelled or has ended: the tool did not run.

    Raised to the engine in place of :class:`~sagaguard.saga.agent.AgentRunCancelled` (a BaseException) so
    the engine records it as the step's failure; the workflow then ends and its run is undone.
    Retrying it changes nothing (the adapters mark it non-retryable where the engine can).

    Attributes:
        saga_id: the run.
        reason: ``"cancelled"``, or the state the run's saga is in.
    """

    def __init__(self, saga_id: str, reason: str) -> None:
        super().__init__(f"agent run {saga_id!r} is {reason}: the tool did not run")
        self.saga_id = saga_id
        self.reason = reason


class _WorkflowFailed(Exception):
    """Raised inside the run's block to record why the workflow failed (its message is the cause)."""


class EngineSaga:
    """Tool calls and endings of one agent saga type's runs, each holding the run while it writes.

    Args:
        runner: opens the runs (its journal and guard are the worker's too; its ``lease`` is how
            long a holder that died on another host blocks the next step: a few seconds suit
            engines; one provably dead on this host is taken over at once).
        agent: the runs' saga type (register it with the worker as well).
        hold_wait: seconds a step waits for the run held elsewhere before it raises
            :class:`~sagaguard.saga.errors.SagaInProgress` for the engine to retry it (default: three leases,
            time for the lease of a holder dead on another host to run out).
        sleep: the sleep between those tries (inject one in tests).

    Raises:
        ConfigurationError: ``hold_wait`` is not > 0.
    """

    def __init__(
        self,
        runner: AgentRunner,
        agent: AgentSaga,
        *,
        hold_wait: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        wait = 3 * runner.lease if hold_wait is None else hold_wait
        if not wait > 0:
            raise ConfigurationError("hold_wait must be > 0")
        self.runner = runner
        self.agent = agent.freeze()
        self.hold_wait = wait
        self._sleep = sleep

    def _retrying(self) -> tenacity.Retrying:
        journal = self.runner.journal
        start = journal.now()

        def waited_enough(_state: tenacity.RetryCallState) -> bool:
            # On the journal's clock, as the leases it waits out (and as tests inject it).
            return journal.now() - start >= self.hold_wait

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(SagaInProgress),
            wait=tenacity.wait_exponential(multiplier=0.02, max=0.5),
            stop=waited_enough,
            sleep=self._sleep,
            reraise=True,
        )

    def _hold(self, run_id: str, stack: contextlib.ExitStack) -> AgentRun:
        """Open the run exclusively in ``stack``, waiting while another place holds it."""
        for attempt in self._retrying():
            with attempt:
                try:
                    return stack.enter_context(self.runner.run(self.agent, run_id, exclusive=True))
                except AgentRunEnded as exc:
                    raise AgentRunStopped(run_id, exc.state) from exc
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover

    def call(
        self,
        run_id: str,
        tool: str,
        fn: Callable[[], T],
        arguments: Mapping[str, Any],
        *,
        call_id: str,
        declaration: ToolDeclaration,
        result_type: Any = Any,
    ) -> T:
        """Make one tool call of the run ``run_id``, holding the run only while it calls.

        A tool declared with neither ``undo=`` nor ``pivot=True`` runs as it is (``fn()``).
        Otherwise the run is opened exclusively, the call made through
        :meth:`~sagaguard.saga.agent.AgentRun.call` under ``{run_id}/{call_id}`` (a re-run of the step finds
        its row and the guard replays its result), and the run parked again, whatever the call did.
        A step re-run after its run completed replays its recorded result (nothing is written).

        Raises:
            AgentRunStopped: the run was cancelled (it is undone here, before this raises) or has
                ended; the tool did not run.
            SagaInProgress: the run stayed held elsewhere for ``hold_wait`` (retry the step).
            and whatever the call raised (the run stays open for the engine's retry).
        """
        if declaration.undo is None and not declaration.pivot:
            return fn()
        failure: Exception | None = None
        try:
            with contextlib.ExitStack() as stack:
                run = self._hold(run_id, stack)
                site: ToolCallSite[T] = ToolCallSite(
                    tool=tool, call_id=call_id, arguments=arguments, declaration=declaration, effect=tool,
                    scope_id="", pending=_no_pending, result_type=result_type, record=_as_it_is,
                )  # fmt: skip
                try:
                    # The one tool-call pipeline, with the run this step holds.
                    value = run_tool_call(site, fn, guard=None, saga=functools.partial(_held, run))
                except AgentRunCancelled:
                    raise  # cancelled from outside: leaving the block undoes the run now
                except AgentRunEnded as exc:
                    # A new call of a completed run (opened to replay its recorded calls): the
                    # tool did not run, and retrying changes nothing.
                    raise AgentRunStopped(run_id, exc.state) from exc
                except Exception as exc:
                    failure = exc  # the engine retries the step: the run stays open for it
                run.pause()  # no process holds the run between two steps: the workflow does
        except AgentRunCancelled:
            raise AgentRunStopped(run_id, "cancelled") from None
        if failure is not None:
            raise failure
        return value

    def end(self, run_id: str, how: Ending | str, cause: str | None = None) -> SagaOutcome:
        """End the run ``run_id`` as its workflow ended; safe to run again (an engine's re-run).

        - COMPLETE: the saga is COMPLETED. FAIL: it compensates now, in this process (or parks
          NEEDS_ATTENTION with ``on_failure="leave"``). CANCEL: it is cancelled, then compensates.
        - A run that is already compensating (a killed process left it, or the worker took it) is
          finished here at once when its holder is provably dead on this host, else once its
          holder's lease ran out; a run that ended reports where it ended.

        Args:
            run_id: the run.
            how: how the workflow ended.
            cause: what the saga records as the failure's or the cancellation's cause.

        Returns:
            Where the run's saga ended (NEEDS_ATTENTION included).

        Raises:
            SagaInProgress: the run stayed held elsewhere for ``hold_wait`` (retry).
        """
        ending = Ending(how)
        for attempt in self._retrying():
            with attempt:
                return self._end_once(run_id, ending, cause)
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover

    def _end_once(self, run_id: str, how: Ending, cause: str | None) -> SagaOutcome:
        journal = self.runner.journal
        snapshot = journal.load(run_id)
        if snapshot is not None:
            state = snapshot.saga.state
            if state in FINAL_STATES or state is SagaState.NEEDS_ATTENTION:
                return SagaOutcome(run_id, state)
            if state is SagaState.COMPENSATING:
                return self._finish(run_id)
            if how is Ending.CANCEL:
                cancel(journal, run_id, reason=cause or "cancelled")  # refused past the pivot
        run = self.runner.run(self.agent, run_id, exclusive=True)
        try:
            with run:
                if how is not Ending.COMPLETE:
                    found = journal.load(run_id)
                    if found is not None and found.saga.cancel_requested:
                        raise AgentRunCancelled(run_id)
                    raise _WorkflowFailed(cause or f"the workflow of {run_id!r} failed")
        except (AgentRunCancelled, _WorkflowFailed):
            pass  # recorded and undone by the block's exit
        except AgentRunEnded as exc:
            raise SagaInProgress(run_id) from exc  # it changed under us: look again
        if run.outcome is None:
            raise SagaInProgress(run_id)  # ended elsewhere meanwhile: look again
        return run.outcome

    def _finish(self, run_id: str) -> SagaOutcome:
        """Take over a compensation whose holder is gone and drive it to its end."""
        journal = self.runner.journal
        claimed = journal.claim(run_id, lease=self.runner.lease)
        if claimed is None:
            raise SagaInProgress(run_id)  # its holder's lease is live, or it just ended: look again
        compensator = self.runner.compensator()
        try:
            outcome = compensator.resume(self.agent.for_run(claimed, self.runner.guard), claimed)
        finally:
            compensator.close()
        if outcome.state in FINAL_STATES or outcome.state is SagaState.NEEDS_ATTENTION:
            return outcome
        raise SagaInProgress(run_id)  # parked again (it was not compensating after all): look again


def _held(run: AgentRun) -> AgentRun:
    return run


def _no_pending(pending: Pending) -> NoReturn:
    # The engines stop on doubt (the default on_doubt): a pending answer is never made.
    raise AssertionError(f"unreachable: {pending.effect} is pending")  # pragma: no cover


def _as_it_is(value: Any) -> Any:
    return value


class EngineTools:
    """What the DBOS and Temporal adapters share: the engine's run, the tools' declarations.

    Args:
        runner: opens the runs (use a short ``lease``, e.g. 5 s: a step re-run after a crash waits
            out the dead holder's lease).
        agent: the runs' saga type; register it with the ``sagaguard sagas worker`` too.
        declare: tool name to declaration, for tools not declared where they are defined.
        hold_wait: as for :class:`EngineSaga`.
    """

    def __init__(
        self,
        runner: AgentRunner,
        agent: AgentSaga,
        *,
        declare: Mapping[str, ToolDeclaration] | None = None,
        hold_wait: float | None = None,
    ) -> None:
        self.engine = EngineSaga(runner, agent, hold_wait=hold_wait)
        self.declare = dict(declare or {})
        self._register_end()

    def _register_end(self) -> None:
        """Register the engine's step (activity) that ends a run; the adapter's own."""

    def declared(self, fn: Callable[..., Any], name: str | None) -> tuple[str, ToolDeclaration, Any]:
        """A tool function's name (``name`` or its own), declaration and stored result type."""
        tool = name or fn.__name__
        return tool, declaration_of(fn, tool, self.declare), return_type(fn)

    @overload
    def tool(self, fn: Callable[P, R], /) -> Callable[P, R]: ...

    @overload
    def tool(
        self, fn: None = None, /, *, name: str | None = None
    ) -> Callable[[Callable[P, R]], Callable[P, R]]: ...

    def tool(self, fn: Any = None, /, *, name: str | None = None) -> Any:
        """Decorator (bare or with ``name=``): a step (activity) function as a tool of the run,
        applied under the engine's own decorator (``@DBOS.step()``, ``@activity.defn``).

        The tool's declaration (``@changes_world(undo=...)`` on the function, or by name in
        ``declare``) says what kind of call it is; a tool with neither ``undo=`` nor ``pivot=True``
        runs as it is. The undo receives the call's arguments by parameter name and the step's
        return value.

        Raises:
            ConfigurationError: a function the adapter cannot run as a tool (DBOS: an async one).
        """
        if fn is None:
            return lambda f: self.tool(f, name=name)
        return self._tool(fn, name)

    def _tool(self, fn: Callable[..., Any], name: str | None) -> Callable[..., Any]:
        """``fn`` wrapped as a tool (named ``name`` or after itself, :meth:`declared`): the adapter's own."""
        raise NotImplementedError
