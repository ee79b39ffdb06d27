"""Temporal workflows as agent sagas: each tool activity registers its undo before it runs, and the
workflow's end completes or undoes the run in an activity of its own.

::

    # activities.py (the worker imports it; the worker's registry holds trip_agent too)
    tools = TemporalSagaTools(AgentRunner(journal, guard, lease=5.0), trip_agent)

    @activity.defn
    @tools.tool                                          # under @activity.defn
    @changes_world(undo="refund")
    def charge(order: str, amount: int) -> dict: ...

    Worker(client, task_queue=..., workflows=[Trip], activities=[charge, ..., *tools.activities()],
           activity_executor=ThreadPoolExecutor())       # sync tools need an executor

    # workflows.py
    with workflow.unsafe.imports_passed_through():
        from sagaguard.connectors.frameworks.temporal_saga import run_agent

    @workflow.defn
    class Trip:
        @workflow.run
        async def run(self, order: str) -> str:
            return await run_agent("trip_agent", lambda: self.plan(order))

**Identity.** The run's saga is keyed on the workflow id (:func:`temporal_run_id`): it survives a
worker crash (the same execution goes on), a workflow retry, a reset and Continue-As-New (each a
new *run id* of the same workflow), so one agent run is one workflow however often Temporal starts
it again. A tool call is keyed on the workflow run id and the activity id
(:func:`temporal_call_id`, Temporal's recommended idempotency key): the same for every attempt of an
activity, so a retried activity finds its row and its effects replay; new for the activities of a
new run (activity ids restart there), so those are new calls of the same agent run.

**Concurrency.** Activities of one workflow may run on several workers at once (parallel
activities, a retry next to a zombie). Each holds the run only while it calls (opened exclusively;
:mod:`sagaguard.connectors.frameworks._engine_saga`), so one at a time appends rows; the others wait (then
fail with :class:`~sagaguard.saga.errors.SagaInProgress` for Temporal to retry). Parallel tool activities are
correct, and their registrations and bodies are serialised by the run.

**Triggers.** :func:`run_agent` ends the run when its body ends: returned, the end activity
completes it; a failure that fails the workflow (a :class:`~temporalio.exceptions.FailureError`:
an activity's failure, an ``ApplicationError``) undoes it (or parks it for an operator with
``on_failure="leave"``); a cancellation of the workflow cancels and undoes it. ``sagaguard sagas
cancel ID`` makes the next tool activity fail with :class:`AgentRunStopped` (non-retryable) and the
workflow then undoes the run. The end activity heartbeats, so a worker killed in the middle of a
compensation has it retried on another worker after ``heartbeat_timeout``; the retry takes the
compensation over once the dead holder's run lease ran out (or the ``sagaguard sagas worker``
finishes it). Continue-As-New passes through without ending the run.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError, FailureError, is_cancelled_exception

from sagaguard.connectors.frameworks._engine_saga import AgentRunStopped, Ending, EngineTools, call_arguments
from sagaguard.connectors.frameworks.temporal import activity_scope
from sagaguard.idempotency.errors import ConfigurationError

__all__ = [
    "AgentRunStopped",
    "TemporalSagaTools",
    "end_activity_name",
    "run_agent",
    "temporal_call_id",
    "temporal_run_id",
]

T = TypeVar("T")

HEARTBEAT = timedelta(seconds=5)
"""The end activity's heartbeat timeout in :func:`run_agent`: how soon a killed worker's
compensation is retried elsewhere."""


def end_activity_name(agent: str) -> str:
    """The name of the activity that ends runs of the agent saga ``agent``."""
    return f"sagaguard.agent.end.{agent}"


def temporal_run_id(info: activity.Info) -> str:
    """The agent run an activity belongs to: its workflow id (see the module docstring)."""
    return info.workflow_id or ""


def temporal_call_id(info: activity.Info) -> str:
    """A tool call's id in its run: the workflow run id and the activity id."""
    return f"{info.workflow_run_id}/{info.activity_id}"


def _info() -> activity.Info:
    try:
        info = activity.info()
    except RuntimeError as exc:
        raise ConfigurationError("an agent saga tool runs outside a Temporal activity") from exc
    if not info.workflow_id or not info.workflow_run_id:
        raise ConfigurationError(f"activity {info.activity_id!r} has no workflow: it belongs to no agent run")
    return info


def _stopped(exc: AgentRunStopped) -> ApplicationError:
    return ApplicationError(str(exc), exc.reason, type="AgentRunStopped", non_retryable=True)


