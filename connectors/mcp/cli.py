"""``sagaguard mcp``: list an MCP server's tools as the guard treats them, and proxy it.

::

    sagaguard mcp tools [--json] -- SERVER COMMAND...        # or --url http://host:port/mcp
    sagaguard mcp proxy [--store URL] [--namespace NS] [--server NAME] [--http HOST:PORT]
                        [--session-idle S] [--declare FILE] [--interval S] [--lease S]
                        -- SERVER COMMAND...
    sagaguard mcp worker [--store URL] [--namespace NS] [--server NAME] --declare FILE
                         [--interval S] [--once] -- SERVER COMMAND...

``tools`` starts (or connects to) the server, lists its tools with their annotations and the mode
each gets (``pass_through``, ``resend``, ``at_most_once``) and why. ``proxy`` serves the server's
tools to one client over stdio (default) or to many over streamable HTTP (``--http``; a client's
session that sits idle for ``--session-idle`` seconds, 1800 by default, is ended as its ``DELETE``
would end it: :func:`~sagaguard.connectors.mcp.proxy.serve_http`), each call
guarded as :mod:`sagaguard.connectors.mcp.proxy` says, recorded in ``--store`` (default ``$SAGAGUARD_STORE``).
``--declare FILE`` overrides tools' annotations (:func:`load_declarations`); a tool declared with an
undo makes each client connection an agent run (:mod:`sagaguard.connectors.mcp.proxyruns`), and the
proxy runs the worker of those runs every ``--interval`` seconds and holds each run under a lease of
``--lease`` seconds (renewed while it lives: how long a run of a proxy that died waits before a
worker on another host parks it). ``worker`` runs that worker alone,
for when no proxy is up: a cancelled run is undone (``sagaguard sagas cancel RUN``). When the server dies,
the proxy starts (or reconnects to) it again for the next call; a call it could not send is
answered as not sent, never parked. A server that fails to start is one line on stderr.

The click group :data:`mcp` is registered under the ``sagaguard.commands`` entry point, where the
``sagaguard`` root finds it (with :data:`RESULT_SHAPES`, which ``effects resolve`` checks).

Exit status: 0 done; 1 the server or the store failed; 2 bad usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
from mcp import ClientSession, types
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError

from sagaguard.connectors.declare import changes_world, read_only
from sagaguard.connectors.mcp.policy import ErrorText, LookupTool, policy_from_annotations
from sagaguard.connectors.mcp.proxy import DEFAULT_SESSION_IDLE, McpProxy, serve_http, serve_stdio
from sagaguard.connectors.mcp.proxyruns import Declared, DeclaredUndo, ProxyRuns, proxy_saga
from sagaguard.connectors.mcp.session import ToolSession, http_session, stdio_session
from sagaguard.connectors.mcp.undo import UndoTool
from sagaguard.idempotency.cliopts import (
    PROG,
    CliError,
    Positive,
    echo_json,
    json_option,
    run,
    store_option,
    store_url,
)
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.stores import open_store
from sagaguard.saga.cli import sweep_once
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.journals import open_journal
from sagaguard.saga.recovery import run_worker

__all__ = ["RESULT_SHAPES", "describe", "load_declarations", "mcp", "one_line", "proxy_main"]
# DeclaredUndo is load_declarations' entry of a tool with an undo (connectors.mcp.proxyruns).

F = TypeVar("F", bound=Callable[..., Any])
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


@click.group(no_args_is_help=True)
def mcp() -> None:
    """MCP servers: their tools as guarded, and a guarding proxy."""


def _upstream(f: F) -> F:
    """``--url``, and the server's command line after ``--``."""
    f = click.argument("server_command", nargs=-1, type=click.UNPROCESSED, metavar="-- COMMAND...")(f)
    return click.option("--url", help="a streamable-HTTP server instead of a command")(f)


def _interval_option(f: F) -> F:
    return click.option(
        "--interval", type=Positive(float), default=5.0, metavar="S",
        help="seconds between sweeps for cancelled runs, when undos are declared (5)",
    )(f)  # fmt: skip


