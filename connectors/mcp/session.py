"""A guarded MCP client session: each call of a tool that changes the world happens once.

::

    async with stdio_session(StdioServerParameters(command="payments-server")) as session:
        payments = GuardedSession(session, guard, server="payments")
        with scope("order-42"):                       # or inside a framework adapter's tool call
            result = await payments.call_tool("charge", {"amount": 420}, call_id="call_1")

:meth:`GuardedSession.call_tool` takes what ``ClientSession.call_tool`` takes and returns a
``CallToolResult``. The tool's :class:`~sagaguard.connectors.mcp.policy.ToolPolicy` (its annotations from
``list_tools``, or your declaration) decides what happens:

- ``pass_through`` (read-only): the call is sent as it is.
- otherwise the call is a guarded effect named ``mcp.{server}.{tool}``, fingerprinted on the tool's
  name and arguments, and keyed on the run: an explicit ``key=``; else the current scope and the
  call id (``call_id=``, or the model's tool call id the framework adapters set; inside an agent
  run with no scope, the run's id stands for the scope); else the current scope and the call's
  ordinal in it. Arguments that are not JSON and keys that are not non-empty strings are refused
  before anything is recorded or sent. The first run sends it, with the effect's provider key in the
  request's ``_meta`` (:data:`~sagaguard.connectors.mcp.policy.IDEMPOTENCY_META_KEY`); a re-run returns the
  recorded ``CallToolResult`` (stored as JSON) without reaching the server. A crash between the
  request and its record leaves the call in doubt: re-sent under the same key (``resend``) or
  resolved by its reconciler, else parked (``at_most_once``, ``OutcomeUnknown``, or what
  ``on_doubt=`` says).
- a tool declared with an undo (or as the pivot) inside an open agent run
  (:func:`sagaguard.saga.agent.current_run`) is a step of the run: ``await run.acall(...)`` registers the call
  and its undo in one journal commit before the request leaves (see :mod:`sagaguard.connectors.mcp.undo`).

Both go through the one tool-call pipeline (:mod:`sagaguard.connectors.toolcall`), as every
framework adapter's calls do (the call id on the ``execute_tool`` span, a scope per attempt,
``on_doubt``, a step's failure ending its run); what stays here is MCP's own: naming and keying a
call, the request, a dead connection (not sent) and which results are failures.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol, cast

import anyio
from mcp import ClientSession, types
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from sagaguard.connectors.declare import ToolDeclaration, is_step
from sagaguard.connectors.in_doubt import OnDoubt, Pending
from sagaguard.connectors.mcp.policy import (
    IDEMPOTENCY_META_KEY,
    LookupTool,
    OnToolError,
    ServerGone,
    ToolFailed,
    ToolFailedAmbiguous,
    ToolPolicy,
    check_arguments,
    check_key,
    guard_options,
    is_failure,
    pick,
    policy_for,
)
from sagaguard.connectors.mcp.transport import UNSENT, mcp_http_client
from sagaguard.connectors.toolcall import STOP, SagaMode, ToolCallSite, arun_tool_call
from sagaguard.idempotency.effect import (
    APPLIED_UNKNOWN,
    NOT_APPLIED,
    Applied,
    NotAppliedResolution,
    ReconcileRequest,
    Unknown,
    current_effect,
)
from sagaguard.idempotency.errors import ConfigurationError, NoScope, NotApplied
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.keys import EffectIdentity, Scope, current_scope, scope
from sagaguard.idempotency.options import RunOptions
from sagaguard.idempotency.telemetry import TOOL_CALL_ID

if TYPE_CHECKING:
    from sagaguard.saga.agent import AgentRun

__all__ = ["GuardedSession", "ToolSession", "http_session", "pending_result", "stdio_session"]

_GONE = (types.CONNECTION_CLOSED, UNSENT)
"""The SDK's error codes of a connection that is gone: closed (stdio, the server exited), or not
made (HTTP, :mod:`sagaguard.connectors.mcp.transport`)."""


class ToolSession(Protocol):
    """What :class:`GuardedSession` needs of an MCP session (``mcp.ClientSession`` has it)."""

    async def list_tools(self) -> types.ListToolsResult:
        """The server's tools (one page: the first)."""
        ...

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
        *,
        meta: Any = None,
    ) -> types.CallToolResult:
        """Send ``tools/call``."""
        ...


