"""Running an agent under its saga: :class:`AgentRunner` opens an :class:`AgentRun` per run id.

::

    runner = AgentRunner(journal, guard)
    with runner.run(trip_agent, thread_id) as run:         # the framework's durable run identity
        graph.invoke(...)                                  # tools call run.call(...)
    # returned: the saga is COMPLETED; raised: the run's tool calls were undone in reverse

A compensatable call is registered before its body runs: one commit appends its row (STARTED, its
undo's name, its arguments, its effect key), then the call is claimed and run under the guard, then
its result is recorded on the row. See :mod:`saga.agent.definition` for why a crash between the
commit and the claim is safe, and for what the worker does with a run whose process is gone.

While the run is open its lease is renewed (a :class:`~saga.renewer.LeaseRenewer`); a process that
dies stops renewing, and once the lease runs out the worker parks the run WAITING for the agent.
Opening the same run id again (a resumed process) attaches to it, taking it back from the worker if
it was parked; the framework runs one process per run id at a time, as its checkpointer assumes.
Where two processes may hold one run at once (durable-execution engines), each opens it with
``exclusive=True``: opening a run whose lease another open run holds is then refused
(:class:`~saga.errors.SagaInProgress`), so one place at a time appends the run's rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

from opentelemetry import trace

from idempotency.codec import encode_error
from idempotency.errors import ConfigurationError
from idempotency.guard import Guard
from idempotency.keys import fingerprint
from idempotency.telemetry import tracing
from saga.agent.call import RUN_PREFIX, ToolCall, run_step_name, tool_step_name
from saga.agent.definition import AgentSaga, OnFailure, RunInput, resume_signal
from saga.agent.errors import AgentRunCancelled, AgentRunEnded, AgentRunRejected, UnknownUndo
from saga.decisions import pivot_started
from saga.errors import DefinitionMismatch, SagaCancelled, SagaConflict, SagaInProgress, SagaNotFound
from saga.journal import SagaJournal
from saga.records import (
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
from saga.renewer import LeaseRenewer
from saga.runner import SagaRunner
from saga.telemetry import traceparent, tracer

__all__ = ["AgentRun", "AgentRunner", "current_run"]

T = TypeVar("T")

_TAKE_BACK = 8
"""Times an opening process tries to take a parked run back before :class:`SagaInProgress` (the
worker may claim it between the resume signal and our claim; it then parks it again at once)."""

_current: contextvars.ContextVar[AgentRun | None] = contextvars.ContextVar("sagaguard_agent_run")


def current_run() -> AgentRun:
    """The agent run open in this context (tools and framework adapters call it).

    Raises:
        LookupError: no run is open.
    """
    run = _current.get(None)
    if run is None:
        raise LookupError("no agent run is open here: wrap the agent in `with runner.run(agent, run_id)`")
    return run


class AgentRunner:
    """Opens agent runs against a journal, with their tool calls guarded by ``guard``.

    Args:
        journal: where the runs' sagas are recorded (the worker sweeps the same one).
        guard: runs the tool calls and the undos once each; the worker needs a guard on the same
            store and namespace, since an undo reads the ledger for its call's record.
        lease: seconds a run's lease lasts; renewed while the run is open, so a dead process's run
            is found by the worker about this long after it died.
        sleep: the sleep between undo retries (inject one in tests).
    """

    def __init__(
        self,
        journal: SagaJournal,
        guard: Guard,
        *,
        lease: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if lease <= 0:
            raise ConfigurationError("lease must be > 0")
        self.journal = journal
        self.guard = guard
        self.lease = lease
        self._sleep = sleep
        self.renewer = LeaseRenewer(journal, lease)

    def run(self, agent: AgentSaga, run_id: str, *, exclusive: bool = False) -> AgentRun:
        """The run ``run_id`` of ``agent``, to open with ``with`` (see :class:`AgentRun`).

        Args:
            agent: the run's saga type.
            run_id: the framework's durable run identity.
            exclusive: refuse to open a run whose lease another open run holds
                (:class:`~saga.errors.SagaInProgress`, nothing written) instead of attaching to
                it as to this process's own run resumed before its lease ran out. For engines
                that may run two processes for one run at once (Temporal activities of one
                workflow on two workers, DBOS steps): each opens the run exclusively, so only
                one appends rows at a time; a dead holder's run is taken over once its lease
                runs out.
        """
        if not run_id:
            raise ConfigurationError("an agent run id must not be empty")
        return AgentRun(self, agent.freeze(), run_id, exclusive=exclusive)

    def reject(self, agent: AgentSaga, run_id: str, reason: str = "rejected") -> SagaOutcome:
        """A human rejected the run at an approval: undo its tool calls now (see
        :meth:`AgentRun.reject`), from any process."""
        with self.run(agent, run_id) as run:
            return run.reject(reason)

    def compensator(self) -> SagaRunner:
        """A saga runner that drives one compensation in this process (closed by the caller)."""
        return SagaRunner(self.journal, self.guard, lease=self.lease, max_recoveries=None, sleep=self._sleep)

    def close(self) -> None:
        """Stop the lease renewer's thread."""
        self.renewer.close()


