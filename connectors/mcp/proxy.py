"""A proxy between any MCP client and any MCP server that applies the guarded session's rules.

For MCP clients you do not control (a desktop app, an IDE, another team's agent)::

    sagaguard mcp proxy --store sqlite:///proxy.db -- payments-server --flag   # stdio, both sides
    sagaguard mcp proxy --http 127.0.0.1:8765 --store ... -- payments-server   # clients over HTTP
    sagaguard mcp proxy --url http://payments:8000/mcp --store ...             # an HTTP upstream

Tools are listed as the server lists them; each call goes through a
:class:`~sagaguard.connectors.mcp.session.GuardedSession` on the upstream session: the modes come from
the annotations, overridden per tool by declarations (``sagaguard mcp proxy --declare FILE``; in
code, :class:`McpProxy`'s ``declare=``, as for the session).

**What identifies a call.** A proxy sees requests, not an agent's run, so:

- A client that sends an idempotency key in the request's ``_meta``
  (:data:`~sagaguard.connectors.mcp.policy.IDEMPOTENCY_META_KEY`) names the call: the same key is the same
  call, across client restarts, proxy restarts and reconnections. Sent again after an answer, it
  gets the recorded result; after a crash it is resolved (a ``resend`` tool is re-sent under the
  same upstream key; an ``at_most_once`` one is answered as pending, parked for an operator, never
  re-sent). The same key with other arguments is refused (``INVALID_PARAMS``).
  A key that is not a non-empty string (a number, ``""``, an object) is refused
  (``INVALID_PARAMS``), never taken for "no key".
- Without a key, the proxy cannot tell a retry from a new call, and never guesses: every request
  is a call of its own, at most once per client connection and JSON-RPC request id (the connection:
  the proxy's one stdio client, or an HTTP client's ``mcp-session-id``). It is sent once and
  recorded (an operator sees what a crash left in doubt: ``sagaguard effects list``); the proxy
  never re-sends it, never swallows a second identical request, and a client that retries after a
  lost answer makes a new call.

Answers: the server's result (or the recorded one); a call in doubt is an ``isError`` result whose
JSON says ``"status": "pending"`` with the effect key to resolve.

**Undo: a run per client connection.** When the declarations give a tool an undo (another tool of
the same server: ``--declare FILE``, :class:`~sagaguard.connectors.mcp.proxyruns.DeclaredUndo`), each
client connection is an agent run of the saga type ``mcp-proxy.{server}`` (``runs=``,
:mod:`sagaguard.connectors.mcp.proxyruns`): every call of that tool is a step of its connection's run,
registered with its undo before the request leaves, so ``sagaguard sagas cancel RUN`` undoes what the
connection did, in reverse (a live proxy, a restarted one, or ``sagaguard mcp worker``). A clean
disconnect (stdio), an HTTP client's ``DELETE`` of its session, or an HTTP session that sat idle
past ``session_idle`` (:func:`serve_http`: the proxy then ends it, as a ``DELETE`` does) completes
the run (undoes it, when an operator cancelled it first); a stateless HTTP request (no
``mcp-session-id``: the protocol revision without sessions) is a run of its own, ended when it is
answered. A client key
used by one run is refused on another connection (not sent), never made again in a second run.
Calls of tools without an undo are as above.

**A server that dies.** A call whose request left before the server died is in doubt, as above. A
call made after is never sent to a dead connection and never parked: given ``reconnect=`` (as
``sagaguard mcp proxy`` does), the proxy opens a new upstream session and sends it there; without,
it answers an error (``INTERNAL_ERROR``, "not sent") and the record is released, so the client's
retry under the same key is sent once the server is back.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import anyio
from mcp import types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.connectors.in_doubt import ReturnPending
from sagaguard.connectors.mcp.http_sessions import HttpSessions
from sagaguard.connectors.mcp.policy import (
    IDEMPOTENCY_META_KEY,
    InvalidArguments,
    InvalidKey,
    ServerGone,
    ToolPolicy,
    check_key,
)
from sagaguard.connectors.mcp.proxyruns import ProxyRuns
from sagaguard.connectors.mcp.session import GuardedSession, ToolSession
from sagaguard.idempotency.checks import seconds
from sagaguard.idempotency.errors import KeyConflict
from sagaguard.idempotency.guard import Guard
from sagaguard.saga.agent import AgentRunCancelled, AgentRunEnded

__all__ = ["DEFAULT_SESSION_IDLE", "McpProxy", "call_key", "serve_http", "serve_stdio"]

T = TypeVar("T")

DEFAULT_SESSION_IDLE = 1800.0
"""Seconds an HTTP client's session may sit idle before the proxy ends it (:func:`serve_http`):
30 minutes, the MCP SDK's own default for its session manager."""

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
        reconnect: opens a new upstream session when the current one is gone (the server died);
            None: a call made after that is answered "not sent" (module docstring).
        runs: the runs of the connections, when ``declare`` names undos
            (:mod:`sagaguard.connectors.mcp.proxyruns`); a call of a tool with an undo is a step
            of its connection's run. None: such a call needs an agent run open in its context.
    """

    def __init__(
        self,
        upstream: ToolSession,
        guard: Guard,
        *,
        server: str,
        declare: Mapping[str, ToolDeclaration | ToolPolicy] | None = None,
        name: str = "sagaguard-proxy",
        reconnect: Callable[[], Awaitable[ToolSession]] | None = None,
        runs: ProxyRuns | None = None,
    ) -> None:
        self._declare = dict(declare or {})
        self.runs = runs
        self.guarded = GuardedSession(
            upstream, guard, server=server, declare=self._declare, on_doubt=ReturnPending()
        )
        self._reconnect = reconnect
        self._instance = uuid.uuid4().hex
        self.server: Server[Any] = Server(name, on_list_tools=self._list_tools, on_call_tool=self._call_tool)
        """The low-level MCP server to run on a transport (stdio or streamable HTTP)."""

    def _session_id(self, ctx: ServerRequestContext[Any]) -> str:
        """The client connection a request came on. The SDK builds a ``ServerSession`` per request,
        so the connection is read from the transport: an HTTP request's ``mcp-session-id`` header;
        over stdio, this proxy's one client. A stateless HTTP request (no session id) is a
        connection of its own: two clients' request ids must never be taken for one call."""
        request = ctx.request
        if request is None:
            return f"stdio:{self._instance}"
        headers = getattr(request, "headers", None)
        found = headers.get("mcp-session-id") if headers is not None else None
        if isinstance(found, str) and found:
            return f"http:{self._instance}:{found}"
        return f"request:{uuid.uuid4().hex}"

    async def http_session_ended(self, session_id: str) -> None:
        """The HTTP session ``session_id`` is over: its client ended it (``DELETE``, as a client
        closing cleanly sends), or it sat idle past the limit and :func:`serve_http` ended it. Its
        run, if it has one, ends as a stdio client's disconnect does (:meth:`ProxyRuns.close
        <sagaguard.connectors.mcp.proxyruns.ProxyRuns.close>`): completed, or undone when an
        operator's cancel is pending."""
        if self.runs is not None:
            await self.runs.close(f"http:{self._instance}:{session_id}")

    async def _upstream(self) -> GuardedSession:
        """The guarded upstream session, reopened (once per call) when it is gone."""
        if self.guarded.gone and self._reconnect is not None:
            guarded = self.guarded
            session = await self._reconnect()
            if self.guarded is guarded:  # another request may have reconnected meanwhile
                self.guarded = GuardedSession(
                    session, guarded.guard, server=guarded.server, declare=self._declare,
                    on_doubt=ReturnPending(),
                )  # fmt: skip
        return self.guarded

    async def _once_more(self, call: Callable[[GuardedSession], Awaitable[T]]) -> T:
        """``call`` on the upstream session; when that one is gone (not sent, its record released),
        again on a new connection, with ``reconnect`` (once: a server that dies again at once
        answers the client "not sent")."""
        try:
            return await call(await self._upstream())
        except ServerGone:
            if self._reconnect is None:
                raise
            return await call(await self._upstream())

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return await self._once_more(lambda upstream: upstream.list_tools())

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        meta = dict(params.meta or {})
        sent = meta.pop(IDEMPOTENCY_META_KEY, None)
        forward = {k: v for k, v in meta.items() if not k.startswith(_RESERVED)}
        try:
            client_key = None if sent is None else check_key(sent, f"_meta {IDEMPOTENCY_META_KEY!r}")
            connection = self._session_id(ctx)
            key = call_key(client_key, connection, ctx.request_id)
            if (
                self.runs is not None
                and (await (await self._upstream()).policy(params.name)).undo is not None
            ):
                return await self._step(
                    connection=connection, params=params, key=key, client_key=client_key,
                    request_id=str(ctx.request_id), forward=forward,
                )  # fmt: skip
            return await self._once_more(
                lambda upstream: upstream.call_tool(params.name, params.arguments, key=key, meta=forward)
            )
        except KeyConflict as exc:
            raise MCPError(
                types.INVALID_PARAMS, f"idempotency key reused with other arguments: {exc}"
            ) from exc
        except (InvalidKey, InvalidArguments) as exc:
            raise MCPError(types.INVALID_PARAMS, str(exc)) from exc
        except ServerGone as exc:
            raise MCPError(types.INTERNAL_ERROR, str(exc)) from exc

    async def _step(
        self,
        *,
        connection: str,
        params: types.CallToolRequestParams,
        key: str,
        client_key: str | None,
        request_id: str,
        forward: dict[str, Any],
    ) -> types.CallToolResult:
        """A call of a tool with an undo: a step of the connection's run
        (:mod:`sagaguard.connectors.mcp.proxyruns`), its id the client's key, else the request id
        (one call per connection and request id, as without a run). A connection of one request
        (stateless HTTP) ends its run with the call."""
        assert self.runs is not None
        runs = self.runs
        failed = False
        try:
            async with runs.calling(connection) as run:
                call_id = f"request:{request_id}"
                if client_key is not None:
                    call_id = f"key:{client_key}"
                    bound = await runs.bind(key, run, params.name, params.arguments or {})
                    if bound != run.run_id:
                        raise MCPError(
                            types.INVALID_PARAMS,
                            f"idempotency key {client_key!r} was used by agent run {bound} (another "
                            "client connection): its call and its undo are there (sagaguard sagas "
                            "show); not sent",
                        )
                try:
                    answer = await (await self._upstream()).call_tool(
                        params.name, params.arguments, key=key, call_id=call_id, meta=forward, run=run
                    )
                    failed = run.failing
                    return answer
                except AgentRunCancelled as exc:
                    await runs.cancelled(connection)  # undone now (once this call is out), not at the end
                    raise MCPError(
                        types.INVALID_REQUEST,
                        f"agent run {run.run_id} was cancelled by an operator: not sent",
                    ) from exc
                except AgentRunEnded as exc:
                    failed = run.failing
                    again = "the next call opens a new run" if failed else "reconnect for a new run"
                    raise MCPError(types.INVALID_REQUEST, f"{exc}: not sent; {again}") from exc
        finally:
            if failed or connection.startswith("request:"):
                # A failed call ends its run now, parked for an operator (the saga type leaves a
                # failed run), so that the client, which may well go on (a declined card is an
                # answer its model reads), is not refused for the rest of its connection: its next
                # call of a tool with an undo opens a new run.
                await runs.close(connection)


