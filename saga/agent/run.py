"""One agent run's saga, open in this process: :class:`AgentRun`, opened by
:meth:`AgentRunner.run <sagaguard.saga.agent.runner.AgentRunner.run>` with ``with`` or ``async with``.

A compensatable call is registered before its body runs: one commit appends its row (STARTED, its
undo's name, its arguments, its effect key), then the call is claimed and run under the guard, then
its result is recorded on the row. See :mod:`sagaguard.saga.agent.definition` for why a crash between the
commit and the claim is safe, and for what the worker does with a run whose process is gone.

**Decide once, drive twice.** What a call is (a step or not, its key, its kind), what its row
holds, and how leaving the block ends the run are decided by the same methods for both drivers;
:meth:`AgentRun.call` and :meth:`AgentRun.acall` differ only in how they run the call (``Guard.run``
or ``Guard.arun``) and in where the journal is written: the async driver hands every journal call
(the journals are sync) to a worker thread, so the event loop never waits on a commit, and the
compensation at the end runs there too (undos are sync callables).

While the run is open its lease is renewed (a :class:`~sagaguard.saga.renewer.LeaseRenewer`); a process that
dies stops renewing, and once the lease runs out (at once when it died on the worker's host: its
holder is provably dead, see :mod:`sagaguard.saga.lease`) the worker parks the run WAITING for the agent.
Opening the same run id again (a resumed process) attaches to it, taking it back from the worker if
it was parked, or over from its dead holder (a restart at once on the same host); the framework
runs one process per run id at a time, as its checkpointer assumes.
Where two processes may hold one run at once (durable-execution engines), each opens it with
``exclusive=True``: opening a run whose lease another open run holds is then refused
(:class:`~sagaguard.saga.errors.SagaInProgress`), so one place at a time appends the run's rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import trace

from sagaguard.idempotency.backends.offload import in_thread
from sagaguard.idempotency.checks import seconds
from sagaguard.idempotency.codec import encode_error
from sagaguard.idempotency.effect import Policy
from sagaguard.idempotency.errors import ConfigurationError, OutcomeUnknown
from sagaguard.idempotency.keys import fingerprint
from sagaguard.idempotency.options import RunOptions
from sagaguard.idempotency.telemetry import tracing
from sagaguard.saga.agent.call import RUN_PREFIX, ToolCall, run_step_name, tool_step_name
from sagaguard.saga.agent.definition import (
    ABANDON_KEY,
    AgentSaga,
    OnFailure,
    RunInput,
    resume_signal,
    tool_outcome,
)
from sagaguard.saga.agent.errors import (
    AgentRunCancelled,
    AgentRunEnded,
    AgentRunRejected,
    NoOpenRun,
    UnknownUndo,
)
from sagaguard.saga.decisions import (
    CallOutcome,
    completion_yields_to_cancel,
    pivot_failure,
    pivot_started,
)
from sagaguard.saga.errors import (
    DefinitionMismatch,
    SagaCancelled,
    SagaConflict,
    SagaInProgress,
    SagaNotFound,
)
from sagaguard.saga.records import (
    FOREVER,
    Phase,
    SagaOutcome,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    StartOutcome,
    StepKind,
    StepRecord,
    StepState,
)
from sagaguard.saga.telemetry import traceparent, tracer

if TYPE_CHECKING:
    from sagaguard.saga.agent.runner import AgentRunner

__all__ = ["AgentRun", "current_run"]

T = TypeVar("T")

_TAKE_BACK = 8
"""Times an opening process tries to take a parked run back before :class:`SagaInProgress` (the
worker may claim it between the resume signal and our claim; it then parks it again at once)."""

_current: contextvars.ContextVar[AgentRun | None] = contextvars.ContextVar("sagaguard_agent_run")


def current_run() -> AgentRun:
    """The agent run open in this context (tools and framework adapters call it), with ``with``
    or ``async with`` (the tasks and threads the framework starts inside the block see it too);
    inside the body of a call made through :meth:`AgentRun.call` or :meth:`AgentRun.acall`, that
    call's run, whatever context the adapter made the call from.

    Raises:
        NoOpenRun: no run is open (a ``LookupError``).
    """
    run = _current.get(None)
    if run is None:
        raise NoOpenRun("no agent run is open: wrap the agent in `[async] with runner.run(agent, run_id)`")
    return run


@dataclass(frozen=True, slots=True)
class _Step:
    """A tool call that is a step of the run, as decided before anything runs."""

    call: ToolCall
    kind: StepKind
    undo: str | None

    @property
    def fingerprinted(self) -> dict[str, Any]:
        """What the call's effect fingerprints: its recorded arguments (when they are a mapping)."""
        arguments = self.call.arguments
        return arguments if isinstance(arguments, dict) else {}

    def options(self, given: RunOptions | None) -> RunOptions:
        """The call's effect options: a compensatable call is ``at_least_once`` unless ``given``
        says otherwise (a crash inside it and the resumed run runs it again, so the guarded
        effects inside it replay), a pivot the guard's ``at_most_once``."""
        merged: RunOptions = {}
        if self.kind is StepKind.COMPENSATABLE:
            merged["policy"] = Policy.AT_LEAST_ONCE
        merged.update(given or {})
        return merged