def _opener(
    url: str | None, server_command: tuple[str, ...]
) -> Callable[[], AbstractAsyncContextManager[ClientSession]]:
    command = [part for part in server_command if part != "--"]
    if url and command:
        raise ConfigurationError("give the server's command after -- or --url, not both")
    if url:
        return lambda: http_session(url)
    if not command:
        raise ConfigurationError("give the server's command after -- (or --url URL)")
    params = StdioServerParameters(command=command[0], args=command[1:], env=dict(os.environ))
    return lambda: stdio_session(params)


def _run(body: Callable[[], None]) -> None:
    """Run an ``mcp`` command: the SDK's logs quieted, its failures as one line (exit 1)."""
    _quiet_sdk_logs()

    def guarded() -> None:
        try:
            body()
        except (ConfigurationError, IdempotencyError, CliError):
            raise
        except OSError as exc:
            raise CliError(str(exc)) from exc
        except (MCPError, Exception, BaseExceptionGroup) as exc:
            raise CliError(one_line(exc)) from exc

    run(guarded)


@mcp.command()
@json_option
@_upstream
def tools(*, as_json: bool, url: str | None, server_command: tuple[str, ...]) -> None:
    """The server's tools, their annotations and how the guard treats each.

    Lists the server's tools with their annotations and the mode each gets: pass_through
    (readOnlyHint), resend (idempotentHint: re-sent under the same key when in doubt) or
    at_most_once (in doubt: reconciled or parked, never re-sent).
    """

    def body() -> None:
        rows = asyncio.run(_tools(_opener(url, server_command)))
        if as_json:
            echo_json({"tools": rows})
            return
        width = max([len(r["name"]) for r in rows] + [4])
        for row in rows:
            hints = (
                ", ".join(f"{k}={str(v).lower()}" for k, v in row["annotations"].items()) or "no annotations"
            )
            click.echo(f"{row['name'].ljust(width)}  {row['mode'].ljust(12)}  {hints}  ({row['reason']})")

    _run(body)


@mcp.command()
@click.option("--namespace", default="default", help="the tenant of the proxy's records")
@click.option("--server", default="upstream", help="the server's name in effect names")
@click.option("--http", metavar="HOST:PORT", help="serve clients over streamable HTTP (at /mcp)")
@click.option(
    "--session-idle", type=Positive(float), default=DEFAULT_SESSION_IDLE, metavar="S",
    help="with --http: seconds a client's session may sit idle (no request in flight, no open "
    "stream) before the proxy ends it, completing its run as the client's DELETE would (1800)",
)  # fmt: skip
@click.option("--declare", metavar="FILE", type=click.Path(path_type=Path),
              help="per-tool declarations (JSON) that win over the annotations: "
              "mode, lookup, provider_idempotent, on_error, failed_if, undo")  # fmt: skip
@_interval_option
@click.option(
    "--lease", type=Positive(float), default=30.0, metavar="S",
    help="seconds the proxy's hold on its runs lasts, renewed while it lives: how long the run of a "
    "proxy that died waits before a worker on another host parks it (30)",
)  # fmt: skip
@store_option
@_upstream
def proxy(
    *,
    namespace: str,
    server: str,
    http: str | None,
    session_idle: float,
    declare: Path | None,
    interval: float,
    lease: float,
    store: str | None,
    url: str | None,
    server_command: tuple[str, ...],
) -> None:
    """Serve the server's tools, each call guarded.

    Sits between any MCP client and the server. A call whose request _meta carries
    io.sagaguard/idempotency-key is identified by it (a retry gets the recorded result, a crash is
    resolved); one without is at most once per proxy session and request id, never deduplicated
    against another request. When --declare names undos, each client connection is an agent run
    (its id on stderr): `sagaguard sagas cancel RUN` undoes its calls of those tools.
    """

    def body() -> None:
        opener = _opener(url, server_command)
        host, port = None, 0
        if http:
            host, _, text = http.rpartition(":")
            if not host or not text.isdigit():
                raise ConfigurationError(f"--http {http!r}: HOST:PORT")
            port = int(text)
        declared = load_declarations(declare) if declare is not None else None
        url_ = store_url(store)
        guard = Guard(open_store(url_), namespace=namespace)
        journal = _journal(url_, declared)
        try:
            asyncio.run(
                proxy_main(
                    opener, guard, server, host, port, declare=declared, journal=journal, interval=interval,
                    lease=lease, session_idle=session_idle,
                )
            )  # fmt: skip
        finally:
            if journal is not None:
                journal.close()
            guard.close()
            guard.store.close()

    _run(body)


