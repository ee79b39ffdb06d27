"""DBOS workflows as agent sagas: each tool step registers its undo before it runs, and the
workflow's end completes or undoes the run.

::

    trip_agent = AgentSaga("trip_agent", undos)              # undos: cancel_booking, refund, ...
    tools = DbosSagaTools(AgentRunner(journal, guard, lease=5.0), trip_agent)

    @DBOS.step()
    @tools.tool                                              # under @DBOS.step(): inside the step
    @changes_world(undo="refund")
    def charge(order: str, amount: int) -> dict: ...

    @DBOS.workflow()
    @tools.workflow                                          # under @DBOS.workflow()
    def trip(order: str) -> str:
        book_hotel(order)
        charge(order, 420)
        return book_flight(order)                            # raises: the run is undone

The run's saga is keyed on the DBOS workflow id (``SetWorkflowID`` makes it yours); a tool call
on the step id, inside :func:`~sagaguard.connectors.frameworks.dbos.dbos_scope`, so a step DBOS re-runs after
a crash finds its row and replays its effects. Each tool step holds the run only while it calls
(:mod:`sagaguard.connectors.frameworks._engine_saga`); between steps the run is parked with no process held.

- The workflow returns: a last step completes the run (COMPLETED, effects kept).
- An exception escapes it: a last step undoes the run's tool calls in reverse, in this process
  (``on_failure="leave"``: parks it for an operator). Killed in the middle, DBOS recovery re-runs
  the workflow, whose end step finishes the compensation (or the ``sagaguard sagas worker`` does).
- ``DBOS.cancel_workflow(id)``: the workflow's next step raises DBOS's cancellation; the run is
  cancelled and undone right there (a cancelled workflow runs no more steps, so not as a step).
- ``sagaguard sagas cancel ID``: the next tool step raises :class:`AgentRunStopped` (the tool did
  not run); the workflow fails and its end step undoes the run with the cancellation's cause.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from dbos import DBOS
from dbos import error as dbos_errors

from sagaguard.connectors.frameworks._engine_saga import AgentRunStopped, Ending, EngineTools, call_arguments
from sagaguard.connectors.frameworks.dbos import dbos_scope
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.saga.records import SagaState

__all__ = ["AgentRunStopped", "DbosSagaTools", "dbos_run_id"]

P = ParamSpec("P")
R = TypeVar("R")


def dbos_run_id() -> str:
    """The agent run of the running DBOS workflow: its workflow id.

    Raises:
        ConfigurationError: not inside a DBOS workflow.
    """
    workflow_id = DBOS.workflow_id
    if workflow_id is None:
        raise ConfigurationError("an agent saga tool or workflow is used outside a DBOS workflow")
    return workflow_id


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _cancelled(workflow_id: str) -> bool:
    """Whether DBOS records the workflow as cancelled (read outside the workflow's context, which
    would record the read as a step of a workflow this execution no longer owns)."""
    with ThreadPoolExecutor(1) as reader:  # a fresh thread has no DBOS context
        status = reader.submit(DBOS.get_workflow_status, workflow_id).result()
    return status is not None and status.status == "CANCELLED"


class DbosSagaTools(EngineTools):
    """Tool steps and the workflow wrapper of one agent saga type's DBOS runs.

    Create it at import, before ``DBOS.launch()``: it registers the run's end step with DBOS. Its
    :meth:`tool` takes sync step functions (apply it under ``@DBOS.step()``; an async one raises
    ``ConfigurationError``), each call keyed on its step id inside
    :func:`~sagaguard.connectors.frameworks.dbos.dbos_scope`. Arguments as for
    :class:`~sagaguard.connectors.frameworks._engine_saga.EngineTools` (``runner``, ``agent``,
    ``declare=``, ``hold_wait=``).
    """

    def _register_end(self) -> None:
        agent = self.engine.agent

        def end_run(run_id: str, how: str, cause: str | None) -> str:
            return self.engine.end(run_id, how, cause).state.value

        end_run.__qualname__ = end_run.__name__ = f"sagaguard_end_{agent.name}"
        self._end_step: Callable[[str, str, str | None], str] = DBOS.step(
            name=f"sagaguard.agent.end.{agent.name}"
        )(end_run)

    def _tool(self, fn: Callable[..., Any], name: str | None) -> Callable[..., Any]:
        """A sync DBOS step function as a tool (see the class docstring).

        Raises:
            ConfigurationError: an async function (not supported yet).
        """
        if inspect.iscoroutinefunction(fn):
            raise ConfigurationError(f"{fn.__name__}: an async DBOS step cannot be an agent saga tool yet")
        tool_name, declaration, result_type = self.declared(fn, name)

        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            run_id, step_id = dbos_run_id(), DBOS.step_id
            if step_id is None:
                raise ConfigurationError(
                    f"tool {tool_name!r} runs outside a DBOS step: apply @DBOS.step() over it"
                )
            with dbos_scope():
                return self.engine.call(
                    run_id, tool_name, lambda: fn(*args, **kwargs), call_arguments(fn, args, kwargs),
                    call_id=f"dbos.step.{step_id}", declaration=declaration, result_type=result_type,
                )  # fmt: skip

        return step

    def workflow(self, fn: Callable[P, R], /) -> Callable[P, R]:
        """Decorator: end the run when the (sync) workflow ends. Apply it under ``@DBOS.workflow()``.

        Raises (from the wrapped workflow):
            AgentRunStopped: the workflow returned, but its run had been undone meanwhile (it was
                cancelled with nothing left to call).
            and whatever the workflow raised, once its run is undone.
        """
        if inspect.iscoroutinefunction(fn):
            raise ConfigurationError(f"{fn.__name__}: an async DBOS workflow cannot run an agent saga yet")

        @functools.wraps(fn)
        def workflow(*args: P.args, **kwargs: P.kwargs) -> R:
            run_id = dbos_run_id()
            try:
                value = fn(*args, **kwargs)
            except (dbos_errors.DBOSWorkflowCancelledError, dbos_errors.DBOSWorkflowConflictIDError):
                # Cancelled (DBOS hands a cancelled workflow off: this execution lost it, or its
                # next step is refused), the workflow runs no more steps: undo its run here.
                # Killed in the middle, the run is left compensating; the sagaguard worker
                # finishes it. Lost to another execution (resumed, recovered), leave it to that one.
                if _cancelled(run_id):
                    self.engine.end(run_id, Ending.CANCEL, "the DBOS workflow was cancelled")
                raise
            except Exception as exc:
                self._end_step(run_id, Ending.FAIL.value, _describe(exc))
                raise
            state = self._end_step(run_id, Ending.COMPLETE.value, None)
            if state != SagaState.COMPLETED.value:
                raise AgentRunStopped(run_id, state)
            return value

        return workflow