@asynccontextmanager
async def stdio_session(params: StdioServerParameters) -> AsyncIterator[ClientSession]:
    """An initialized ``ClientSession`` to a server started as a subprocess (stdio).

    The server inherits this process's environment (its API keys, ``PATH``) when ``params.env``
    is None; the SDK alone would pass only a few safe variables (``HOME``, ``PATH``, ...). Give
    ``env=`` to choose exactly what it gets.
    """
    if params.env is None:
        params = params.model_copy(update={"env": dict(os.environ)})
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@asynccontextmanager
async def http_session(url: str, **client_options: Any) -> AsyncIterator[ClientSession]:
    """An initialized ``ClientSession`` to a streamable-HTTP server at ``url``, over an HTTP client
    that answers a request which never reached the server as *not sent*
    (:mod:`sagaguard.connectors.mcp.transport`), so a guarded call to a dead server raises
    :class:`~sagaguard.connectors.mcp.policy.ServerGone` instead of being left in doubt.
    ``client_options`` (``headers``, ``auth``, ``timeout``) go to that ``httpx2.AsyncClient``."""
    async with (
        mcp_http_client(**client_options) as client,
        streamable_http_client(url, http_client=client) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


SessionFactory = Callable[[], AbstractAsyncContextManager[ClientSession]]
"""Opens a session to one server (``lambda: stdio_session(params)``)."""


def pending_result(pending: Pending) -> types.CallToolResult:
    """The tool result :class:`~sagaguard.connectors.in_doubt.ReturnPending` hands the model: an error
    result whose text is the pending JSON, with the same object as ``structuredContent``."""
    text = pending.as_json()
    content: list[types.ContentBlock] = [types.TextContent(type="text", text=text)]
    return types.CallToolResult(content=content, structured_content=json.loads(text), is_error=True)


def recorded_result(result: types.CallToolResult) -> dict[str, Any]:
    """A result as an agent saga's row keeps it for the undo: the wire's JSON (``content``,
    ``structuredContent``, ``isError``)."""
    return result.model_dump(mode="json", by_alias=True, exclude_none=True)


class GuardedSession:
    """An MCP client session whose world-changing tool calls happen once (module docstring).

    Args:
        session: the session to the server (an initialized ``mcp.ClientSession``).
        guard: the guard the calls run under.
        server: the server's name in effect names (``mcp.{server}.{tool}``) and undos.
        declare: per tool name, a :class:`~sagaguard.connectors.declare.ToolDeclaration` (or a
            :class:`~sagaguard.connectors.mcp.policy.ToolPolicy`) that wins over the tool's annotations.
        on_doubt: what a call left in doubt does (:mod:`sagaguard.connectors.in_doubt`; default: raise
            ``OutcomeUnknown``). ``ReturnPending()`` returns :func:`pending_result`.

    Raises:
        ConfigurationError: an empty or malformed server name.
    """

    def __init__(
        self,
        session: ToolSession,
        guard: Guard,
        *,
        server: str,
        declare: Mapping[str, ToolDeclaration | ToolPolicy] | None = None,
        on_doubt: OnDoubt = STOP,
    ) -> None:
        if not server or not server.replace("_", "").replace("-", "").isalnum():
            raise ConfigurationError(f"MCP server name {server!r}: letters, digits, _ and - only")
        self.session = session
        self.guard = guard
        self.server = server
        self.declare = dict(declare or {})
        self.on_doubt = on_doubt
        self._tools: dict[str, types.Tool] | None = None
        self._lookups: dict[str, Any] = {}
        self._gone: str | None = None

    @property
    def gone(self) -> bool:
        """Whether the connection to the server was found closed (every later call raises
        :class:`~sagaguard.connectors.mcp.policy.ServerGone`, unsent)."""
        return self._gone is not None

    async def _alive(self) -> None:
        """Ask the server for its tools before a guarded request leaves, so that a connection
        already closed (the server died while idle) fails the call as *not sent* instead of
        leaving it in doubt: the SDK answers ``CONNECTION_CLOSED`` alike for a request never
        written and for one whose answer was lost, and only the first is safe to release.
        (``tools/list``, not ``ping``: modern protocol versions removed ``ping``.) Any answer, an
        error included, means the connection is alive."""
        with contextlib.suppress(MCPError):  # the server answered: alive
            await self._listed()

    async def _listed(self) -> types.ListToolsResult:
        """``tools/list``; a closed connection raises ServerGone, and every later call too."""
        if self._gone is not None:
            raise ServerGone(self.server, self._gone)
        try:
            return await self.session.list_tools()
        except MCPError as exc:
            if exc.code not in _GONE:
                raise
            self._gone = exc.error.message or "connection closed"
            raise ServerGone(self.server, self._gone) from exc
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            self._gone = type(exc).__name__
            raise ServerGone(self.server, self._gone) from exc

    async def list_tools(self) -> types.ListToolsResult:
        """The server's tools (and the annotations the policies are read from), cached."""
        result = await self._listed()
        self._tools = {tool.name: tool for tool in result.tools}
        return result

    async def policy(self, name: str) -> ToolPolicy:
        """The policy of the tool ``name`` (lists the server's tools the first time)."""
        if name not in self.declare and self._tools is None:
            await self.list_tools()
        return policy_for(name, (self._tools or {}).get(name), self.declare)

    def effect_name(self, name: str) -> str:
        """The guarded effect's name of the tool ``name``."""
        return f"mcp.{self.server}.{name}"

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
        *,
        key: str | None = None,
        call_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
        run: AgentRun | None = None,
    ) -> types.CallToolResult:
        """Call the tool ``name`` as its policy says (module docstring).

        Args:
            name: the tool.
            arguments: its arguments (JSON).
            read_timeout_seconds: as for ``ClientSession.call_tool``.
            key: an explicit effect key (wins over everything else).
            call_id: the model's tool call id (default: the one the framework adapter set).
            meta: more request ``_meta`` entries.
            run: the agent run a step (a tool declared with an undo or as the pivot) belongs to;
                None: the run open in this context (:func:`sagaguard.saga.agent.current_run`). A
                caller serving many runs from one task (the proxy: a run per client connection)
                names it; the step is registered the same way.

        Returns:
            The server's result, or the recorded one. An ``isError`` result is returned, not raised
            (replayed as it was when it was recorded *not applied*); a step's still ends its run
            failed (:meth:`sagaguard.saga.agent.AgentRun.fail_on_exit`), as any step's failure does.

        Raises:
            InvalidArguments: an argument is not JSON (``Decimal``, ``datetime``, ``set``, ...): not sent.
            InvalidKey: ``key`` or ``call_id`` is not a non-empty string: not sent.
            ServerGone: the connection to the server is closed: not sent, nothing parked.
            OutcomeUnknown: the call is in doubt and parked (with ``on_doubt=Stop()``).
            NoScope: no key, and neither a scope nor an agent run is open.
            KeyConflict: the same call (key) was recorded with other arguments.
            AgentRunCancelled, AgentRunEnded: a saga step's run was cancelled or has ended.
        """
        check_arguments(arguments or {})
        if key is not None:
            check_key(key)
        if call_id is not None:
            check_key(call_id, "call_id")
        if self._gone is not None:
            raise ServerGone(self.server, self._gone)
        policy = await self.policy(name)
        args = dict(arguments or {})
        if not policy.guarded:
            plain = dict(meta) if meta else None
            return await self.session.call_tool(name, args, read_timeout_seconds, meta=plain)
        site, sent_as, step_run = self._site(
            name, args, policy, key, call_id or TOOL_CALL_ID.get(), given=run
        )

        async def send() -> types.CallToolResult:
            provider_key = current_effect().provider_key
            if sent_as is not None and provider_key != sent_as:  # checked before anything is sent
                raise NotApplied("the agent run keyed the call otherwise than its row records: not sent")
            extra = {**(meta or {}), IDEMPOTENCY_META_KEY: provider_key}
            await self._alive()
            try:
                result = await self.session.call_tool(name, args, read_timeout_seconds, meta=extra)
            except MCPError as exc:
                if exc.code == UNSENT:  # the connection could not be made: not sent
                    self._gone = exc.error.message
                    raise ServerGone(self.server, self._gone) from exc
                if exc.code == types.CONNECTION_CLOSED:  # sent, answer lost: in doubt, and no more
                    self._gone = exc.error.message or "connection closed"
                raise
            failed = is_failure(result, policy.failed_if)
            if failed is not None:
                if policy.on_error is OnToolError.AMBIGUOUS:
                    raise ToolFailedAmbiguous(failed)
                raise ToolFailed(failed)
            return result

        try:
            saga: SagaMode = True if step_run is None else (lambda: step_run)
            return await arun_tool_call(site, send, guard=self.guard, saga=saga, on_doubt=self.on_doubt)
        except ToolFailed as failed:  # the tool's own failure (fresh or replayed) is the call's answer
            return failed.result

    def _site(
        self,
        name: str,
        args: dict[str, Any],
        policy: ToolPolicy,
        key: str | None,
        call_id: str | None,
        *,
        given: AgentRun | None,
    ) -> tuple[ToolCallSite[types.CallToolResult], str | None, AgentRun | None]:
        """The call for the tool-call pipeline (keyed as the module docstring says) and, for a
        step, the provider key its row records (the one its request must carry) and the run
        ``given`` for it (None: the pipeline finds the one open in this context)."""
        effect = self.effect_name(name)
        declaration = ToolDeclaration(changes_world=True, undo=policy.undo, pivot=policy.pivot)
        site = functools.partial(
            ToolCallSite[types.CallToolResult], tool=effect, declaration=declaration, effect=effect,
            pending=pending_result, result_type=types.CallToolResult, record=recorded_result,
            options=self._options(name, policy),
        )  # fmt: skip
        if is_step(declaration):
            from sagaguard.saga.agent import current_run  # the agent-saga path only

            run = current_run() if given is None else given
            if call_id is None:
                raise ConfigurationError(
                    f"MCP tool {name!r} has an undo: its call needs the model's tool call id "
                    "(a framework adapter sets it) or call_id="
                )
            # The row keeps the provider key the request carries (the run's key for the call and
            # its effect's name, agent.tool.{tool}), so an undo whose call's result was never
            # recorded can still ask the server for the work done under it.
            sent_as = EffectIdentity.explicit(
                self.guard.namespace, run.call_key(call_id), f"agent.tool.{effect}", self.guard.ledger_id
            ).provider_key
            recorded = {"tool": name, "arguments": args, "idempotency_key": sent_as}
            return site(call_id=call_id, arguments=recorded, scope_id=""), sent_as, given
        fingerprinted = {"tool": name, "arguments": args}
        if key is None and call_id is not None:
            key = json.dumps(["mcp.tool", _scope_id(), self.server, call_id], separators=(",", ":"))
        if key is not None:
            called = call_id or key  # the proxy's calls have a key and no model's call id
            return site(
                call_id=called, framework_call_id=call_id is not None, arguments=fingerprinted, key=key,
                scope_id=key,
            ), None, None  # fmt: skip
        # No id: the call is its scope's next call of the effect, the ordinal taken once here so
        # that every attempt (one after an operator's resolution too) has the same key.
        unit = current_scope()
        ordinal = unit.next_ordinal(effect)
        return site(
            call_id=f"{effect}#{ordinal}", framework_call_id=False, arguments=fingerprinted,
            scope_id=unit.id, enter=functools.partial(_at_ordinal, effect, ordinal),
        ), None, None  # fmt: skip

    def _options(self, name: str, policy: ToolPolicy) -> RunOptions:
        # A policy's own options are the caller's Guard.run options, checked by the guard by name.
        options = cast(RunOptions, guard_options(policy))
        if policy.lookup is not None:
            # One reconciler per lookup, kept: the guard keeps its operations by their options.
            found = self._lookups.get(name)
            if found is None:
                found = self._lookups[name] = self._reconciler(policy.lookup)
            options["reconciler"] = found
        return options

    def _reconciler(self, lookup: LookupTool) -> Any:
        async def reconcile(request: ReconcileRequest) -> Applied[Any] | NotAppliedResolution | Unknown:
            source = {
                "arguments": request.arguments.get("arguments"),
                "idempotency_key": request.provider_key,
            }
            answer = await self.session.call_tool(lookup.tool, pick(lookup.arguments, source))
            if answer.is_error:
                return APPLIED_UNKNOWN
            found = pick({"found": lookup.found}, recorded_result(answer)).get("found")
            if found is None:
                return APPLIED_UNKNOWN
            return Applied(answer) if found else NOT_APPLIED

        return reconcile


def _scope_id() -> str:
    """The current scope's id; inside an agent run opened without a scope of its own, the run's id
    (the same key as ``with scope(run_id)`` gives, so a run needs no extra scope for its tools).

    Raises:
        NoScope: neither a scope nor an agent run is open.
    """
    try:
        return current_scope().id
    except NoScope:
        from sagaguard.saga.agent import current_run  # the agent-saga path only

        try:
            return current_run().run_id
        except LookupError:
            raise NoScope(
                "an MCP tool call needs a key: open a scope (`with scope(run_id)`), an agent run, "
                "or pass key="
            ) from None


@contextlib.contextmanager
def _at_ordinal(effect: str, ordinal: int, scope_id: str) -> Iterator[Scope]:
    """An attempt of a call without an id: a fresh scope of its caller's id whose next call of
    ``effect`` is the call's ``ordinal``, so the guard derives the call's key on every attempt."""
    with scope(scope_id) as unit:
        for _ in range(ordinal):
            unit.next_ordinal(effect)
        yield unit
