"""The proxy's agent runs: one per client connection, when its declarations name undos.

A tool declared with an undo (``sagaguard mcp proxy --declare FILE``, :class:`DeclaredUndo`) makes
the proxy an agent saga's driver: each client connection (the stdio client; an HTTP client's
``mcp-session-id``; a stateless HTTP request alone) is a run of the one agent saga type
``mcp-proxy.{server}`` (:func:`proxy_saga`), opened at the connection's first call of such a
tool, its id printed on stderr and listed by ``sagaguard sagas list``. Each call of such a tool
is a step of that run, registered with its undo in one journal commit before the request leaves
(:meth:`GuardedSession.call_tool <sagaguard.connectors.mcp.session.GuardedSession.call_tool>` with
``run=``: the agents' own path). Calls of the other tools are not part of any run.

How a run ends:

- the client disconnects cleanly (the proxy's stdio input closes; an HTTP client's ``DELETE`` of
  its session, or its session idle past ``--session-idle``, which the proxy then ends:
  :func:`~sagaguard.connectors.mcp.proxy.serve_http`; the proxy stops cleanly; a stateless HTTP
  request answered): COMPLETED, nothing
  undone, unless an operator's cancel came first (while a call was in flight, or since the last
  sweep): the end of the connection looks, and the run is undone as below, never completed with
  the cancel ignored;
- an operator cancels it (``sagaguard sagas cancel RUN``, the console,
  :func:`~sagaguard.saga.operator.cancel_saga`): the live proxy sees it at its next sweep, or
  at the connection's next call of a declared tool (refused, not sent), and undoes the run's
  calls in reverse order; later calls of declared tools on that connection are refused (not
  sent): what the operator stopped does not go on;
- a declared tool's call fails (``isError``, a dead server): as any agent run's step, the run
  fails, and the proxy ends it at once, parked NEEDS_ATTENTION (``on_failure="leave"``): nothing is
  undone without an operator (``sagaguard sagas retry RUN`` undoes it). The client may go on (a
  declined card is an answer its model reads): the connection's next call of a declared tool opens
  a new run;
- the proxy dies (SIGKILL, a crash): the run keeps its rows; a worker parks it WAITING once its
  lease runs out (at once on the proxy's host), where it waits for an operator: the type has no
  ``abandon_after``, since no process ever resumes a proxy's connection, and undoing what a client
  did because nobody looked would be a guess. ``sagaguard sagas cancel RUN`` then makes the worker
  undo it: the worker inside every proxy with undos (:class:`ProxyRuns`), or ``sagaguard mcp
  worker`` when no proxy is up.

**A client key across connections.** A call's idempotency key (``_meta``) names one call: the
first run that used it binds it (a guarded record, ``mcp.proxy.run``, written before the step), and
the same key sent on another connection is refused (``INVALID_PARAMS``, not sent) rather than made
again in a second run: its call and its undo belong to the first run (``sagaguard sagas show``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.connectors.mcp.session import SessionFactory
from sagaguard.connectors.mcp.undo import McpServers, McpUndos, UndoTool
from sagaguard.idempotency.effect import Policy
from sagaguard.idempotency.guard import Guard
from sagaguard.saga.agent import AgentRun, AgentRunCancelled, AgentRunner, AgentSaga, OnFailure, UndoRegistry
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.recovery import RecoveryWorker

__all__ = ["Declared", "DeclaredUndo", "ProxyRuns", "proxy_saga", "saga_name"]

log = logging.getLogger(__name__)

BIND_EFFECT = "mcp.proxy.run"
"""The guarded record that binds a client's idempotency key to the run that first used it."""


@dataclass(frozen=True)
class DeclaredUndo:
    """A tool declared with an undo (in a ``--declare`` file): the undo, and the tool's
    :func:`~sagaguard.connectors.declare.changes_world` options.

    Attributes:
        undo: the undo tool, on the same server.
        options: the tool's other options (``lookup``, ``failed_if``, ...).
    """

    undo: UndoTool
    options: Mapping[str, Any] = field(default_factory=dict)


Declared = ToolDeclaration | DeclaredUndo
"""A tool's entry in the proxy's declarations."""


