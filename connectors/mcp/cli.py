"""``sagaguard mcp``: list an MCP server's tools as the guard treats them, and proxy it.

::

    sagaguard mcp tools [--json] -- SERVER COMMAND...        # or --url http://host:port/mcp
    sagaguard mcp proxy [--store URL] [--namespace NS] [--server NAME] [--http HOST:PORT]
                        [--declare FILE] -- SERVER COMMAND...

``tools`` starts (or connects to) the server, lists its tools with their annotations and the mode
each gets (``pass_through``, ``resend``, ``at_most_once``) and why. ``proxy`` serves the server's
tools to one client over stdio (default) or to many over streamable HTTP (``--http``), each call
guarded as :mod:`sagaguard.connectors.mcp.proxy` says, recorded in ``--store`` (default ``$SAGAGUARD_STORE``).
``--declare FILE`` overrides tools' annotations (:func:`load_declarations`). When the server dies,
the proxy starts (or reconnects to) it again for the next call; a call it could not send is
answered as not sent, never parked. A server that fails to start is one line on stderr.

:func:`add_commands` adds ``mcp`` to the ``sagaguard`` command's sub-parsers (through the
``sagaguard.commands`` entry point); :func:`run` runs it.

Exit status: 0 done; 1 the server or the store failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TextIO

import anyio
from mcp import ClientSession, types
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError

from sagaguard.connectors.declare import ToolDeclaration, changes_world, read_only
from sagaguard.connectors.mcp.policy import ErrorText, LookupTool, policy_from_annotations
from sagaguard.connectors.mcp.proxy import McpProxy, serve_http, serve_stdio
from sagaguard.connectors.mcp.session import ToolSession, http_session, stdio_session
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.stores import DEFAULT_URL, open_store

__all__ = ["RESULT_SHAPES", "add_commands", "describe", "load_declarations", "one_line", "run"]

PROG = "sagaguard"
ENV_STORE = "SAGAGUARD_STORE"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_HINTS = ("read_only_hint", "destructive_hint", "idempotent_hint", "open_world_hint")
_WIRE = {"read_only_hint": "readOnly", "destructive_hint": "destructive", "idempotent_hint": "idempotent",
         "open_world_hint": "openWorld"}  # fmt: skip


def _call_tool_result(value: Any) -> None:
    """An MCP call's recorded result is a ``CallToolResult`` as the wire spells it."""
    if not isinstance(value, dict) or not isinstance(value.get("content"), list):
        raise ValueError(
            'an MCP tool call records its CallToolResult: {"content": [{"type": "text", "text": "..."}], '
            '"structuredContent": {...}, "isError": false} (content required, the others optional)'
        )
    types.CallToolResult.model_validate(value)


RESULT_SHAPES: Mapping[str, Callable[[Any], None]] = {
    "mcp.": _call_tool_result,
    "agent.tool.mcp.": _call_tool_result,
}
"""The ``effects resolve --result`` shape of MCP tool calls (``sagaguard.idempotency.cli.RESULT_SHAPES``)."""


def describe(tool: types.Tool) -> dict[str, Any]:
    """One tool as ``sagaguard mcp tools`` shows it: its name, hints, mode and why."""
    hints = tool.annotations
    given = (
        {}
        if hints is None
        else {_WIRE[h]: getattr(hints, h) for h in _HINTS if getattr(hints, h) is not None}
    )
    policy = policy_from_annotations(tool)
    return {"name": tool.name, "annotations": given, "mode": policy.mode.value, "reason": policy.reason}


