"""LangGraph tools in an agent saga: each compensatable tool call registers its undo before it runs.

::

    @tool
    @changes_world(undo="cancel_booking")                # a name in the agent saga's UndoRegistry
    def book_hotel(hotel: str) -> dict: ...

    trip_agent = AgentSaga("trip_agent", undos)          # undos: cancel_booking, refund, ...
    tools = SagaTools({"charge": changes_world(undo="refund"), "sign": changes_world(pivot=True)})
    node = ToolNode([book_hotel, charge, sign, search], wrap_tool_call=tools.wrap_tool_call,
                    awrap_tool_call=tools.awrap_tool_call)

    with runner.run(trip_agent, thread_id) as run:       # the graph's durable identity
        graph.invoke(inputs, {"configurable": {"thread_id": thread_id}}, durability="sync")
    async with runner.run(trip_agent, thread_id) as run:  # or async: the steps through acall
        await graph.ainvoke(inputs, {"configurable": {"thread_id": thread_id}}, durability="sync")

The handler makes each declared call ``current_run().call(tool, ..., call_id=tool_call_id)`` (or
``await current_run().acall(...)`` in the async handler): one
journal commit registers the call with its undo, then the call runs under the run's guard (keyed on
the run id and LangGraph's ``tool_call_id``, stable across a crash when the model is journaled, see
:mod:`sagaguard.connectors.frameworks.langgraph`), then its result is recorded. The undo receives the tool
call's arguments and the tool's output (the ``ToolMessage``'s content, read back as JSON when it is JSON).
The tool's body runs in a scope named after the call's key, so guarded effects inside it
(``StripeEffects``, ``EmailEffects``) need no ``key=``.
Other tools run as they are (or through ``inner``). ``ToolNode`` runs a turn's calls in a thread pool; the
run's context (``current_run``) reaches them, and their steps are ordered by their registration.
Pass ``handle_tool_errors=False`` (or a narrower setting) to ``ToolNode`` for a tool failure to end
the run and compensate it; by default ``ToolNode`` turns it into a message the model reads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import ToolMessage
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from sagaguard.connectors.declare import ToolDeclaration, declaration_of, recorded_output, tool_options
from sagaguard.connectors.frameworks.langgraph import ToolGuard
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.keys import scope
from sagaguard.saga.agent import current_run

__all__ = ["SagaTools", "tool_output"]

ToolResult = ToolMessage | Command[Any]
Execute = Callable[[ToolCallRequest], ToolResult]
AsyncExecute = Callable[[ToolCallRequest], Awaitable[ToolResult]]


def tool_output(message: ToolMessage) -> Any:
    """What a tool returned, read back from its ``ToolMessage``: the content as JSON when it is
    JSON, else as it is (:func:`~sagaguard.connectors.declare.recorded_output`)."""
    return recorded_output(message.content)


def _message(result: ToolResult) -> ToolMessage:
    if not isinstance(result, ToolMessage):
        raise ConfigurationError("a tool with an undo must return a result, not a Command")
    return result


@dataclass(frozen=True)
class _Step:
    """A tool call that is a step of the open run, as ``SagaTools`` decided (no I/O)."""

    tool: str
    call_id: str
    arguments: dict[str, Any]
    options: dict[str, Any]
    """The keyword arguments of :meth:`sagaguard.saga.agent.AgentRun.call` / ``acall``."""


class SagaTools:
    """``wrap_tool_call`` and ``awrap_tool_call`` for ``ToolNode`` (and, through
    :class:`sagaguard.connectors.frameworks.langchain_saga.SagaMiddleware`, for ``create_agent``): calls of
    tools declared with an undo or as the pivot become steps of the open agent run.

    A tool says so with its declaration (:func:`~sagaguard.connectors.declare.changes_world`), on the tool or
    by name here: ``@changes_world(undo="cancel_booking")`` (compensatable) or
    ``@changes_world(pivot=True)``. The declaration's :meth:`Guard.run` options apply to the call.

    Args:
        declare: tool name to declaration, for tools not declared where they are defined.
        inner: the handler for every other tool (a
            :class:`~sagaguard.connectors.frameworks.langgraph.ToolGuard`); None runs them as they are.
    """

    def __init__(
        self, declare: Mapping[str, ToolDeclaration] | None = None, *, inner: ToolGuard | None = None
    ) -> None:
        self.declare = dict(declare or {})
        self.inner = inner

    def wrap_tool_call(self, request: ToolCallRequest, execute: Execute) -> ToolResult:
        """The sync handler: ``ToolNode(wrap_tool_call=saga_tools.wrap_tool_call)``.

        Raises:
            LookupError: a declared tool is called with no agent run open.
            ConfigurationError: a declared tool call has no id.
        """
        step = self._step(request)
        if step is None:
            return execute(request) if self.inner is None else self.inner.wrap_tool_call(request, execute)
        run = current_run()

        def body() -> ToolMessage:
            with scope(run.call_key(step.call_id)):  # fresh per attempt, as ToolGuard's
                return _message(execute(request))

        message: ToolMessage = run.call(step.tool, body, step.arguments, **step.options)
        return message

    async def awrap_tool_call(self, request: ToolCallRequest, execute: AsyncExecute) -> ToolResult:
        """The async handler (``ToolNode(awrap_tool_call=...)``, an agent run with ``ainvoke``):
        the same steps, through :meth:`sagaguard.saga.agent.AgentRun.acall` (``async with`` the run).
        It raises what :meth:`wrap_tool_call` raises.
        """
        step = self._step(request)
        if step is None:
            if self.inner is None:
                return await execute(request)
            return await self.inner.awrap_tool_call(request, execute)

        run = current_run()

        async def body() -> ToolMessage:
            with scope(run.call_key(step.call_id)):
                return _message(await execute(request))

        message: ToolMessage = await run.acall(step.tool, body, step.arguments, **step.options)
        return message

    def _step(self, request: ToolCallRequest) -> _Step | None:
        """The step a call is, by its tool's declaration; None for a tool with nothing to undo."""
        call = request.tool_call
        name = call["name"]
        declaration = declaration_of(request.tool, name, self.declare)
        if declaration.undo is None and not declaration.pivot:
            return None
        call_id = call.get("id")
        if not call_id:
            raise ConfigurationError(f"tool call {name!r} has no id: it cannot be keyed")
        options = {
            "undo": declaration.undo, "pivot": declaration.pivot, "call_id": call_id,
            "result_type": ToolMessage, "record": tool_output, "options": tool_options(declaration),
        }  # fmt: skip
        return _Step(name, call_id, dict(call["args"]), options)