def saga_name(server: str) -> str:
    """The agent saga type of the proxy's runs in front of ``server``."""
    return f"mcp-proxy.{server}"


def proxy_saga(
    server: str, opener: SessionFactory, declared: Mapping[str, Declared]
) -> tuple[dict[str, ToolDeclaration], AgentSaga | None]:
    """The session's declarations and the agent saga type of the proxy's runs (None when nothing
    declares an undo). The proxy and ``sagaguard mcp worker`` both build them here, so the worker
    finds every undo a proxy's run records, and opens the undo's session with ``opener``.

    Raises:
        ConfigurationError, DefinitionError: a malformed server or tool name.
    """
    undos = UndoRegistry()
    servers = McpServers()
    servers.register(server, opener)
    mcp_undos = McpUndos(undos, servers)
    declare: dict[str, ToolDeclaration] = {}
    for name, entry in declared.items():
        if isinstance(entry, DeclaredUndo):
            declare[name] = mcp_undos.undo(server, name, entry.undo, **entry.options)
        else:
            declare[name] = entry
    if not any(isinstance(entry, DeclaredUndo) for entry in declared.values()):
        return declare, None
    # on_failure="leave": a tool's failure parks the run for an operator, never undoes a client's
    # other calls on its own (see the module docstring).
    return declare, AgentSaga(saga_name(server), undos, on_failure=OnFailure.LEAVE)


def _stderr(line: str) -> None:
    print(f"sagaguard: mcp proxy: {line}", file=sys.stderr, flush=True)


@dataclass
class _Held:
    """One connection's run, held open by a task of its own (a run is left by the task that
    entered it)."""

    run_id: str
    stop: anyio.Event = field(default_factory=anyio.Event)
    ended: anyio.Event = field(default_factory=anyio.Event)
    run: AgentRun | None = None
    cancelled: bool = False
    error: BaseException | None = None
    calls: int = 0
    """Calls of the connection in flight: the run ends once they are done (see :meth:`ProxyRuns.calling`)."""
    idle: anyio.Event = field(default_factory=anyio.Event)


