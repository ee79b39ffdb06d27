"""LangGraph tools in an agent saga: each compensatable tool call registers its undo before it runs.

::

    undos = UndoRegistry()                               # cancel_booking, refund registered on it
    trip_agent = AgentSaga("trip_agent", undos)
    tools = SagaTools({"book_hotel": "cancel_booking", "charge": "refund"}, pivots={"sign_contract"})
    node = ToolNode([book_hotel, charge, sign_contract, search], wrap_tool_call=tools.wrap_tool_call)

    with runner.run(trip_agent, thread_id) as run:       # the graph's durable identity
        graph.invoke(inputs, {"configurable": {"thread_id": thread_id}}, durability="sync")

The handler makes each listed call ``current_run().call(tool, ..., call_id=tool_call_id)``: one
journal commit registers the call with its undo, then the call runs under the run's guard (keyed on
the run id and LangGraph's ``tool_call_id``, stable across a crash when the model is journaled, see
:mod:`connectors.langgraph`), then its result is recorded. The undo receives the tool call's
arguments and the tool's output (the ``ToolMessage``'s content, read back as JSON when it is JSON).
Tools that are not listed run as they are. ``ToolNode`` runs a turn's calls in a thread pool; the
run's context (``current_run``) reaches them, and their steps are ordered by their registration.
Pass ``handle_tool_errors=False`` (or a narrower setting) to ``ToolNode`` for a tool failure to end
the run and compensate it; by default ``ToolNode`` turns it into a message the model reads.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from langchain_core.messages import ToolMessage
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from idempotency.errors import ConfigurationError
from saga.agent import current_run

__all__ = ["SagaTools", "tool_output"]

ToolResult = ToolMessage | Command[Any]
Execute = Callable[[ToolCallRequest], ToolResult]
AsyncExecute = Callable[[ToolCallRequest], Awaitable[ToolResult]]


def tool_output(message: ToolMessage) -> Any:
    """What a tool returned, read back from its ``ToolMessage``: the content as JSON when it is
    JSON, else as it is."""
    content = message.content
    if isinstance(content, str):
        try:
            return json.loads(content)
        except ValueError:
            return content
    return content


def _message(result: ToolResult) -> ToolMessage:
    if not isinstance(result, ToolMessage):
        raise ConfigurationError("a tool with an undo must return a result, not a Command")
    return result


class SagaTools:
    """``wrap_tool_call`` for ``ToolNode``: the listed tools' calls become steps of the open run.

    Args:
        undos: tool name -> the name of its undo in the agent saga's ``UndoRegistry``.
        pivots: names of tools after which the run only goes forward.

    Raises:
        ConfigurationError: a tool is both compensatable and a pivot.
    """

    def __init__(self, undos: Mapping[str, str], *, pivots: Collection[str] = ()) -> None:
        both = set(undos) & set(pivots)
        if both:
            raise ConfigurationError(f"tools {sorted(both)} cannot both have an undo and be a pivot")
        self.undos = dict(undos)
        self.pivots = frozenset(pivots)

    def wrap_tool_call(self, request: ToolCallRequest, execute: Execute) -> ToolResult:
        """The sync handler: ``ToolNode(wrap_tool_call=saga_tools.wrap_tool_call)``.

        Raises:
            LookupError: a listed tool is called with no agent run open.
            ConfigurationError: a listed tool call has no id.
        """
        call = request.tool_call
        name = call["name"]
        if name not in self.undos and name not in self.pivots:
            return execute(request)
        call_id = call.get("id")
        if not call_id:
            raise ConfigurationError(f"tool call {name!r} has no id: it cannot be keyed")
        return current_run().call(
            name,
            lambda: _message(execute(request)),
            dict(call["args"]),
            undo=self.undos.get(name),
            pivot=name in self.pivots,
            call_id=call_id,
            result_type=ToolMessage,
            record=tool_output,
        )
