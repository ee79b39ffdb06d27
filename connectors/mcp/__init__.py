"""MCP tool calls that happen once, undone in reverse in an agent saga, from your own client or
through a proxy in front of any server.

::

    async with stdio_session(StdioServerParameters(command="payments-server")) as session:
        payments = GuardedSession(session, guard, server="payments")
        result = await payments.call_tool("charge", {"amount": 420}, call_id=tool_call_id)

- :mod:`sagaguard.connectors.mcp.policy`: a tool's mode from its annotations (``readOnlyHint``: sent as it
  is; ``idempotentHint``: re-sent on doubt; else at most once), overridden per tool; what an
  ``isError`` result means.
- :mod:`sagaguard.connectors.mcp.session`: :class:`GuardedSession`, wrapping ``ClientSession.call_tool``.
- :mod:`sagaguard.connectors.mcp.undo`: a tool's undo as another MCP tool, run by the agent saga.
- :mod:`sagaguard.connectors.mcp.tools`: the session's tools as LangChain and OpenAI Agents SDK tools.
- :mod:`sagaguard.connectors.mcp.proxy` and ``sagaguard mcp proxy|tools``: the same rules for clients you do
  not control.

Needs the ``mcp`` extra (``pip install 'sagaguard[mcp]'``).
"""

from sagaguard.connectors.mcp.policy import (
    IDEMPOTENCY_META_KEY,
    ErrorText,
    InvalidArguments,
    InvalidKey,
    LookupTool,
    Mode,
    OnToolError,
    ServerGone,
    ToolFailed,
    ToolFailedAmbiguous,
    ToolPolicy,
    guard_options,
    policy_for,
    policy_from_annotations,
)
from sagaguard.connectors.mcp.session import (
    GuardedSession,
    ToolSession,
    http_session,
    pending_result,
    stdio_session,
)
from sagaguard.connectors.mcp.undo import McpServers, McpUndos, UndoFailed, UndoTool, undo_arguments

__all__ = [
    "IDEMPOTENCY_META_KEY",
    "ErrorText",
    "GuardedSession",
    "InvalidArguments",
    "InvalidKey",
    "LookupTool",
    "McpServers",
    "McpUndos",
    "Mode",
    "OnToolError",
    "ServerGone",
    "ToolFailed",
    "ToolFailedAmbiguous",
    "ToolPolicy",
    "ToolSession",
    "UndoFailed",
    "UndoTool",
    "guard_options",
    "http_session",
    "pending_result",
    "policy_for",
    "policy_from_annotations",
    "stdio_session",
    "undo_arguments",
]