def _in_doubt(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was caused by, an effect left in doubt (``OutcomeUnknown``): a
    framework may wrap the tool's exception (the Agents SDK raises ``UserError`` from it)."""
    seen: set[int] = set()
    found: BaseException | None = exc
    while found is not None and id(found) not in seen:
        if isinstance(found, OutcomeUnknown):
            return True
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return False


def _in_span(span: Any) -> contextlib.AbstractContextManager[Any]:
    """The call's span current while its effect runs (ended after it), when tracing made one."""
    return contextlib.nullcontext() if span is None else trace.use_span(span, end_on_exit=True)


@contextlib.contextmanager
def _as_current(run: AgentRun) -> Iterator[None]:
    """``run`` is :func:`current_run` while a call's body runs, whatever context the adapter runs
    it in: a CrewAI kickoff holds its run outside any ``with`` block, and the MCP proxy serves
    many runs from one task, yet a tool's body (an MCP session's step inside it, an undo helper)
    asks for its run."""
    token = _current.set(run)
    try:
        yield
    finally:
        _current.reset(token)


def _open_pivot(snapshot: SagaSnapshot) -> StepRecord | None:
    """The run's pivot row whose call has not recorded its result (the latest), or None."""
    for row in reversed(snapshot.steps):
        if row.kind is StepKind.PIVOT and row.state is StepState.STARTED:
            return row
    return None


class AgentRun:
    """One agent run's saga, open in this process. Use it as a context manager (``with`` or,
    from async code, ``async with``: the same semantics, the journal written from a worker thread).

    - Leaving the block normally completes the run (saga COMPLETED, effects kept), unless
      :meth:`pause` was called (a human must approve first), or the run was cancelled from outside
      before its pivot meanwhile (during its last tool call, or since): its tool calls are then
      undone, in the same way as at a call (the outcome says COMPENSATED; nothing is raised).
    - An exception escaping the block: with ``on_failure="compensate"`` (default) the run's tool
      calls are undone now, in reverse journal order; with ``"leave"`` the run is parked
      NEEDS_ATTENTION. The exception propagates either way.
    - :class:`~sagaguard.saga.agent.errors.AgentRunCancelled` (the run was cancelled from outside) is raised
      at the next tool call, and leaving the block then compensates.
    - A framework adapter's step call that raised to a framework which went on anyway (a
      message for its model: CrewAI's default, LangGraph's ``handle_tool_errors=True``): no new
      step runs, and leaving the block normally ends the run as that exception would have, then
      raises it (:meth:`fail_on_exit`).
    - Any other BaseException (KeyboardInterrupt, ``asyncio.CancelledError``, a test's simulated
      crash) leaves the saga as a crash would: the worker finds it when its lease runs out. A time
      limit that should undo the run goes inside the block (``asyncio.timeout`` there raises
      ``TimeoutError``, an exception, at the block's end).
    """

    def __init__(
        self,
        runner: AgentRunner,
        agent: AgentSaga,
        run_id: str,
        *,
        exclusive: bool = False,
        abandon_after: float | None = None,
    ) -> None:
        self.runner = runner
        self.agent = agent
        self.run_id = run_id
        self.exclusive = exclusive
        """Opening refuses a run another open run holds (see ``AgentRunner.run(exclusive=True)``)."""
        self._input: RunInput = {"run": run_id}
        # The fingerprint covers the run's identity only: a run started before its adapter
        # declared a deadline (or with another one) still opens.
        self._fingerprint = fingerprint({"input": self._input})
        if abandon_after is not None:
            self._input = {**self._input, ABANDON_KEY: repr(seconds("abandon_after", abandon_after))}
        self._lock = threading.RLock()
        self._token = 0
        self._next = 0
        self._rows: dict[str, StepRecord] = {}
        """Tool rows by effect key: a call made again (a replay after a resume) reuses its row."""
        self._ordinals: dict[str, itertools.count[int]] = {}
        self._record: SagaRecord | None = None
        self._hold: int | None = None
        self._reset: contextvars.Token[AgentRun | None] | None = None
        self._paused = False
        self._ending = False
        """Set (under the lock) once the run is being ended: no more rows are written for calls."""
        self.outcome: SagaOutcome | None = None
        """Where the run's saga ended, once this process ended it (completed, compensated, ...)."""
        self._failure: Exception | None = None
        """The first exception a framework adapter's step raised to its framework
        (:meth:`fail_on_exit`): the run is failing, whatever the framework did with it."""

    # -- opening -----------------------------------------------------------------------------

    def __enter__(self) -> AgentRun:
        self._open()
        self._reset = _current.set(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._release()
        self._close(exc)

    async def __aenter__(self) -> AgentRun:
        await in_thread(self._open)
        self._reset = _current.set(self)  # in the awaiting task's context, not the thread's
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._release()
        if self._closes(exc):
            await in_thread(self._close, exc)

    def _open(self) -> None:
        self._attach()
        if self.outcome is None:  # a completed run re-opened holds no lease
            self._hold = self.runner.renewer.enter(self.run_id, self._token)

    def _closes(self, exc: BaseException | None) -> bool:
        """Whether leaving the block with ``exc`` writes to the journal (a crash leaves it as is)."""
        return self.outcome is None and (exc is None or isinstance(exc, (Exception, AgentRunCancelled)))

    def _close(self, exc: BaseException | None) -> None:
        """End the run as leaving the block with ``exc`` says (see the class docstring).

        Raises:
            Exception: the block returned, but a step's call had failed (a framework turned the
                exception into a message for its model): the run ends as that failure would
                have ended it, then the failure is raised.
        """
        if not self._closes(exc):
            return
        self._stop_calls()
        if exc is None:
            failure = self._failure
            if self._paused:
                self._park()
            elif failure is not None:
                with contextlib.suppress(AgentRunEnded):
                    self._failed(failure)
                raise failure
            else:
                self._complete()
        else:
            # The run's own exception propagates; a run that has meanwhile ended (completed or
            # compensated elsewhere) is left as it is.
            with contextlib.suppress(AgentRunEnded):
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, AgentRunCancelled):
            record = self._load().saga
            self._compensate(record.error or encode_error(SagaCancelled()))
        elif self.agent.on_failure is OnFailure.LEAVE:
            snapshot = self._load()
            if snapshot.saga.state is not SagaState.RUNNING:
                raise AgentRunEnded(self.run_id, "no longer running")
            pivot = _open_pivot(snapshot)
            if pivot is not None and (
                _in_doubt(exc) or pivot_failure(self._outcome(pivot)) is SagaState.NEEDS_ATTENTION
            ):
                # Parked on the pivot, not on a run row: `sagas retry` then goes forward at the
                # pivot rather than compensating a run whose pivot may have happened.
                self._pivot_in_doubt(pivot, encode_error(exc))
            else:
                self._fail(encode_error(exc), SagaState.NEEDS_ATTENTION)
        else:
            self._compensate(encode_error(exc), doubt=_in_doubt(exc))

    def _release(self) -> None:
        if self._hold is not None:
            self.runner.renewer.leave(self._hold)
            self._hold = None
        if self._reset is not None:
            _current.reset(self._reset)
            self._reset = None

    def _attach(self) -> None:
        journal, agent = self.runner.journal, self.agent
        text = agent.input_codec.encode(self._input)
        for _ in range(_TAKE_BACK):
            started = journal.start(
                self.run_id, name=agent.name, version=agent.version, input=text,
                fingerprint=self._fingerprint, lease=self.runner.lease,
            )  # fmt: skip
            snapshot = started.snapshot
            record = snapshot.saga
            if started.outcome is not StartOutcome.EXISTING:
                self._own(snapshot)
                if record.state is SagaState.COMPENSATING:
                    # Taken over in the middle of its compensation (the process undoing it died:
                    # its lease ran out, or, restarted at once on this host, its holder is dead):
                    # the agent must not run forward on a run being undone, so finish it here.
                    outcome = self._compensate("")
                    raise AgentRunEnded(self.run_id, outcome.state.value)
                return
            if (record.name, record.version) != (agent.name, agent.version):
                raise DefinitionMismatch(self.run_id, f"it was started as {record.name!r} v{record.version}")
            if record.fingerprint != self._fingerprint:
                raise SagaConflict(self.run_id, record.fingerprint, self._fingerprint)
            if record.state is SagaState.RUNNING:
                if self.exclusive:
                    # Its lease is live (else the start took it over): another open run holds it,
                    # and sharing its token would let both write rows at the same indexes.
                    raise SagaInProgress(self.run_id)
                self._own(snapshot)  # our own run, resumed before its lease ran out
                return
            if record.state is SagaState.COMPLETED:
                # Exclusive or not: nothing is written and no lease is held, so a replay never
                # competes with another place for the run's rows.
                self._replay(snapshot)
                return
            if record.state is not SagaState.WAITING or record.waiting_for is None:
                raise AgentRunEnded(self.run_id, record.state.value)
            # Parked by the worker: deliver the signal it waits for, then take it back.
            journal.signal(self.run_id, record.waiting_for, "null")
            claimed = journal.claim(self.run_id, lease=self.runner.lease)
            if claimed is not None:
                self._own(claimed)
                self._consume(claimed)
                return
        raise SagaInProgress(self.run_id)

    def _replay(self, snapshot: SagaSnapshot) -> None:
        """Open a COMPLETED run to read it again: nothing is written, no lease is held, its
        recorded calls replay their results through the guard, a new call raises
        :class:`AgentRunEnded` (see :meth:`AgentRunner.run`)."""
        self._own(snapshot)
        self._ending = True  # a call whose row did not record its result writes nothing
        self.outcome = SagaOutcome(self.run_id, SagaState.COMPLETED, replayed=True)

    def _own(self, snapshot: SagaSnapshot) -> None:
        self._token = snapshot.saga.token
        self._record = snapshot.saga
        self._next = len(snapshot.steps)
        self._rows = {}
        for row in snapshot.steps:
            call = ToolCall.of_row(row)
            if call is not None:
                self._rows[call.key] = row

    def _consume(self, snapshot: SagaSnapshot) -> None:
        """Mark the run row the worker parked on as done, so its next park is a new row."""
        for row in snapshot.steps:
            if row.name.startswith(RUN_PREFIX) and row.state is StepState.STARTED:
                self._write(Phase(steps=(row.evolve(state=StepState.SUCCEEDED),), lease=self.runner.lease))

    # -- tool calls --------------------------------------------------------------------------

    def call(
        self,
        tool: str,
        fn: Callable[[], T],
        arguments: Mapping[str, Any],
        *,
        undo: str | None = None,
        pivot: bool = False,
        call_id: str | None = None,
        result_type: Any = Any,
        record: Callable[[T], Any] | None = None,
        options: RunOptions | None = None,
    ) -> T:
        """Make one tool call of the run.

        - ``undo=`` (compensatable): one commit registers the call and its undo, then the call runs
          under the guard (once per key), then its result is recorded on its row. It is
          ``at_least_once`` unless ``options`` say ``policy="at_most_once"``: a call a crash
          interrupted runs again when the run resumes, so ``fn`` must make its changes to the world
          through guarded effects (which replay) or say at most once.
        - ``pivot=True``: registered the same way, with nothing to undo; once it ran, a failure
          undoes only the calls after it and a cancellation is refused.
        - neither (nothing to undo: a read, a model call): ``fn()`` runs as is, not journaled.

        Args:
            tool: the tool's name.
            fn: the call with its arguments bound.
            arguments: the recorded arguments (JSON-storable), given to the undo and fingerprinted.
            undo: the name of an undo registered in the saga's
                :class:`~sagaguard.saga.agent.undo.UndoRegistry`.
            pivot: the call is the run's go/no-go point.
            call_id: the framework's stable id of the call (LangGraph's ``tool_call_id``); None
                counts calls of ``tool`` in this process (sequential agents only).
            result_type: the type the result is stored as.
            record: what the step records of the result for the undo (default: the result itself);
                a framework adapter passes the tool's own output rather than its message.
            options: other :meth:`~sagaguard.idempotency.guard.Guard.run` options for the call's effect
                (``policy=``, ``reconciler=``, ... as a tool's declaration gives them).

        Raises:
            AgentRunCancelled: the run was cancelled; nothing ran.
            AgentRunEnded: the run's saga no longer takes calls, or the run is failing (a
                framework adapter's step failed, see :meth:`fail_on_exit`): nothing ran.
            UnknownUndo: ``undo`` is not registered.
            ConfigurationError: both ``undo`` and ``pivot``; and whatever the guard raises (see
                :meth:`sagaguard.idempotency.guard.Guard.run`).
        """
        step = self._step(tool, arguments, undo, pivot, call_id)
        if step is None:
            with _as_current(self):
                return fn()
        row, span = self._register(step)
        with _in_span(span), _as_current(self):
            value = self.runner.guard.run(
                step.call.effect, fn, arguments=step.fingerprinted, key=step.call.key,
                result_type=result_type, **step.options(options),
            )  # fmt: skip
        if row.state is not StepState.SUCCEEDED:
            self._recorded(row, step.call, value if record is None else record(value))
        return value

    async def acall(
        self,
        tool: str,
        fn: Callable[[], Awaitable[T]],
        arguments: Mapping[str, Any],
        *,
        undo: str | None = None,
        pivot: bool = False,
        call_id: str | None = None,
        result_type: Any = Any,
        record: Callable[[T], Any] | None = None,
        options: RunOptions | None = None,
    ) -> T:
        """The async twin of :meth:`call`, line for line: ``fn`` is awaited under
        :meth:`~sagaguard.idempotency.guard.Guard.arun` (``options`` are its options), and the journal
        commits (the registration before the call, the result after) run in a worker thread.
        It raises what :meth:`call` raises.
        """
        step = self._step(tool, arguments, undo, pivot, call_id)
        if step is None:
            with _as_current(self):
                return await fn()
        row, span = await in_thread(self._register, step)
        with _in_span(span), _as_current(self):
            value = await self.runner.guard.arun(
                step.call.effect, fn, arguments=step.fingerprinted, key=step.call.key,
                result_type=result_type, **step.options(options),
            )  # fmt: skip
        if row.state is not StepState.SUCCEEDED:
            await in_thread(self._recorded, row, step.call, value if record is None else record(value))
        return value

    def fail_on_exit(self, exc: Exception) -> None:
        """A framework adapter's step call raised ``exc`` to its framework, which may go on (turn
        it into a message for its model, which may ask again under a new call id): the run is
        failing. No new step runs in it any more (:class:`AgentRunEnded`), and leaving the block
        ends the run as ``exc`` escaping it would have (compensated, parked NEEDS_ATTENTION, a
        pivot in doubt), then raises ``exc``. The first call wins. A paused run is parked as
        before (an engine retries its step)."""
        with self._lock:
            if self._failure is None:
                self._failure = exc

    def _step(
        self, tool: str, arguments: Mapping[str, Any], undo: str | None, pivot: bool, call_id: str | None
    ) -> _Step | None:
        """What the call is (no I/O): None when it is not a step (nothing to undo), else its key
        (the run id and the call's id), its kind and its undo.

        Raises:
            ConfigurationError, UnknownUndo: as :meth:`call` says.
        """
        if undo is None and not pivot:
            return None
        if undo is not None and pivot:
            raise ConfigurationError(f"tool {tool!r}: a pivot has nothing to undo (pass undo= or pivot=)")
        if undo is not None and undo not in self.agent.undos:
            raise UnknownUndo(self.run_id, undo)
        if call_id is None:
            with self._lock:
                call_id = f"{tool}#{next(self._ordinals.setdefault(tool, itertools.count()))}"
        kind = StepKind.PIVOT if pivot else StepKind.COMPENSATABLE
        return _Step(ToolCall.of(tool, self.call_key(call_id), arguments), kind, undo)

    @property
    def failing(self) -> bool:
        """A declared tool call of this run failed (:meth:`fail_on_exit`): it takes no new step,
        and leaving its block ends it as that failure says."""
        with self._lock:
            return self._failure is not None

    def call_key(self, call_id: str) -> str:
        """The explicit key of the effect of the call ``call_id`` (``{run_id}/{call_id}``); the
        framework adapters also run the tool's body in a scope of that name."""
        return f"{self.run_id}/{call_id}"

    def _recorded(self, row: StepRecord, call: ToolCall, kept: Any) -> None:
        """Record what the call returned (``kept``, what the undo receives) on its row.

        A call that fails never gets here: its row stays STARTED, and its undo reads the ledger to
        learn what happened.
        """
        done = row.evolve(state=StepState.SUCCEEDED, result=call.returned(kept).encode())
        with self._lock:
            if self._ending:
                # A sibling call finishing after the run began to end (an async framework drains
                # its cancelled tool tasks, whose journal writes go on in their threads): the row
                # stays STARTED, and its undo, if it runs, reads the ledger for the call's outcome.
                return
            self._write(Phase(steps=(done,), lease=self.runner.lease))
            self._rows[call.key] = done

    def _register(self, step: _Step) -> tuple[StepRecord, Any]:
        call = step.call
        with self._lock:
            found = self._rows.get(call.key)
            if found is not None:
                return found, None  # registered before a crash or by an earlier attempt
            if self._failure is not None:
                # A step failed and the framework went on (its model asks again, maybe for the same
                # tool under a new id): no new step runs; the run ends failed with the block.
                raise AgentRunEnded(self.run_id, "failing (a declared tool call failed)")
            self._live()
            index = self._next
            name = tool_step_name(call.tool, index)
            span = None
            if tracing():
                span = tracer.start_span(
                    f"saga.step {name}",
                    attributes={
                        "sagaguard.saga.name": self.agent.name,
                        "sagaguard.step.name": name,
                        "sagaguard.step.index": index,
                        "sagaguard.step.kind": step.kind.value,
                        "gen_ai.tool.name": call.tool,
                    },
                )
            row = StepRecord(
                index, name, step.kind, StepState.STARTED, compensation=step.undo, result=call.encode(),
                trace=None if span is None else traceparent(span),
            )  # fmt: skip
            record = self._write(Phase(steps=(row,), lease=self.runner.lease))
            self._next += 1
            self._rows[call.key] = row
            # Cancelled meanwhile (the commit returns a cancel recorded since the look in _live()):
            # this call must not run. Its own row does not count as a started pivot, since it never
            # ran; a pivot's (or a later call's) is written not applied, or its STARTED row would
            # stop the undo of the calls before it. A compensatable call's undo finds no claim and
            # skips.
            cancelled = record.cancel_requested and not pivot_started(self._load(), fresh=index)
            if cancelled and step.kind is not StepKind.COMPENSATABLE:
                row = row.evolve(state=StepState.FAILED, error=record.error, not_applied=True)
                self._write(Phase(steps=(row,), lease=self.runner.lease))
                self._rows[call.key] = row
        if cancelled:
            if span is not None:
                span.end()
            raise AgentRunCancelled(self.run_id)
        return row, span

    def _stop_calls(self) -> None:
        """Wait for a journal write of a call in progress, then refuse the others."""
        with self._lock:
            self._ending = True

    def _live(self) -> None:
        record = self._record
        assert record is not None, "the run is not open"
        if self._ending or self.outcome is not None or record.state is not SagaState.RUNNING:
            raise AgentRunEnded(self.run_id, (self.outcome or record).state.value)
        if record.cancel_requested and not pivot_started(self._load()):
            raise AgentRunCancelled(self.run_id)

    def _write(self, phase: Phase) -> SagaRecord:
        record = self.runner.journal.commit(self.run_id, self._token, phase)
        self._record = record
        return record

    def _load(self) -> SagaSnapshot:
        snapshot = self.runner.journal.load(self.run_id)
        if snapshot is None:
            raise SagaNotFound(self.run_id)
        return snapshot

    # -- ending ------------------------------------------------------------------------------

    def pause(self) -> None:
        """Leave the run open when the block ends (the agent waits for a human at an approval):
        it is not completed but parked WAITING, with no process held, until a process opens it
        again (the approval came), :meth:`AgentRunner.reject` undoes it, it is cancelled, or its
        abandon deadline passes (the worker then undoes it)."""
        self._paused = True

    def _park(self) -> None:
        """Park the paused run WAITING for the process that resumes it, in one commit with its own
        row: a cancellation, or the abandon deadline, wakes it for the worker."""
        abandon = self.agent.abandon_for(self._load().saga.input)
        with self._lock:
            index = self._next
            row = StepRecord(index, run_step_name(index), StepKind.COMPENSATABLE, StepState.STARTED)
            until = 0.0 if abandon is None else self.runner.journal.now() + abandon
            phase = Phase(
                steps=(row,), state=SagaState.WAITING, error=None, waiting_for=resume_signal(index),
                wait_until=until, wake_at=until or FOREVER, wake_on_cancel=not pivot_started(self._load()),
            )  # fmt: skip
            self._write(phase)
            self._next += 1

    def reject(self, reason: str = "rejected") -> SagaOutcome:
        """A human rejected the run: undo its tool calls now, in reverse order. Returns the
        compensation's outcome (COMPENSATED, FAILED when nothing needed undoing, or
        NEEDS_ATTENTION); leaving the block afterwards changes nothing.

        Raises:
            AgentRunEnded: the run has already ended.
        """
        self._release()
        return self._compensate(encode_error(AgentRunRejected(reason)))

    async def areject(self, reason: str = "rejected") -> SagaOutcome:
        """The async twin of :meth:`reject` (the compensation runs in a worker thread)."""
        self._release()  # in the awaiting task: the run is no longer current there
        return await in_thread(self._compensate, encode_error(AgentRunRejected(reason)))

    def _complete(self) -> None:
        """Complete the run, unless a cancellation came first (during its last tool call, or
        since) and is still honoured: the journal then leaves it RUNNING, in the same commit, and
        the run's calls are undone as a cancellation seen at a call would have them.

        The completion asks the journal to yield to a pending cancellation without reading the
        run first (a completed run costs no more than before); only when one is pending is the
        run read, to honour it before the pivot and complete all the same after it."""
        completing = Phase(state=SagaState.COMPLETED, lease=self.runner.lease, unless_cancelled=True)
        with self._lock:
            record = self._write(completing)
        if record.state is SagaState.RUNNING:
            if completion_yields_to_cancel(self._load()):
                self._compensate(record.error or encode_error(SagaCancelled()))
                return
            with self._lock:
                record = self._write(Phase(state=SagaState.COMPLETED, lease=0.0))
        self.outcome = SagaOutcome(self.run_id, record.state)

    def _fail(self, cause: str, state: SagaState, rows: tuple[StepRecord, ...] = ()) -> SagaSnapshot:
        """Record where the run failed (its own row, FAILED, with ``rows``) and move its saga to
        ``state``."""
        with self._lock:
            index = self._next
            name = run_step_name(index)
            row = StepRecord(index, name, StepKind.COMPENSATABLE, StepState.FAILED, error=cause)
            live = state is SagaState.COMPENSATING
            lease = self.runner.lease if live else 0.0
            self._write(Phase(steps=(*rows, row), state=state, error=cause, lease=lease))
            self._next += 1
        snapshot = self._load()
        if not live:
            self.outcome = SagaOutcome(self.run_id, snapshot.saga.state)
        return snapshot

    def _outcome(self, row: StepRecord) -> CallOutcome:
        """What the tool call of ``row`` did, from the ledger (in doubt if unreadable as a call)."""
        return tool_outcome(self.runner.guard, row) or CallOutcome.IN_DOUBT

    def _pivot_in_doubt(self, pivot: StepRecord, cause: str) -> SagaOutcome:
        """Park the run NEEDS_ATTENTION on its pivot, whose call may have applied: the pivot's
        row FAILED (maybe applied) with ``cause``, as a declared saga's pivot that failed so; no
        run row, so ``sagas retry`` puts the run back RUNNING at the pivot (see
        :func:`sagaguard.saga.control.retry`)."""
        failed = pivot.evolve(state=StepState.FAILED, error=cause, not_applied=False)
        with self._lock:
            self._write(Phase(steps=(failed,), state=SagaState.NEEDS_ATTENTION, error=cause, lease=0.0))
        self.outcome = SagaOutcome(self.run_id, SagaState.NEEDS_ATTENTION)
        return self.outcome

    def _compensate(self, cause: str, *, doubt: bool = False) -> SagaOutcome:
        """Undo the run now, in this thread (the caller has released the run's lease hold).

        A pivot whose call has not recorded a result is settled first, from the ledger (see
        :func:`~sagaguard.saga.decisions.pivot_failure`): never applied, it is marked so and the
        calls before it are undone; in doubt, the run needs attention and nothing is undone.
        ``doubt``: the run failed on an effect left in doubt (``OutcomeUnknown``), so an open
        pivot is in doubt whatever its own record says (an effect inside it may be the one).
        """
        self._stop_calls()
        snapshot = self._load()
        if snapshot.saga.state is SagaState.RUNNING:
            pivots: tuple[StepRecord, ...] = ()
            pivot = _open_pivot(snapshot)
            if pivot is not None:
                outcome = self._outcome(pivot)
                if doubt or pivot_failure(outcome) is SagaState.NEEDS_ATTENTION:
                    return self._pivot_in_doubt(pivot, cause)
                if outcome in (CallOutcome.NOT_STARTED, CallOutcome.FAILED):
                    pivots = (pivot.evolve(state=StepState.FAILED, error=cause, not_applied=True),)
            snapshot = self._fail(cause, SagaState.COMPENSATING, pivots)
        elif snapshot.saga.state is not SagaState.COMPENSATING:
            raise AgentRunEnded(self.run_id, snapshot.saga.state.value)
        runner = self.runner.compensator()
        try:
            self.outcome = runner.resume(self.agent.for_run(snapshot, self.runner.guard), snapshot)
        finally:
            runner.close()
        return self.outcome