async def serve_stdio(proxy: McpProxy) -> None:
    """Serve the proxy to one client over this process's stdin and stdout, until it disconnects."""
    from mcp.server.stdio import stdio_server

    server = proxy.server
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def serve_http(
    proxy: McpProxy,
    host: str,
    port: int,
    path: str = "/mcp",
    *,
    session_idle: float = DEFAULT_SESSION_IDLE,
) -> None:
    """Serve the proxy to any number of clients over streamable HTTP at ``http://host:port/path``,
    until the server stops (SIGINT, SIGTERM).

    A client's session ends, and with it its run (:meth:`McpProxy.http_session_ended`), when the
    client ends it (a ``DELETE`` the SDK accepts) or when it has sat idle for ``session_idle``
    seconds: no request of it in flight, an open ``GET`` stream included, which is the MCP SDK's
    own rule for its idle sessions. The proxy keeps that timer itself and turns the SDK's off
    (``session_idle_timeout=None``): the SDK reports no session's end, so a session it expired
    on its own would leave the run open (RUNNING) for as long as the proxy lives, while the session
    is gone for the client too (its id answers 404). An idle session is ended through the SDK's
    app as its client would end it (a ``DELETE`` with its id, in-process), then its run.

    Raises:
        ConfigurationError: ``session_idle`` is not a positive, finite number of seconds.
    """
    import uvicorn

    session_idle = seconds("session_idle", session_idle)
    app = proxy.server.streamable_http_app(streamable_http_path=path, host=host, session_idle_timeout=None)
    async with anyio.create_task_group() as group:
        sessions = HttpSessions(
            app, proxy.http_session_ended, group, idle=session_idle, path=path, host=host, port=port
        )
        config = uvicorn.Config(sessions, host=host, port=port, log_level="warning")
        await uvicorn.Server(config).serve()
        # Stopped cleanly: the sessions still open end with the proxy (ProxyRuns.serve completes
        # their runs), not one by one as their timers would.
        group.cancel_scope.cancel()