class AgentRun:
    """One agent run's saga, open in this process. Use it as a context manager.

    - Leaving the block normally completes the run (saga COMPLETED, effects kept), unless
      :meth:`pause` was called (a human must approve first).
    - An exception escaping the block: with ``on_failure="compensate"`` (default) the run's tool
      calls are undone now, in reverse journal order; with ``"leave"`` the run is parked
      NEEDS_ATTENTION. The exception propagates either way.
    - :class:`~saga.agent.errors.AgentRunCancelled` (the run was cancelled from outside) is raised
      at the next tool call, and leaving the block then compensates.
    - Any other BaseException (KeyboardInterrupt, a test's simulated crash) leaves the saga as a
      crash would: the worker finds it when its lease runs out.
    """

    def __init__(
        self, runner: AgentRunner, agent: AgentSaga, run_id: str, *, exclusive: bool = False
    ) -> None:
        self.runner = runner
        self.agent = agent
        self.run_id = run_id
        self.exclusive = exclusive
        """Opening refuses a run another open run holds (see :meth:`AgentRunner.run`)."""
        self._input: RunInput = {"run": run_id}
        self._fingerprint = fingerprint({"input": self._input})
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
        self.outcome: SagaOutcome | None = None
        """Where the run's saga ended, once this process ended it (completed, compensated, ...)."""

    # -- opening -----------------------------------------------------------------------------

    def __enter__(self) -> AgentRun:
        self._attach()
        self._hold = self.runner.renewer.enter(self.run_id, self._token)
        self._reset = _current.set(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._release()
        if self.outcome is not None:
            return
        if exc is None:
            if self._paused:
                self._park()
            else:
                self._end(Phase(state=SagaState.COMPLETED, lease=0.0))
        else:
            # The run's own exception propagates; a run that has meanwhile ended (completed or
            # compensated elsewhere) is left as it is.
            with contextlib.suppress(AgentRunEnded):
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, AgentRunCancelled):
            record = self._load().saga
            self._compensate(record.error or encode_error(SagaCancelled()))
        elif isinstance(exc, Exception):
            if self.agent.on_failure is OnFailure.LEAVE:
                if self._load().saga.state is not SagaState.RUNNING:
                    raise AgentRunEnded(self.run_id, "no longer running")
                self._fail(encode_error(exc), SagaState.NEEDS_ATTENTION)
            else:
                self._compensate(encode_error(exc))

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
        options: Mapping[str, Any] | None = None,
    ) -> T:
        """Make one tool call of the run.

        - ``undo=`` (compensatable): one commit registers the call and its undo, then the call runs
          under the guard (once per key), then its result is recorded on its row.
        - ``pivot=True``: registered the same way, with nothing to undo; once it ran, a failure
          undoes only the calls after it and a cancellation is refused.
        - neither (nothing to undo: a read, a model call): ``fn()`` runs as is, not journaled.

        Args:
            tool: the tool's name.
            fn: the call with its arguments bound.
            arguments: the recorded arguments (JSON-storable), given to the undo and fingerprinted.
            undo: the name of an undo registered in the saga's :class:`~saga.agent.undo.UndoRegistry`.
            pivot: the call is the run's go/no-go point.
            call_id: the framework's stable id of the call (LangGraph's ``tool_call_id``); None
                counts calls of ``tool`` in this process (sequential agents only).
            result_type: the type the result is stored as.
            record: what the step records of the result for the undo (default: the result itself);
                a framework adapter passes the tool's own output rather than its message.
            options: other :meth:`~idempotency.guard.Guard.run` options for the call's effect
                (``policy=``, ``reconciler=``, ... as a tool's declaration gives them).

        Raises:
            AgentRunCancelled: the run was cancelled; nothing ran.
            AgentRunEnded: the run's saga no longer takes calls.
            UnknownUndo: ``undo`` is not registered. ConfigurationError: both ``undo`` and ``pivot``.
            and whatever the guard raises (see :meth:`idempotency.guard.Guard.run`).
        """
        if undo is None and not pivot:
            return fn()
        if undo is not None and pivot:
            raise ConfigurationError(f"tool {tool!r}: a pivot has nothing to undo (pass undo= or pivot=)")
        if undo is not None and undo not in self.agent.undos:
            raise UnknownUndo(self.run_id, undo)
        if call_id is None:
            with self._lock:
                call_id = f"{tool}#{next(self._ordinals.setdefault(tool, itertools.count()))}"
        call = ToolCall.of(tool, f"{self.run_id}/{call_id}", arguments)
        kind = StepKind.PIVOT if pivot else StepKind.COMPENSATABLE
        row, span = self._register(call, kind, undo)
        with contextlib.ExitStack() as stack:
            if span is not None:
                stack.enter_context(trace.use_span(span, end_on_exit=True))
            value = self.runner.guard.run(
                call.effect, fn, arguments=call.arguments if isinstance(call.arguments, dict) else {},
                key=call.key, result_type=result_type, **(options or {}),
            )  # fmt: skip
        if row.state is not StepState.SUCCEEDED:
            kept = value if record is None else record(value)
            done = row.evolve(state=StepState.SUCCEEDED, result=call.returned(kept).encode())
            with self._lock:
                self._write(Phase(steps=(done,), lease=self.runner.lease))
                self._rows[call.key] = done
        # A call that fails leaves its row STARTED: its undo reads the ledger to learn what happened.
        return value

    def _register(self, call: ToolCall, kind: StepKind, undo: str | None) -> tuple[StepRecord, Any]:
        with self._lock:
            found = self._rows.get(call.key)
            if found is not None:
                return found, None  # registered before a crash or by an earlier attempt
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
                        "sagaguard.step.kind": kind.value,
                        "gen_ai.tool.name": call.tool,
                    },
                )
            row = StepRecord(
                index, name, kind, StepState.STARTED, compensation=undo, result=call.encode(),
                trace=None if span is None else traceparent(span),
            )  # fmt: skip
            record = self._write(Phase(steps=(row,), lease=self.runner.lease))
            self._next += 1
            self._rows[call.key] = row
        if record.cancel_requested and not pivot_started(self._load()):
            # Cancelled meanwhile: this call must not run (its undo will find no claim and skip).
            if span is not None:
                span.end()
            raise AgentRunCancelled(self.run_id)
        return row, span

    def _live(self) -> None:
        record = self._record
        assert record is not None, "the run is not open"
        if self.outcome is not None or record.state is not SagaState.RUNNING:
            raise AgentRunEnded(self.run_id, record.state.value if self.outcome is None else "ended")
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
        abandon = self.agent.abandon_after
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
        NEEDS_ATTENTION); leaving the block afterwards changes nothing."""
        return self._compensate(encode_error(AgentRunRejected(reason)))

    def _end(self, phase: Phase) -> None:
        with self._lock:
            record = self._write(phase)
        self.outcome = SagaOutcome(self.run_id, record.state)

    def _fail(self, cause: str, state: SagaState) -> SagaSnapshot:
        """Record where the run failed (its own row, FAILED) and move its saga to ``state``."""
        with self._lock:
            index = self._next
            name = run_step_name(index)
            row = StepRecord(index, name, StepKind.COMPENSATABLE, StepState.FAILED, error=cause)
            live = state is SagaState.COMPENSATING
            lease = self.runner.lease if live else 0.0
            self._write(Phase(steps=(row,), state=state, error=cause, lease=lease))
            self._next += 1
        snapshot = self._load()
        if not live:
            self.outcome = SagaOutcome(self.run_id, snapshot.saga.state)
        return snapshot

    def _compensate(self, cause: str) -> SagaOutcome:
        self._release()
        snapshot = self._load()
        if snapshot.saga.state is SagaState.RUNNING:
            snapshot = self._fail(cause, SagaState.COMPENSATING)
        elif snapshot.saga.state is not SagaState.COMPENSATING:
            raise AgentRunEnded(self.run_id, snapshot.saga.state.value)
        runner = self.runner.compensator()
        try:
            self.outcome = runner.resume(self.agent.for_run(snapshot, self.runner.guard), snapshot)
        finally:
            runner.close()
        return self.outcome