def _journal(url: str, declared: Mapping[str, Declared] | None) -> SagaJournal | None:
    """The saga journal on the proxy's store, when the declarations name undos (else None)."""
    if declared is None or not any(isinstance(entry, DeclaredUndo) for entry in declared.values()):
        return None
    return open_journal(url)


@mcp.command()
@click.option("--namespace", default="default", help="the tenant of the proxy's records")
@click.option("--server", default="upstream", help="the server's name in effect names")
@click.option("--declare", metavar="FILE", type=click.Path(path_type=Path), required=True,
              help="the proxy's declarations (JSON), with its undos")  # fmt: skip
@_interval_option
@click.option("--once", is_flag=True, help="one sweep, print its report, exit")
@store_option
@_upstream
def worker(
    *,
    namespace: str,
    server: str,
    declare: Path,
    interval: float,
    once: bool,
    store: str | None,
    url: str | None,
    server_command: tuple[str, ...],
) -> None:
    """Undo cancelled proxy runs when no proxy is up.

    Runs the recovery worker of `sagaguard mcp proxy`'s agent runs (saga type mcp-proxy.SERVER):
    a run cancelled with `sagaguard sagas cancel RUN` is undone, each undo tool called through the
    server (started, or reached at --url, as the proxy does); a run whose proxy died is parked
    WAITING for an operator. Give it the proxy's --store, --namespace, --server and --declare.
    Until SIGINT/SIGTERM, or one sweep with --once.
    """

    def body() -> None:
        opener = _opener(url, server_command)
        _, agent = proxy_saga(server, opener, load_declarations(declare))
        if agent is None:
            raise ConfigurationError(
                f"--declare {str(declare)!r} declares no undo: the worker has nothing to undo"
            )
        url_ = store_url(store)
        guard = Guard(open_store(url_), namespace=namespace)
        journal = open_journal(url_)
        try:
            if once:
                sweep_once(journal, guard, agent, interval=interval)
                return
            click.echo(f"{PROG}: mcp worker running for {agent.name}; stop with Ctrl-C or SIGTERM", err=True)
            run_worker(journal, guard, agent, interval=interval)
        finally:
            journal.close()
            guard.close()
            guard.store.close()

    _run(body)


_DECLARATION_KEYS = frozenset({"mode", "lookup", "provider_idempotent", "on_error", "failed_if", "undo"})
_UNDO_ROOTS = ("arguments", "result", "idempotency_key")
"""What an undo argument's path starts with: the recorded call (:mod:`sagaguard.connectors.mcp.undo`)."""


def load_declarations(path: Path) -> dict[str, Declared]:
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
    ``failed_if`` (a regular expression: :class:`~sagaguard.connectors.mcp.policy.ErrorText`),
    and ``undo``, a tool of the same server that undoes a call::

        "charge": {"mode": "changes_world",
                   "undo": {"tool": "refund",
                            "arguments": {"payment_intent": "result.structuredContent.id",
                                          "charge_key": "idempotency_key"},
                            "failed_if": "^Error"}}

    :class:`~sagaguard.connectors.mcp.undo.UndoTool`'s fields: ``tool`` (its name), ``arguments``
    (undo argument name to a dotted path into the recorded call: ``arguments.*``, ``result.*``,
    ``idempotency_key``) and ``failed_if``. At least one path must not go through ``result``:
    a crash can lose the result, and the undo must still find the work (pass the key the call
    carried, ``idempotency_key``). A tool with an undo is a step of its client connection's agent
    run (:mod:`sagaguard.connectors.mcp.proxyruns`): the entry becomes a :class:`DeclaredUndo`.

    Raises:
        ConfigurationError: the file cannot be read, is not JSON, or declares anything else
            (an unknown entry, an undo on a ``read_only`` tool, an undo without a tool name, a
            path that is not a string or that starts elsewhere, an undo that only reads the result).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigurationError(f"--declare {str(path)!r}: {exc}") from None
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, dict):
        raise ConfigurationError(f'--declare {str(path)!r}: a JSON object with "tools": {{name: {{...}}}}')
    return {name: _declaration(path, name, entry) for name, entry in tools.items()}