def add_commands(subparsers: Any) -> None:
    """Add the ``mcp`` command (``tools``, ``proxy``) to ``subparsers``."""
    mcp = subparsers.add_parser("mcp", help="MCP servers: their tools as guarded, and a guarding proxy")
    mcp.set_defaults(mcp_command=None, mcp_parser=mcp)
    actions = mcp.add_subparsers(dest="mcp_action", metavar="ACTION")

    def upstream(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--url", help="a streamable-HTTP server instead of a command")
        parser.add_argument("server_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                            help="the server's command line (stdio), after --")  # fmt: skip

    tools = actions.add_parser(
        "tools", help="the server's tools, their annotations and how the guard treats each",
        description="Lists the server's tools with their annotations and the mode each gets: "
        "pass_through (readOnlyHint), resend (idempotentHint: re-sent under the same key when in doubt) "
        "or at_most_once (in doubt: reconciled or parked, never re-sent).",
    )  # fmt: skip
    tools.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    upstream(tools)
    tools.set_defaults(mcp_command=_cmd_tools)

    proxy = actions.add_parser(
        "proxy", help="serve the server's tools, each call guarded",
        description="Sits between any MCP client and the server. A call whose request _meta carries "
        "io.sagaguard/idempotency-key is identified by it (a retry gets the recorded result, a crash is "
        "resolved); one without is at most once per proxy session and request id, never deduplicated "
        "against another request.",
    )  # fmt: skip
    proxy.add_argument("--store", metavar="URL", default=argparse.SUPPRESS,
                       help=f"the effect store (default: ${ENV_STORE}, else {DEFAULT_URL})")  # fmt: skip
    proxy.add_argument("--namespace", default="default", help="the tenant of the proxy's records")
    proxy.add_argument("--server", default="upstream", help="the server's name in effect names")
    proxy.add_argument("--http", metavar="HOST:PORT", help="serve clients over streamable HTTP (at /mcp)")
    proxy.add_argument("--declare", metavar="FILE", type=Path,
                       help="per-tool declarations (JSON) that win over the annotations: "
                       "mode, lookup, provider_idempotent, on_error, failed_if")  # fmt: skip
    upstream(proxy)
    proxy.set_defaults(mcp_command=_cmd_proxy)


def _opener(args: argparse.Namespace) -> Callable[[], AbstractAsyncContextManager[ClientSession]]:
    command = [part for part in args.server_command if part != "--"] if args.server_command else []
    if args.url and command:
        raise ConfigurationError("give the server's command after -- or --url, not both")
    if args.url:
        url = args.url
        return lambda: http_session(url)
    if not command:
        raise ConfigurationError("give the server's command after -- (or --url URL)")
    params = StdioServerParameters(command=command[0], args=command[1:], env=dict(os.environ))
    return lambda: stdio_session(params)


_DECLARATION_KEYS = frozenset({"mode", "lookup", "provider_idempotent", "on_error", "failed_if"})


def load_declarations(path: Path) -> dict[str, ToolDeclaration]:
    """The proxy's per-tool declarations from a JSON file::

        {"tools": {
            "read_query":  {"mode": "read_only"},
            "write_query": {"mode": "changes_world", "failed_if": "^Database error",
                            "lookup": {"tool": "find_row", "arguments": {"key": "idempotency_key"},
                                       "found": "structuredContent.found"}},
            "upsert":      {"mode": "changes_world", "provider_idempotent": true}
        }}

    ``mode`` is ``read_only`` or ``changes_world``; the others, for ``changes_world``, are its
    options: ``lookup`` (:class:`~sagaguard.connectors.mcp.policy.LookupTool`'s fields),
    ``provider_idempotent`` (``resend``), ``on_error`` (``not_applied`` or ``ambiguous``) and
    ``failed_if`` (a regular expression: :class:`~sagaguard.connectors.mcp.policy.ErrorText`).
    An undo is not declared here: a proxy sees requests, not an agent's run, so it has no saga to
    undo in (declare undos in the agent's own :class:`~sagaguard.connectors.mcp.GuardedSession`).

    Raises:
        ConfigurationError: the file cannot be read, is not JSON, or declares anything else.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigurationError(f"--declare {str(path)!r}: {exc}") from None
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, dict):
        raise ConfigurationError(f'--declare {str(path)!r}: a JSON object with "tools": {{name: {{...}}}}')
    return {name: _declaration(path, name, entry) for name, entry in tools.items()}


def _declaration(path: Path, name: str, entry: Any) -> ToolDeclaration:
    where = f"--declare {str(path)!r}, tool {name!r}"
    if not isinstance(entry, dict) or entry.get("mode") not in {"read_only", "changes_world"}:
        raise ConfigurationError(f'{where}: an object with "mode": "read_only" or "changes_world"')
    unknown = sorted(set(entry) - _DECLARATION_KEYS)
    if unknown:
        extra = " (an undo needs an agent run: declare it in code)" if "undo" in unknown else ""
        raise ConfigurationError(f"{where}: unknown entries {unknown}{extra}")
    if entry["mode"] == "read_only":
        if len(entry) > 1:
            raise ConfigurationError(f"{where}: a read_only tool takes no options")
        return read_only
    options: dict[str, Any] = {}
    if "provider_idempotent" in entry:
        if not isinstance(entry["provider_idempotent"], bool):
            raise ConfigurationError(f"{where}: provider_idempotent is true or false")
        options["provider_idempotent"] = entry["provider_idempotent"]
    if "on_error" in entry:
        if entry["on_error"] not in {"not_applied", "ambiguous"}:
            raise ConfigurationError(f'{where}: on_error is "not_applied" or "ambiguous"')
        options["on_error"] = entry["on_error"]
    if "failed_if" in entry:
        if not isinstance(entry["failed_if"], str):
            raise ConfigurationError(f"{where}: failed_if is a regular expression")
        try:
            options["failed_if"] = ErrorText(entry["failed_if"])
        except ConfigurationError as exc:
            raise ConfigurationError(f"{where}: {exc}") from None
    if "lookup" in entry:
        options["lookup"] = _lookup(where, entry["lookup"])
    return changes_world(**options)


def _lookup(where: str, entry: Any) -> LookupTool:
    if not isinstance(entry, dict) or not isinstance(entry.get("tool"), str) or not entry["tool"]:
        raise ConfigurationError(f'{where}: lookup is an object with a "tool" name')
    unknown = sorted(set(entry) - {"tool", "arguments", "found"})
    arguments = entry.get("arguments", {"idempotency_key": "idempotency_key"})
    found = entry.get("found", "structuredContent.found")
    if (
        unknown
        or not isinstance(found, str)
        or not isinstance(arguments, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in arguments.items())
    ):
        raise ConfigurationError(
            f"{where}: lookup takes tool, arguments ({{name: dotted path}}) and found (a dotted path)"
        )
    return LookupTool(entry["tool"], arguments=dict(arguments), found=found)


async def _tools(opener: Callable[[], AbstractAsyncContextManager[ClientSession]]) -> list[dict[str, Any]]:
    async with opener() as session:
        listed = await session.list_tools()
    return [describe(tool) for tool in listed.tools]


def _cmd_tools(args: argparse.Namespace, out: TextIO) -> int:
    rows = asyncio.run(_tools(_opener(args)))
    if args.json:
        print(json.dumps({"tools": rows}, indent=2), file=out)
        return EXIT_OK
    width = max([len(r["name"]) for r in rows] + [4])
    for row in rows:
        hints = ", ".join(f"{k}={str(v).lower()}" for k, v in row["annotations"].items()) or "no annotations"
        print(f"{row['name'].ljust(width)}  {row['mode'].ljust(12)}  {hints}  ({row['reason']})", file=out)
    return EXIT_OK


def _cmd_proxy(args: argparse.Namespace, out: TextIO) -> int:
    opener = _opener(args)
    host, port = None, 0
    if args.http:
        host, _, text = args.http.rpartition(":")
        if not host or not text.isdigit():
            raise ConfigurationError(f"--http {args.http!r}: HOST:PORT")
        port = int(text)
    declare = load_declarations(args.declare) if args.declare is not None else None
    url = getattr(args, "store", None) or os.environ.get(ENV_STORE) or DEFAULT_URL
    guard = Guard(open_store(url), namespace=args.namespace)
    try:
        asyncio.run(proxy_main(opener, guard, args.server, host, port, declare=declare))
    finally:
        guard.close()
        guard.store.close()
    return EXIT_OK


async def proxy_main(
    opener: Callable[[], AbstractAsyncContextManager[ClientSession]],
    guard: Guard,
    server: str,
    host: str | None = None,
    port: int = 0,
    *,
    declare: Mapping[str, ToolDeclaration] | None = None,
) -> None:
    """Open the upstream session and serve the proxy (stdio when ``host`` is None, else HTTP).

    The upstream is reopened through ``opener`` when it is gone (the server died), for the next
    call; the first session failing to open is an error (the server does not start).
    """
    async with anyio.create_task_group() as group:
        upstream = _Upstream(opener, group)
        proxy = McpProxy(
            await upstream.open(), guard, server=server, declare=declare, reconnect=upstream.open
        )
        _SDK_LOG.serving = True  # started: the SDK's errors from now on are the operator's to see
        serving: Coroutine[Any, Any, None] = (
            serve_stdio(proxy) if host is None else serve_http(proxy, host, port)
        )
        await serving
        group.cancel_scope.cancel()


class _Upstream:
    """Keeps one upstream session open in a task of its own (an SDK session must be closed by the
    task that opened it; the proxy's requests run in theirs); :meth:`open` closes the current one
    and opens another."""

    def __init__(
        self, opener: Callable[[], AbstractAsyncContextManager[ClientSession]], group: anyio.abc.TaskGroup
    ) -> None:
        self._opener = opener
        self._group = group
        self._stop: anyio.Event | None = None
        self._lock = anyio.Lock()

    async def open(self) -> ToolSession:
        async with self._lock:
            if self._stop is not None:
                self._stop.set()
            ready, stop = anyio.Event(), anyio.Event()
            box: dict[str, Any] = {}

            async def hold() -> None:
                try:
                    async with self._opener() as session:
                        box["session"] = session
                        ready.set()
                        await stop.wait()
                except Exception as exc:
                    box.setdefault("error", exc)
                    ready.set()

            self._group.start_soon(hold)
            await ready.wait()
            if "session" not in box:
                raise box["error"]
            self._stop = stop
            session: ToolSession = box["session"]
            return session


class _OneLine(logging.Handler):
    """The SDK's log records (a server's garbage on stdout, a dropped connection) without the
    traceback the SDK attaches: kept while the server starts (the last one goes into the command's
    one-line error), then printed as one line each once it serves."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.serving = False
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        text = " ".join(record.getMessage().split())[:300]
        if self.serving:
            print(f"{PROG}: mcp: {text}", file=sys.stderr)
        else:
            self.last = text


_SDK_LOG = _OneLine()


def _quiet_sdk_logs() -> None:
    sdk = logging.getLogger("mcp")
    _SDK_LOG.serving, _SDK_LOG.last = False, None
    if _SDK_LOG not in sdk.handlers:
        sdk.addHandler(_SDK_LOG)
        sdk.propagate = False


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def one_line(exc: BaseException) -> str:
    """An error as the one line ``sagaguard mcp`` prints (the first cause inside task groups)."""
    leaves = [leaf for leaf in _leaves(exc) if not isinstance(leaf, asyncio.CancelledError)]
    first = leaves[0] if leaves else exc
    if isinstance(first, MCPError) and first.code == types.CONNECTION_CLOSED:
        said = f"; {_SDK_LOG.last}" if _SDK_LOG.last else ""
        return f"the MCP server closed the connection (did it start? run its command alone to see why{said})"
    if isinstance(first, FileNotFoundError):
        return f"cannot start the MCP server: {first.strerror or first}: {first.filename or ''}".rstrip(": ")
    text = " ".join(str(first).split()) or type(first).__name__
    return f"the MCP server failed: {type(first).__name__}: {text[:300]}"


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the ``mcp`` command that ``args`` (parsed with :func:`add_commands`) names."""
    command: Callable[[argparse.Namespace, TextIO], int] | None = getattr(args, "mcp_command", None)
    if command is None:
        parser = getattr(args, "mcp_parser", None)
        if parser is not None:
            parser.print_help(sys.stderr)
        return EXIT_USAGE
    _quiet_sdk_logs()
    try:
        return command(args, out or sys.stdout)
    except ConfigurationError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (IdempotencyError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (MCPError, Exception, BaseExceptionGroup) as exc:
        print(f"{PROG}: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
