"""``sagaguard mcp``: list an MCP server's tools as the guard treats them, and proxy it.

::

    sagaguard mcp tools [--json] -- SERVER COMMAND...        # or --url http://host:port/mcp
    sagaguard mcp proxy [--store URL] [--namespace NS] [--server NAME] [--http HOST:PORT] -- SERVER COMMAND...

``tools`` starts (or connects to) the server, lists its tools with their annotations and the mode
each gets (``pass_through``, ``resend``, ``at_most_once``) and why. ``proxy`` serves the server's
tools to one client over stdio (default) or to many over streamable HTTP (``--http``), each call
guarded as :mod:`sagaguard.connectors.mcp.proxy` says, recorded in ``--store`` (default ``$SAGAGUARD_STORE``).

:func:`add_commands` adds ``mcp`` to the ``sagaguard`` command's sub-parsers (through the
``sagaguard.commands`` entry point); :func:`run` runs it.

Exit status: 0 done; 1 the server or the store failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, TextIO

from mcp import ClientSession, types
from mcp.client.stdio import StdioServerParameters

from sagaguard.connectors.mcp.policy import policy_from_annotations
from sagaguard.connectors.mcp.proxy import McpProxy, serve_http, serve_stdio
from sagaguard.connectors.mcp.session import http_session, stdio_session
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.stores import DEFAULT_URL, open_store

__all__ = ["add_commands", "describe", "run"]

PROG = "sagaguard"
ENV_STORE = "SAGAGUARD_STORE"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_HINTS = ("read_only_hint", "destructive_hint", "idempotent_hint", "open_world_hint")
_WIRE = {"read_only_hint": "readOnly", "destructive_hint": "destructive", "idempotent_hint": "idempotent",
         "open_world_hint": "openWorld"}  # fmt: skip


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
    url = getattr(args, "store", None) or os.environ.get(ENV_STORE) or DEFAULT_URL
    guard = Guard(open_store(url), namespace=args.namespace)
    try:
        asyncio.run(proxy_main(opener, guard, args.server, host, port))
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
) -> None:
    """Open the upstream session and serve the proxy (stdio when ``host`` is None, else HTTP)."""
    async with opener() as upstream:
        proxy = McpProxy(upstream, guard, server=server)
        serving: Coroutine[Any, Any, None] = (
            serve_stdio(proxy) if host is None else serve_http(proxy, host, port)
        )
        await serving


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the ``mcp`` command that ``args`` (parsed with :func:`add_commands`) names."""
    command: Callable[[argparse.Namespace, TextIO], int] | None = getattr(args, "mcp_command", None)
    if command is None:
        parser = getattr(args, "mcp_parser", None)
        if parser is not None:
            parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return command(args, out or sys.stdout)
    except ConfigurationError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (IdempotencyError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_FAILED