class ProxyRuns:
    """The proxy's runs, one per client connection, and the recovery worker of their saga type.

    Args:
        journal: where the runs are recorded (the proxy's store).
        guard: the proxy's guard (its calls, the undos).
        agent: the saga type (:func:`proxy_saga`).
        lease: seconds a run's lease lasts: the connections' runs (renewed while the proxy lives)
            and those its worker takes over to undo.
        interval: seconds between the sweeps that look for cancelled runs and run the worker.
        say: where a run's id and end are told (default: stderr).
    """

    def __init__(
        self,
        journal: SagaJournal,
        guard: Guard,
        agent: AgentSaga,
        *,
        lease: float = 30.0,
        interval: float = 5.0,
        say: Callable[[str], None] = _stderr,
    ) -> None:
        self.journal = journal
        self.guard = guard
        self.agent = agent
        self.interval = interval
        self.runner = AgentRunner(journal, guard, lease=lease)
        self.worker = RecoveryWorker(journal, guard, agent, interval=interval, lease=lease)
        self._say = say
        self._held: dict[str, _Held] = {}
        self._lock = anyio.Lock()
        self._group: anyio.abc.TaskGroup | None = None

    async def serve(self, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body`` (the proxy serving) with the runs' tasks and the sweeps alongside. When it
        returns, the open runs complete; when it raises or is cancelled, they are left as a
        crash leaves them (the worker parks them for an operator)."""
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                group.start_soon(self._sweeps)
                await body()
                for held in list(self._held.values()):
                    held.stop.set()
                    await held.ended.wait()
                group.cancel_scope.cancel()
        finally:
            self.runner.close()
            self.worker.runner.close()

    async def run_for(self, connection: str) -> AgentRun:
        """The run of ``connection``, opened (and its id told) at its first call.

        Raises:
            Exception: the journal could not open it.
        """
        async with self._lock:
            held = self._held.get(connection)
            if held is None:
                assert self._group is not None, "ProxyRuns.serve is not running"
                held = _Held(f"{self.agent.name}.{uuid.uuid4().hex[:16]}")
                ready = anyio.Event()
                self._group.start_soon(self._hold, held, ready)
                await ready.wait()
                if held.run is None:
                    raise held.error or RuntimeError("the connection's run did not open")
                self._held[connection] = held
                self._say(
                    f"connection {connection}: agent run {held.run_id} "
                    f"(undo its calls: sagaguard sagas cancel {held.run_id})"
                )
        assert held.run is not None
        return held.run

    @contextlib.asynccontextmanager
    async def calling(self, connection: str) -> AsyncIterator[AgentRun]:
        """The run of ``connection`` (:meth:`run_for`) for one call: the run does not end (completed
        or undone) while the call is in flight, so a call the server is applying is recorded on
        its row before an undo reads it, never undone before it happened."""
        run = await self.run_for(connection)
        held = self._held[connection]
        if held.calls == 0:
            held.idle = anyio.Event()
        held.calls += 1
        try:
            yield run
        finally:
            held.calls -= 1
            if held.calls == 0:
                held.idle.set()

    async def close(self, connection: str) -> None:
        """End ``connection``'s run, if it has one, as a clean disconnect does: completed, or, when
        one of its calls failed, parked for an operator (its next call opens a new run), or undone
        when an operator cancelled it meanwhile."""
        async with self._lock:
            held = self._held.pop(connection, None)
        if held is not None:
            held.stop.set()
            await held.ended.wait()

    async def cancelled(self, connection: str) -> None:
        """``connection``'s run was found cancelled: undo it now (in its own task)."""
        held = self._held.get(connection)
        if held is not None and not held.stop.is_set():
            held.cancelled = True
            held.stop.set()

    async def bind(self, key: str, run: AgentRun, tool: str, arguments: Mapping[str, Any]) -> str:
        """The run that the client's call ``key`` belongs to: ``run`` the first time (recorded
        before anything is sent, so a crash before the step leaves nothing to bind), else the
        run that used it first.

        Raises:
            KeyConflict: the key was used with another tool or other arguments.
        """

        async def first() -> str:
            return run.run_id

        bound: str = await self.guard.arun(
            BIND_EFFECT, first, key=key, arguments={"tool": tool, "arguments": dict(arguments)},
            result_type=str, policy=Policy.AT_LEAST_ONCE,
        )  # fmt: skip
        return bound

    async def _hold(self, held: _Held, ready: anyio.Event) -> None:
        try:
            async with self.runner.run(self.agent, held.run_id) as run:
                held.run = run
                ready.set()
                await held.stop.wait()
                while held.calls:  # the calls in flight end first (calling())
                    await held.idle.wait()
                if held.cancelled:
                    raise AgentRunCancelled(held.run_id)  # leaving with it undoes the run's calls
                # An operator's cancel the sweeps have not seen yet (it came while a call was in
                # flight, or since the last sweep) still wins over the connection's end: leaving
                # the block completes the run unless a cancel is pending, which the journal
                # checks in the completion's own commit (Phase.unless_cancelled), and the run is
                # undone instead.
            self._say(f"agent run {held.run_id}: {run.outcome.state.value if run.outcome else 'left'}")
        except AgentRunCancelled:
            state = held.run.outcome.state.value if held.run and held.run.outcome else "cancelled"
            self._say(f"agent run {held.run_id} cancelled: {state}")
        except Exception as exc:  # the run ended failed (parked), or the journal failed
            held.error = exc
            self._say(
                f"agent run {held.run_id} ended: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            )
        finally:
            ready.set()
            held.ended.set()

    async def _sweeps(self) -> None:
        while True:
            await self.sweep()
            await anyio.sleep(self.interval)

    async def sweep(self) -> None:
        """Look for the open runs an operator cancelled (and undo them), then run one sweep of the
        worker (cancelled or abandoned runs of dead proxies, parked ones). A failure is logged and
        the next sweep tries again."""
        try:
            for connection, held in list(self._held.items()):
                if held.stop.is_set():
                    continue
                snapshot = await anyio.to_thread.run_sync(self.journal.load, held.run_id)
                if snapshot is not None and snapshot.saga.cancel_requested:
                    await self.cancelled(connection)
            await anyio.to_thread.run_sync(self.worker.run_once)
        except Exception as exc:
            log.warning("mcp proxy sweep failed, will retry: %s", exc)
