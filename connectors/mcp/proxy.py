"""A proxy between any MCP client and any MCP server that applies the guarded session's rules.

For MCP clients you do not control (a desktop app, an IDE, another team's agent)::

    sagaguard mcp proxy --store sqlite:///proxy.db -- payments-server --flag   # stdio, both sides
    sagaguard mcp proxy --http 127.0.0.1:8765 --store ... -- payments-server   # clients over HTTP
    sagaguard mcp proxy --url http://payments:8000/mcp --store ...             # an HTTP upstream

Tools are listed as the server lists them; each call goes through a
:class:`~sagaguard.connectors.mcp.session.GuardedSession` on the upstream session: the modes come from
the annotations (the command line takes no declarations; in code, :class:`McpProxy`'s ``declare=``
overrides them per tool, as for the session).

**What identifies a call.** A proxy sees requests, not an agent's run, so:

- A client that sends an idempotency key in the request's ``_meta``
  (:data:`~sagaguard.connectors.mcp.policy.IDEMPOTENCY_META_KEY`) names the call: the same key is the same
  call, across client restarts, proxy restarts and reconnections. Sent again after an answer, it
  gets the recorded result; after a crash it is resolved (a ``resend`` tool is re-sent under the
  same upstream key; an ``at_most_once`` one is answered as pending, parked for an operator, never
  re-sent). The same key with other arguments is refused (``INVALID_PARAMS``).
- Without a key, the proxy cannot tell a retry from a new call, and never guesses: every request
  is a call of its own, at most once per proxy session and JSON-RPC request id. It is sent once and
  recorded (an operator sees what a crash left in doubt: ``sagaguard effects list``); the proxy
  never re-sends it, never swallows a second identical request, and a client that retries after a
  lost answer makes a new call.

Answers: the server's result (or the recorded one); a call in doubt is an ``isError`` result whose
JSON says ``"status": "pending"`` with the effect key to resolve.
"""

from __future__ import annotations

import json
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

from mcp import types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.connectors.in_doubt import ReturnPending
from sagaguard.connectors.mcp.policy import IDEMPOTENCY_META_KEY, ToolPolicy
from sagaguard.connectors.mcp.session import GuardedSession, ToolSession
from sagaguard.idempotency.errors import KeyConflict
from sagaguard.idempotency.guard import Guard

__all__ = ["McpProxy", "call_key", "serve_http", "serve_stdio"]

_RESERVED = "io.modelcontextprotocol/"
"""``_meta`` entries the SDK session stamps itself (protocol version, client info)."""


def call_key(client_key: str | None, session: str, request_id: Any) -> str:
    """The effect key of a proxied call: the client's idempotency key when it sent one, else the
    proxy session and the JSON-RPC request id."""
    if client_key:
        return json.dumps(["mcp.proxy", "client", client_key], separators=(",", ":"))
    return json.dumps(["mcp.proxy", "session", session, str(request_id)], separators=(",", ":"))


class McpProxy:
    """The proxy's MCP server, forwarding to ``upstream`` through a guarded session.

    Args:
        upstream: the session to the real server (initialized).
        guard: the guard the calls run under (its store is the proxy's ledger).
        server: the upstream server's name in effect names (``mcp.{server}.{tool}``).
        declare: per tool, a declaration or policy that wins over the annotations.
        name: the name the proxy gives itself to its clients.
    """

    def __init__(
        self,
        upstream: ToolSession,
        guard: Guard,
        *,
        server: str,
        declare: Mapping[str, ToolDeclaration | ToolPolicy] | None = None,
        name: str = "sagaguard-proxy",
    ) -> None:
        self.guarded = GuardedSession(
            upstream, guard, server=server, declare=declare, on_doubt=ReturnPending()
        )
        self._sessions: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.server: Server[Any] = Server(name, on_list_tools=self._list_tools, on_call_tool=self._call_tool)
        """The low-level MCP server to run on a transport (stdio or streamable HTTP)."""

    def _session_id(self, ctx: ServerRequestContext[Any]) -> str:
        found = self._sessions.get(ctx.session)
        if found is None:
            found = self._sessions[ctx.session] = uuid.uuid4().hex
        return found

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return await self.guarded.list_tools()

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        meta = dict(params.meta or {})
        sent = meta.pop(IDEMPOTENCY_META_KEY, None)
        client_key = sent if isinstance(sent, str) and sent else None
        forward = {k: v for k, v in meta.items() if not k.startswith(_RESERVED)}
        key = call_key(client_key, self._session_id(ctx), ctx.request_id)
        try:
            return await self.guarded.call_tool(params.name, params.arguments, key=key, meta=forward)
        except KeyConflict as exc:
            raise MCPError(
                types.INVALID_PARAMS, f"idempotency key reused with other arguments: {exc}"
            ) from exc


async def serve_stdio(proxy: McpProxy) -> None:
    """Serve the proxy to one client over this process's stdin and stdout, until it disconnects."""
    from mcp.server.stdio import stdio_server

    server = proxy.server
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def serve_http(proxy: McpProxy, host: str, port: int, path: str = "/mcp") -> None:
    """Serve the proxy to any number of clients over streamable HTTP at ``http://host:port/path``."""
    import uvicorn

    app = proxy.server.streamable_http_app(streamable_http_path=path, host=host)
    await uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).serve()