def _declaration(path: Path, name: str, entry: Any) -> Declared:
    where = f"--declare {str(path)!r}, tool {name!r}"
    if not isinstance(entry, dict) or entry.get("mode") not in {"read_only", "changes_world"}:
        raise ConfigurationError(f'{where}: an object with "mode": "read_only" or "changes_world"')
    unknown = sorted(set(entry) - _DECLARATION_KEYS)
    if unknown:
        raise ConfigurationError(f"{where}: unknown entries {unknown}")
    if entry["mode"] == "read_only":
        if "undo" in entry:
            raise ConfigurationError(f"{where}: a read_only tool changes nothing, so has nothing to undo")
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
    if "undo" in entry:
        return DeclaredUndo(_undo(where, entry["undo"]), options)
    return changes_world(**options)


def _undo(where: str, entry: Any) -> UndoTool:
    if not isinstance(entry, dict):
        raise ConfigurationError(f'{where}: undo is an object with a "tool" name')
    unknown = sorted(set(entry) - {"tool", "arguments", "failed_if"})
    if unknown:
        raise ConfigurationError(f"{where}: undo takes tool, arguments and failed_if, not {unknown}")
    tool = entry.get("tool")
    if not isinstance(tool, str) or not tool.strip():
        raise ConfigurationError(f'{where}: undo needs a "tool", the name of the tool that undoes the call')
    arguments = entry.get("arguments", {})
    if not isinstance(arguments, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in arguments.items()
    ):
        raise ConfigurationError(f"{where}: undo arguments are {{name: dotted path}}, both strings")
    roots = {path.split(".", 1)[0] for path in arguments.values()}
    if not roots <= set(_UNDO_ROOTS):
        raise ConfigurationError(
            f"{where}: an undo argument's path starts with one of {list(_UNDO_ROOTS)}, "
            f"not {sorted(roots - set(_UNDO_ROOTS))}"
        )
    if not roots - {"result"}:
        raise ConfigurationError(
            f"{where}: the undo reads only the result, which a crash can lose: pass the call's key "
            '("charge_key": "idempotency_key") or its arguments too'
        )
    failed_if = None
    if "failed_if" in entry:
        if not isinstance(entry["failed_if"], str):
            raise ConfigurationError(f"{where}: undo failed_if is a regular expression")
        try:
            failed_if = ErrorText(entry["failed_if"])
        except ConfigurationError as exc:
            raise ConfigurationError(f"{where}: undo {exc}") from None
    return UndoTool(tool, arguments=dict(arguments), failed_if=failed_if)


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


async def proxy_main(
    opener: Callable[[], AbstractAsyncContextManager[ClientSession]],
    guard: Guard,
    server: str,
    host: str | None = None,
    port: int = 0,
    *,
    declare: Mapping[str, Declared] | None = None,
    journal: SagaJournal | None = None,
    interval: float = 5.0,
    lease: float = 30.0,
    session_idle: float = DEFAULT_SESSION_IDLE,
) -> None:
    """Open the upstream session and serve the proxy (stdio when ``host`` is None, else HTTP, where a
    client's session idle for ``session_idle`` seconds is ended: :func:`serve_http`).

    The upstream is reopened through ``opener`` when it is gone (the server died), for the next
    call; the first session failing to open is an error (the server does not start). When
    ``declare`` names undos, each client connection is an agent run in ``journal``, and the
    proxy runs the worker of their saga type every ``interval`` seconds and holds each run under a
    lease of ``lease`` seconds (:mod:`sagaguard.connectors.mcp.proxyruns`).

    Raises:
        ConfigurationError: ``declare`` names undos and no ``journal`` is given.
    """
    declared, agent = proxy_saga(server, opener, declare or {})
    runs: ProxyRuns | None = None
    if agent is not None:
        if journal is None:
            raise ConfigurationError("the declarations name undos: the proxy needs a saga journal")
        runs = ProxyRuns(journal, guard, agent, lease=lease, interval=interval)
    async with anyio.create_task_group() as group:
        upstream = _Upstream(opener, group)
        proxy = McpProxy(
            await upstream.open(), guard, server=server, declare=declared, reconnect=upstream.open, runs=runs
        )
        _SDK_LOG.serving = True  # started: the SDK's errors from now on are the operator's to see

        async def serving() -> None:
            if host is None:
                await serve_stdio(proxy)
            else:
                await serve_http(proxy, host, port, session_idle=session_idle)

        if runs is None:
            await serving()
        else:
            await runs.serve(serving)  # a clean end completes the connections' runs
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