class TemporalSagaTools(EngineTools):
    """Tool activities and the end activity of one agent saga type's Temporal runs.

    Arguments as for :class:`~sagaguard.connectors.frameworks._engine_saga.EngineTools` (``runner``: use a
    short ``lease``, e.g. 5 s, as an activity retried after a worker died waits out the dead holder's
    lease; ``agent``, ``declare=``, ``hold_wait=``). Its :meth:`tool` takes activity functions, sync
    or async (apply it under ``@activity.defn``), and runs each body inside
    :func:`~sagaguard.connectors.frameworks.temporal.activity_scope`, so guarded effects inside a
    tool are keyed on its activity.
    """

    def _register_end(self) -> None:
        engine, agent = self.engine, self.engine.agent

        async def end(how: str, cause: str | None) -> str:
            info = _info()
            ending = asyncio.ensure_future(asyncio.to_thread(engine.end, temporal_run_id(info), how, cause))
            while True:  # heartbeat while it runs: a killed worker's end is retried elsewhere
                done, _ = await asyncio.wait({ending}, timeout=1.0)
                if done:
                    return ending.result().state.value
                activity.heartbeat()

        self.end_activity: Callable[[str, str | None], Awaitable[str]] = activity.defn(
            name=end_activity_name(agent.name)
        )(end)
        """The activity :func:`run_agent` calls to end a run: register it with the worker."""

    def activities(self) -> list[Callable[..., Any]]:
        """The activities to register with the worker besides the tools (the end activity)."""
        return [self.end_activity]

    def _tool(self, fn: Callable[..., Any], name: str | None) -> Callable[..., Any]:
        """An activity function (sync or async) as a tool of the workflow's run (see the class
        docstring)."""
        tool_name, declaration, result_type = self.declared(fn, name)

        def call(info: activity.Info, body: Callable[[], Any], arguments: dict[str, Any]) -> Any:
            with activity_scope(info):
                try:
                    return self.engine.call(
                        temporal_run_id(info), tool_name, body, arguments, call_id=temporal_call_id(info),
                        declaration=declaration, result_type=result_type,
                    )  # fmt: skip
                except AgentRunStopped as exc:
                    raise _stopped(exc) from exc

        if inspect.iscoroutinefunction(fn):
            afn: Callable[..., Coroutine[Any, Any, Any]] = fn

            @functools.wraps(fn)
            async def async_tool(*args: Any, **kwargs: Any) -> Any:
                info, loop = _info(), asyncio.get_running_loop()
                arguments = call_arguments(fn, args, kwargs)

                def body() -> Any:
                    # The journal is sync: the call's bookkeeping runs in a thread, the tool's
                    # coroutine back on the worker's loop.
                    return asyncio.run_coroutine_threadsafe(afn(*args, **kwargs), loop).result()

                return await asyncio.to_thread(call, info, body, arguments)

            return async_tool

        @functools.wraps(fn)
        def sync_tool(*args: Any, **kwargs: Any) -> Any:
            return call(_info(), lambda: fn(*args, **kwargs), call_arguments(fn, args, kwargs))

        return sync_tool


def _describe(exc: BaseException) -> str:
    parts, seen = [], 0
    current: BaseException | None = exc
    while current is not None and seen < 5:  # an ActivityError's cause says what failed
        parts.append(f"{type(current).__name__}: {current}")
        current, seen = current.__cause__, seen + 1
    return " <- ".join(parts)


async def run_agent(
    agent: str,
    body: Callable[[], Awaitable[T]],
    *,
    start_to_close_timeout: timedelta = timedelta(minutes=5),
    heartbeat_timeout: timedelta = HEARTBEAT,
    retry_policy: RetryPolicy | None = None,
) -> T:
    """Workflow code: run ``body`` (the agent) as the run of the agent saga ``agent``, and end the
    run as the body ends (no I/O here: the end is an activity, ``end_activity_name(agent)``).

    - ``body`` returns: the run is COMPLETED; its value is returned.
    - it raises a :class:`~temporalio.exceptions.FailureError` (the workflow fails): the run is
      undone (``on_failure="leave"``: parked for an operator), then the error propagates.
    - the workflow is cancelled: the run is cancelled and undone, then the cancellation propagates.
    - anything else (Continue-As-New, a bug that fails the workflow task): passes through, the run
      goes on.

    Raises:
        ApplicationError: (type ``AgentRunStopped``, non-retryable) the body returned but its run
            had been undone meanwhile (cancelled with ``sagaguard sagas cancel``).
    """

    async def end(how: Ending, cause: str | None) -> str:
        state: str = await workflow.execute_activity(
            end_activity_name(agent), args=[how.value, cause], result_type=str,
            start_to_close_timeout=start_to_close_timeout, heartbeat_timeout=heartbeat_timeout,
            retry_policy=retry_policy,
        )  # fmt: skip
        return state

    try:
        value = await body()
    except BaseException as exc:
        if is_cancelled_exception(exc):
            await end(Ending.CANCEL, "the Temporal workflow was cancelled")
        elif isinstance(exc, FailureError):
            await end(Ending.FAIL, _describe(exc))
        raise
    state = await end(Ending.COMPLETE, None)
    if state != "completed":
        run = workflow.info().workflow_id
        raise ApplicationError(
            f"agent run {run!r} is {state}", state, type="AgentRunStopped", non_retryable=True
        )
    return value
