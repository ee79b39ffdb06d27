"""Deprecated: LangGraph tools in an agent saga are :class:`ToolGuard` in saga mode.

::

    tools = ToolGuard(guard, saga=True, declare={"charge": changes_world(undo="refund")})
    node = ToolNode([book_hotel, charge, search], wrap_tool_call=tools.wrap_tool_call,
                    awrap_tool_call=tools.awrap_tool_call)

:class:`SagaTools` and :func:`tool_output` keep working; ``SagaTools`` warns (``DeprecationWarning``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from langgraph.prebuilt.tool_node import ToolCallRequest

from sagaguard.connectors.declare import ToolDeclaration, declaration_of, is_step
from sagaguard.connectors.frameworks.langgraph import (
    AsyncExecute,
    Execute,
    ToolGuard,
    ToolResult,
    tool_output,
)

__all__ = ["SagaTools", "tool_output"]


class SagaTools:
    """Deprecated: use ``ToolGuard(guard, saga=True, ...)``.

    The calls of tools declared with an undo or as the pivot are steps of the open agent run (as
    in :class:`~sagaguard.connectors.frameworks.langgraph.ToolGuard`'s saga mode); any other call goes
    to ``inner`` (a ``ToolGuard``), or runs as it is when there is none.

    Args:
        declare: tool name to declaration, for tools not declared where they are defined.
        inner: the handler for every other tool; None runs them as they are.
    """

    def __init__(
        self, declare: Mapping[str, ToolDeclaration] | None = None, *, inner: ToolGuard | None = None
    ) -> None:
        warnings.warn(
            "SagaTools is deprecated: use ToolGuard(guard, saga=True, declare=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        self.declare = dict(declare or {})
        self.inner = inner
        self._steps = (
            ToolGuard(None, saga=True, declare=self.declare)
            if inner is None
            else ToolGuard(inner.guard, saga=True, declare=self.declare, on_doubt=inner.on_doubt)
        )

    def _is_step(self, request: ToolCallRequest) -> bool:
        name = request.tool_call["name"]
        return is_step(declaration_of(request.tool, name, self.declare))

    def wrap_tool_call(self, request: ToolCallRequest, execute: Execute) -> ToolResult:
        """The sync handler (see :meth:`ToolGuard.wrap_tool_call`)."""
        if self._is_step(request):
            return self._steps.wrap_tool_call(request, execute)
        return execute(request) if self.inner is None else self.inner.wrap_tool_call(request, execute)

    async def awrap_tool_call(self, request: ToolCallRequest, execute: AsyncExecute) -> ToolResult:
        """The async handler (see :meth:`ToolGuard.awrap_tool_call`)."""
        if self._is_step(request):
            return await self._steps.awrap_tool_call(request, execute)
        if self.inner is None:
            return await execute(request)
        return await self.inner.awrap_tool_call(request, execute)
