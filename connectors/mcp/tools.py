"""A guarded session's tools as framework tools, so an agent's MCP calls go through the guard.

::

    tools = await langchain_tools(payments)           # LangChain StructuredTools (LangGraph ToolNode)
    node = ToolNode(tools, wrap_tool_call=tool_guard.wrap_tool_call,
                    awrap_tool_call=tool_guard.awrap_tool_call)

    agent = Agent(name="shop", tools=await agents_tools(payments))   # OpenAI Agents SDK
    result = await Runner.run(AgentRun(guard, run_key).wrap(agent), "...")

Each tool calls :meth:`GuardedSession.call_tool`: the framework adapter (``ToolGuard``, ``AgentRun``,
or an agent saga's run) sets the scope and the model's tool call id the call is keyed on. The tool
returns the result's text (its ``structuredContent`` as JSON when it has one); an ``isError`` result
is returned as ``"Error: ..."`` for the model to read. The framework libraries are imported only by
the function that needs them.
"""

from __future__ import annotations

import json
from typing import Any

from mcp import types

from sagaguard.connectors.mcp.session import GuardedSession

__all__ = ["agents_tools", "langchain_tools", "result_text"]


def result_text(result: types.CallToolResult) -> str:
    """What the model reads of a tool result: ``structuredContent`` as JSON, else the text blocks;
    prefixed ``Error:`` when the result is an error."""
    if result.structured_content is not None:
        text = json.dumps(result.structured_content, sort_keys=True)
    else:
        text = "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))
    return f"Error: {text}" if result.is_error else text


async def langchain_tools(session: GuardedSession) -> list[Any]:
    """The server's tools as LangChain ``StructuredTool``\\ s (async; run them with ``ainvoke``).

    The call id comes from the adapter around the tool (``ToolGuard`` sets it from the
    ``ToolCall``'s id).
    """
    from langchain_core.tools import StructuredTool

    listed = await session.list_tools()
    return [_langchain_tool(StructuredTool, session, tool) for tool in listed.tools]


def _langchain_tool(factory: Any, session: GuardedSession, tool: types.Tool) -> Any:
    name = tool.name

    async def call(**arguments: Any) -> str:
        return result_text(await session.call_tool(name, arguments))

    return factory(
        name=name, description=tool.description or name, args_schema=tool.input_schema, coroutine=call
    )


async def agents_tools(session: GuardedSession) -> list[Any]:
    """The server's tools as OpenAI Agents SDK ``FunctionTool``\\ s, keyed on each call's
    ``tool_call_id`` (wrap the agent with ``sagaguard.connectors.frameworks.openai_agents.AgentRun`` for the
    run key)."""
    from agents import FunctionTool

    listed = await session.list_tools()
    return [_agents_tool(FunctionTool, session, tool) for tool in listed.tools]


def _agents_tool(factory: Any, session: GuardedSession, tool: types.Tool) -> Any:
    name = tool.name

    async def invoke(ctx: Any, arguments: str) -> str:
        parsed = json.loads(arguments) if arguments else {}
        return result_text(await session.call_tool(name, parsed, call_id=ctx.tool_call_id))

    return factory(
        name=name, description=tool.description or name, params_json_schema=tool.input_schema,
        on_invoke_tool=invoke, strict_json_schema=False,
    )  # fmt: skip
