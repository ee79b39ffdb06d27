"""The MCP harnesses of the tool-call conformance suite (``tests/test_toolcall_conformance.py``).

``GuardedSession`` is async only (the SDK's client is), so MCP has two harnesses, both async:

- ``mcp-session``: guarded mode: ``book`` (declared ``changes_world()``) called in the run's scope
  (``with scope(run_id)``) with the model's call id, a guarded effect;
- ``mcp-session-saga``: saga mode: ``book`` declared with an undo, called inside the agent run
  opened around it (``async with runner.run(...)``), a step of the run.

The tool is served by a real MCP server (the SDK's ``MCPServer``) in this process, reached through
the SDK's in-memory transport (``mcp.Client(server)``). That transport runs each request's handler
in the context the client sent the request from, so the test's body, which the server's tool runs,
sees what the call set on the client's side (its call id, its scope, the open run), as a server in
another process would see the call's identity in the request's ``_meta``. The re-run after a crash
is a new client (a restarted process) under the same run id and call id; in saga mode the first
run is paused where the process stopped.

What the body raises crosses the wire as MCP carries it: a ``ConnectionError`` (its provider hung
up mid-call) is the server's JSON-RPC internal error, which the MCP client counts as ambiguous (in
doubt); any other exception is an ``isError`` result: a tool failure, *not applied*, raised as
:class:`~sagaguard.connectors.mcp.ToolFailed` where an exception reaches the caller (the
exception's type does not cross the wire).

Expectations that cannot apply (the suite's table says why): ``scope_per_attempt`` (a read-only
MCP tool is ``pass_through``: sent as it is, never a guarded call, so it has no attempt scope and
no call id of ours; the scope of a step's attempt is checked by ``undo_key_is_scope``).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _mcpkit import in_loop
from mcp import Client, types
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.connectors.in_doubt import OnDoubt
from sagaguard.connectors.mcp import GuardedSession, ToolFailed
from sagaguard.idempotency.keys import scope
from sagaguard.saga.agent import AgentSaga

__all__ = ["McpHarness", "mcp_harnesses"]


def _server(body: Callable[[str], str]) -> MCPServer:
    server = MCPServer("conformance")

    @server.tool()
    def book(item: str) -> str:
        """Book an item."""
        try:
            return body(item)
        except ConnectionError as exc:  # the provider hung up: the server cannot tell either
            raise MCPError(types.INTERNAL_ERROR, str(exc)) from exc

    return server


def _text(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


@dataclass
class McpHarness:
    """``GuardedSession.call_tool("book", ...)``: guarded, or a step of the open agent run."""

    name: str
    saga: bool
    agent: AgentSaga
    skips: tuple[str, ...] = ("scope_per_attempt",)
    tool_failure: type[Exception] = ToolFailed
    """What a declared tool's failure raises here (the server's exception is an ``isError`` result)."""

    def turn(
        self, env: Any, body: Callable[[str], str], declaration: ToolDeclaration, on_doubt: OnDoubt, *,
        rerun: bool, open_run: bool = True,
    ) -> list[str]:  # fmt: skip
        server = _server(body)
        call_id = f"call-{uuid.uuid4().hex[:8]}"
        once = functools.partial(self._once, env, server, declaration, on_doubt, call_id, open_run)
        outputs = [in_loop(lambda: once(crash=rerun))]
        if rerun:  # a restarted process calls again: the same run, the same call id
            outputs.append(in_loop(once))
        return outputs

    async def _once(  # noqa: PLR0917 - the harness's one driver
        self, env: Any, server: MCPServer, declaration: ToolDeclaration, on_doubt: OnDoubt, call_id: str,
        open_run: bool, crash: bool = False,
    ) -> str:  # fmt: skip
        async with Client(server) as client:
            session = GuardedSession(client, env.guard, server="conformance", declare={"book": declaration},
                                     on_doubt=on_doubt)  # fmt: skip

            async def call() -> str:
                return _text(await session.call_tool("book", {"item": "room"}, call_id=call_id))

            if not self.saga:
                with scope(env.run_id):
                    return await call()
            if not open_run:
                return await call()
            async with env.runner.run(self.agent, env.run_id) as run:
                answer = await call()
                if crash:
                    run.pause()  # the process stops here, the run parked; the next one opens it again
                return answer


def mcp_harnesses(agent: AgentSaga) -> list[McpHarness]:
    """The MCP harnesses, their saga mode's steps in ``agent``'s runs."""
    return [McpHarness("mcp-session", saga=False, agent=agent), McpHarness("mcp-session-saga", True, agent)]
