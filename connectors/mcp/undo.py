"""Undo through MCP: a tool's undo is another tool, on the same server or another one.

::

    servers = McpServers()                              # how any process reaches each server
    servers.register("payments", lambda: stdio_session(StdioServerParameters(command="payments")))

    undos = UndoRegistry()                              # the agent saga's registry
    mcp_undos = McpUndos(undos, servers)
    declare = {
        "charge": mcp_undos.undo("payments", "charge", UndoTool(
            "create_refund", arguments={"payment_intent": "result.structuredContent.id",
                                        "charge_key": "idempotency_key"})),
        "create_issue": mcp_undos.undo("tracker", "create_issue", UndoTool(
            "close_issue", arguments={"number": "result.structuredContent.number",
                                      "created_under": "idempotency_key"})),
    }
    payments = GuardedSession(session, guard, server="payments", declare=declare)
    trip_agent = AgentSaga("trip_agent", undos)         # register it with the worker too

Put this at import, in a module the agent and the worker both import: the journal records an
undo by its name only, and the worker, in a fresh process, finds it in ``undos`` and opens its own
session to the server through ``servers``.

**What the undo receives.** Its arguments are read from the recorded call by paths into one object:
``arguments`` (the call's arguments), ``result`` (its recorded ``CallToolResult`` as the wire sends it:
``content``, ``structuredContent``, ``isError``; None when a crash left the call's outcome unknown) and
``idempotency_key`` (the key the call's request carried in ``_meta``, which a server that kept it can
look the work up by). A path that finds nothing is left out of the undo's arguments, so an undo tool
that takes either an id or the key works in both cases. Pass the key to every undo whose tool can
take it: the result is None whenever a crash cut the call after the server's work, and an undo that
reads only the result then cannot undo it. A callable ``arguments(call, result)`` can
build them instead.

**Once.** The undo runs as the saga's compensation: a guarded effect under its own key, run again
after a crash until it is recorded, and retried then parked for an operator when it keeps failing.
Its request carries that effect's provider key in ``_meta``, the same on every run, so an undo tool
that deduplicates on it (a refund passed on to Stripe under that key) is applied once. An undo
tool that answers ``isError: true`` failed: :class:`UndoFailed` is raised and the compensation
retried.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

from mcp import ClientSession, types

from sagaguard.connectors.declare import ToolDeclaration, changes_world
from sagaguard.connectors.mcp.policy import IDEMPOTENCY_META_KEY, FailureCheck, is_failure, pick
from sagaguard.connectors.mcp.session import SessionFactory
from sagaguard.idempotency.effect import current_effect
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.saga.agent import UndoRegistry

__all__ = ["McpServers", "McpUndos", "UndoFailed", "UndoTool", "undo_arguments"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,40}")

ArgumentBuilder = Callable[[Mapping[str, Any], Any], Mapping[str, Any]]
"""``arguments(call, result)``: the undo tool's arguments from the recorded call (``arguments``,
``idempotency_key``) and its recorded result (None when unknown)."""


class UndoFailed(Exception):
    """The undo tool answered ``isError: true`` (the compensation is retried, then parked).

    Attributes:
        result: the undo tool's result.
    """

    def __init__(self, tool: str, result: types.CallToolResult) -> None:
        text = " ".join(block.text for block in result.content if isinstance(block, types.TextContent))
        super().__init__(f"undo tool {tool!r} failed: {text[:300]}")
        self.result = result


@dataclass(frozen=True)
class UndoTool:
    """The tool that undoes another tool's call, and its arguments.

    Attributes:
        tool: the undo tool's name.
        server: its server's name in :class:`McpServers` (None: the server of the call it undoes).
        arguments: undo argument name to a dotted path into the recorded call (module docstring),
            or a callable building them.
        failed_if: a failure check for undo results without ``isError`` (a server that answers
            its errors as text: :class:`~sagaguard.connectors.mcp.policy.ErrorText`); such a
            result raises :class:`UndoFailed` like an ``isError`` one.
    """

    tool: str
    server: str | None = None
    arguments: Mapping[str, str] | ArgumentBuilder = field(default_factory=lambda: MappingProxyType({}))
    failed_if: FailureCheck | None = None


def undo_arguments(undo: UndoTool, call: Mapping[str, Any], result: Any) -> dict[str, Any]:
    """The undo tool's arguments for a recorded ``call`` and ``result`` (None when unknown).

    Args:
        undo: the undo's declaration.
        call: the call as the agent saga's row records it: ``{"tool", "arguments", "idempotency_key"}``.
        result: the recorded result (JSON), or None.
    """
    if callable(undo.arguments):
        return dict(undo.arguments(call, result))
    source = {
        "arguments": call.get("arguments"),
        "result": result,
        "idempotency_key": call.get("idempotency_key"),
    }
    return pick(undo.arguments, source)


class McpServers:
    """How to open a session to each MCP server, by name (any process: the worker uses it too).

    Thread-safe.
    """

    def __init__(self) -> None:
        self._factories: dict[str, SessionFactory] = {}
        self._lock = threading.Lock()

    def register(self, name: str, factory: SessionFactory) -> None:
        """Open sessions to ``name`` with ``factory`` (it returns an async context manager that
        yields an initialized ``ClientSession``: :func:`~sagaguard.connectors.mcp.session.stdio_session`,
        :func:`~sagaguard.connectors.mcp.session.http_session`).

        Raises:
            ConfigurationError: a malformed name, or the name taken by another factory.
        """
        if not _NAME.fullmatch(name):
            raise ConfigurationError(f"MCP server name {name!r}: 1-40 letters, digits, _ and -")
        with self._lock:
            found = self._factories.get(name)
            if found is not None and found is not factory:
                raise ConfigurationError(f"MCP server {name!r} is already registered")
            self._factories[name] = factory

    def open(self, name: str) -> AbstractAsyncContextManager[ClientSession]:
        """A new session to ``name``.

        Raises:
            LookupError: no factory is registered under ``name``.
        """
        with self._lock:
            factory = self._factories.get(name)
        if factory is None:
            raise LookupError(
                f"no MCP server {name!r} is registered (register it at import, where the worker runs)"
            )
        return factory()

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._factories


class McpUndos:
    """Registers undos that are MCP tool calls in an agent saga's :class:`UndoRegistry`.

    Args:
        undos: the agent saga's registry.
        servers: where the undo tools' servers are opened.
        timeout: seconds an undo tool's request may take (``read_timeout_seconds``).
    """

    def __init__(self, undos: UndoRegistry, servers: McpServers, *, timeout: float | None = 60.0) -> None:
        self.undos = undos
        self.servers = servers
        self.timeout = timeout

    def undo(self, server: str, tool: str, undo: UndoTool, **options: Any) -> ToolDeclaration:
        """Register the undo of ``tool`` on ``server`` and return the tool's declaration (for
        :class:`~sagaguard.connectors.mcp.session.GuardedSession`'s ``declare=``).

        Args:
            server: the server of the tool being undone.
            tool: the tool being undone.
            undo: its undo tool and the undo's arguments.
            options: Guard options of the tool's calls, as for
                :func:`~sagaguard.connectors.declare.changes_world`.

        Raises:
            ConfigurationError, DefinitionError: a malformed name, or the undo's name taken.
        """
        target = undo.server or server
        name = f"mcp.{server}.{tool}.undo"
        if not _NAME.fullmatch(server) or not _NAME.fullmatch(target):
            raise ConfigurationError(f"MCP server names {server!r}, {target!r}: letters, digits, _ and -")

        def run_undo(call: Any, result: Any) -> None:
            recorded = call if isinstance(call, Mapping) else {}
            arguments = undo_arguments(undo, recorded, result)
            try:
                key: str | None = current_effect().provider_key  # the compensation's own effect
            except ConfigurationError:
                key = None  # called by hand, outside a compensation
            answer = _blocking(lambda: self._send(target, undo.tool, arguments, key))
            failed = is_failure(answer, undo.failed_if)
            if failed is not None:
                raise UndoFailed(undo.tool, failed)

        run_undo.__name__ = run_undo.__qualname__ = name
        self.undos.add(name, run_undo)
        return changes_world(undo=name, **options)

    async def _send(
        self, server: str, tool: str, arguments: dict[str, Any], key: str | None
    ) -> types.CallToolResult:
        meta = None if key is None else cast(types.RequestParamsMeta, {IDEMPOTENCY_META_KEY: key})
        async with self.servers.open(server) as session:
            return await session.call_tool(tool, arguments, self.timeout, meta=meta)


def _blocking(call: Callable[[], Any]) -> Any:
    """Run the coroutine ``call()`` makes to its end from sync code (an undo is sync: the saga
    runner calls it, in the worker or in the agent's compensation thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(call())
    # Called from a thread that runs a loop: that loop cannot be blocked on, so use another thread.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(call())).result()
