"""An agent run's saga: a definition whose steps come from its journal rows.

A declared :class:`~sagaguard.saga.definition.Saga` knows its steps before it runs. An agent's steps are the
tool calls its model chose, appended to the journal as they happen (:mod:`sagaguard.saga.agent.run`). So an
:class:`AgentSaga` is registered like any saga (a :class:`~sagaguard.saga.registry.SagaRegistry` the worker
is given), and :meth:`AgentSaga.for_run` builds, for one claimed instance, the ordinary definition
that :class:`~sagaguard.saga.runner.SagaRunner` and :func:`~sagaguard.saga.recovery.recover` drive:

- one step per row, in journal order. A tool row is compensatable with its undo (found by the name
  the row records in the :class:`~sagaguard.saga.agent.undo.UndoRegistry`) or a pivot; the run's own rows
  (``agent.run.{i}``) have nothing to undo;
- one more step after them: the run itself, which only the agent's process can take forward.

Forward, every step only *waits for the agent*: taken over by the worker (the agent's process is
gone and its lease ran out), the saga parks WAITING for ``agent.resume.{index}`` with no process
held. The agent's process, resumed, delivers that signal and takes the saga back. Past the
definition's ``abandon_after`` without that, the wait fails with
:class:`~sagaguard.saga.agent.errors.AgentRunAbandoned` (*maybe applied*) and the saga compensates. A
cancellation (before the pivot) wakes it and compensates at once. The worker therefore never
completes an agent run and never runs a tool.

Backward, each undo runs through the runner's compensation code: a guarded effect under its own key,
retried with ``compensation_retry``, NEEDS_ATTENTION with the cause when it keeps failing, and
reverse journal order, stopping at a pivot that ran.

**Registered before the call.** A tool row is written STARTED, with its undo, its arguments and its
effect key, in one commit *before* the call is claimed in the effect ledger. A crash between the
two leaves an undo whose call never claimed anything: before an undo runs,
:meth:`AgentStep.never_applied` reads the ledger, and when the call has no record (or a failed one)
the step is marked *not applied* and its undo does not run. So, seen from the world, a crash leaves
either no claim and no undo, or both.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
from typing import Any

import tenacity

from sagaguard.idempotency.codec import Codec, decode_error, encode_error
from sagaguard.idempotency.effect import Retry
from sagaguard.idempotency.errors import CodecError, LostOwnership
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.holder import is_dead_on_this_host
from sagaguard.idempotency.keys import derive_explicit_key
from sagaguard.idempotency.records import Disposition, Record, State
from sagaguard.saga.agent.call import RUN_PREFIX, TOOL_PREFIX, ToolCall, run_step_name
from sagaguard.saga.agent.errors import AgentRunAbandoned, CallUndone, UnknownUndo
from sagaguard.saga.agent.undo import Undo, UndoRegistry, undoing_call
from sagaguard.saga.context import StepContext
from sagaguard.saga.decisions import CallOutcome, call_outcome
from sagaguard.saga.definition import FORWARD_RETRY, Saga, _check_timeout
from sagaguard.saga.errors import DefinitionMismatch, SignalTimeout
from sagaguard.saga.records import CompensationPolicy, SagaSnapshot, StepKind, StepRecord, StepState
from sagaguard.saga.step import Step

__all__ = [
    "AgentSaga",
    "AgentStep",
    "OnFailure",
    "resume_signal",
    "settle_undone",
    "tool_outcome",
    "tool_outcomes",
]

RunInput = dict[str, str]
"""An agent run's saga input: ``{"run": run_id}``, and the run's own abandon deadline in seconds
(:data:`ABANDON_KEY`) when it was opened with one."""

ABANDON_KEY = "abandon_after"
"""The input key of a run's own abandon deadline (``AgentRunner.run(abandon_after=...)``)."""

_ANY: Codec[Any] = Codec(Any)
_ONCE = Retry(stop=tenacity.stop_after_attempt(1))


class OnFailure(enum.StrEnum):
    """What an exception escaping an agent run does (``on_failure=``)."""

    COMPENSATE = "compensate"
    """Undo the run's tool calls in reverse order, at once, in the agent's process."""
    LEAVE = "leave"
    """Park the run NEEDS_ATTENTION with the error; ``sagaguard sagas retry RUN`` compensates it."""


def resume_signal(index: int) -> str:
    """The signal the saga waits for when the worker parks it at step ``index``."""
    return f"agent.resume.{index}"


def tool_outcome(guard: Guard, row: StepRecord) -> CallOutcome | None:
    """The real outcome of the tool call an agent row records, read from ``guard``'s ledger (see
    :func:`~sagaguard.saga.decisions.call_outcome`); None for a row that is not a tool call's.

    Raises:
        StoreError: the ledger could not be read.
    """
    call = ToolCall.of_row(row)
    if call is None:
        return None
    record = guard.store.get(derive_explicit_key(guard.namespace, call.key, call.effect))
    if record is None:
        return call_outcome(row, None)
    # A record settled by the call's undo (CallUndone) was in doubt: that is what the call did.
    state = State.IN_DOUBT if _settled_by_undo(record) else record.state
    return call_outcome(row, state, lease_live=record.lease_live(guard.store.now()))


def _settled_by_undo(record: Record) -> bool:
    """Whether ``record`` was settled by :func:`settle_undone` (FAILED with CallUndone)."""
    if record.state is not State.FAILED or record.error is None:
        return False
    try:
        return decode_error(record.error).type_name.rsplit(".", 1)[-1] == CallUndone.__name__
    except CodecError:
        return False


def settle_undone(guard: Guard, saga_id: str, step: str, call: ToolCall) -> None:
    """Settle the ledger record of ``call``, which its undo has just undone, when it is in doubt
    or left in progress by a process whose lease ran out or that died on this host: FAILED with
    :class:`~sagaguard.saga.agent.errors.CallUndone`, so it stops counting as in doubt (``sagaguard
    effects list``) and a call made again under its key replays that error instead of running.
    A record that is finished, or held under a live lease by a holder not known dead, is left as it
    is; one that changes meanwhile (another process settles it) too.

    Raises:
        StoreError: the ledger could not be reached.
    """
    store = guard.store
    key = derive_explicit_key(guard.namespace, call.key, call.effect)
    record = store.get(key)
    if record is None or record.state not in (State.IN_PROGRESS, State.IN_DOUBT):
        return
    live = record.lease_live(store.now())
    dead = record.holder is not None and is_dead_on_this_host(record.holder)
    if live and not dead:
        return  # someone holds it now (a resolver, a live process): theirs to settle
    if record.state is State.IN_PROGRESS or live:
        # Expired, or its holder died on this host (the run's own process, killed inside the
        # call: its lease may not have run out yet): take it over, fenced on its token, to own it
        # as a claim would.
        record = store.take_over(key, record.token, guard.lease)
        if record is None:
            return
    error = encode_error(CallUndone(saga_id, step))
    with contextlib.suppress(LostOwnership):
        store.fail(key, record.token, Disposition.PERMANENT, error, guard.retention)


def tool_outcomes(guard: Guard, snapshot: SagaSnapshot) -> dict[int, CallOutcome]:
    """What each tool call of the run ``snapshot`` did, forward (its undo aside), by step index,
    read from ``guard``'s ledger: what :func:`~sagaguard.saga.timeline.timeline` and ``sagaguard
    sagas show`` report.

    Raises:
        StoreError: the ledger could not be read.
    """
    found: dict[int, CallOutcome] = {}
    for row in snapshot.steps:
        undone = row.state in (StepState.COMPENSATED, StepState.COMPENSATION_FAILED)
        outcome = tool_outcome(guard, row.evolve(state=StepState.STARTED) if undone else row)
        if outcome is not None:
            found[row.index] = outcome
    return found


class AgentSaga(Saga[RunInput]):
    """The saga type of one kind of agent run. Register it where the worker runs.

    Args:
        name: the runs' saga name, as ``sagaguard sagas list`` shows it.
        undos: where the undos the runs record are found by name.
        abandon_after: opt-in: seconds a run whose process is gone may stay un-resumed (counted from
            the worker parking it) before the worker compensates it; None waits for ever.
        on_failure: what an exception escaping the run does (default: compensate).
        compensation_retry: how a failing undo is retried before the run needs attention.
        on_compensation_failure: as for :class:`~sagaguard.saga.definition.Saga`.

    Raises:
        DefinitionError: a bad name, ``abandon_after`` or policy.
    """

    def __init__(
        self,
        name: str,
        undos: UndoRegistry,
        *,
        abandon_after: float | None = None,
        on_failure: OnFailure | str = OnFailure.COMPENSATE,
        compensation_retry: Retry | None = None,
        on_compensation_failure: CompensationPolicy | str = CompensationPolicy.HALT,
    ) -> None:
        super().__init__(name, version=1, input=RunInput, on_compensation_failure=on_compensation_failure)
        self.undos = undos
        self.abandon_after = _check_timeout(f"agent saga {name!r} abandon_after", abandon_after)
        self.on_failure = OnFailure(on_failure)
        self.compensation_retry = compensation_retry or FORWARD_RETRY

    def freeze(self) -> AgentSaga:
        """Close the type to declared steps (it has none: its runs' steps come from the journal)."""
        self._frozen = True
        return self

    def for_run(self, snapshot: SagaSnapshot, guard: Guard) -> Saga[Any]:
        """The definition of the run ``snapshot`` (see the module docstring).

        Raises:
            UnknownUndo: a row names an undo not registered in :attr:`undos`.
            DefinitionMismatch: a row this type did not write, or rows with gaps.
        """
        saga_id = snapshot.saga.saga_id
        abandon = self.abandon_for(snapshot.saga.input)
        policy = self.on_compensation_failure
        saga: Saga[Any] = Saga(self.name, input=RunInput, on_compensation_failure=policy)
        for position, row in enumerate(snapshot.steps):
            if row.index != position:
                raise DefinitionMismatch(saga_id, f"agent rows have a gap at index {position}")
            saga.steps.append(self._step(saga, saga_id, row, guard, abandon))
        saga.steps.append(self._run_step(saga, len(snapshot.steps), abandon))
        return saga.freeze()

    def abandon_for(self, input: str | None) -> float | None:
        """The abandon deadline of the run whose saga input is ``input``: the type's
        ``abandon_after``, else the run's own (``AgentRunner.run(abandon_after=...)``), else None.
        An unreadable deadline counts as none (a run is never undone on a guess)."""
        if self.abandon_after is not None or not input:
            return self.abandon_after
        try:
            recorded = json.loads(input).get(ABANDON_KEY)
            found = float(recorded) if isinstance(recorded, str) else None
        except (ValueError, AttributeError):
            return None
        return found if found is not None and math.isfinite(found) and found >= 0 else None

    def _step(
        self, saga: Saga[Any], saga_id: str, row: StepRecord, guard: Guard, abandon: float | None
    ) -> Step[Any, Any]:
        if row.name.startswith(RUN_PREFIX):
            return self._run_step(saga, row.index, abandon, row.name)
        call = ToolCall.of_row(row)
        if call is None or not row.name.startswith(TOOL_PREFIX):
            raise DefinitionMismatch(saga_id, f"row {row.name!r} is not an agent step")
        undo: Undo | None = None
        if row.compensation is not None:
            undo = self.undos.get(row.compensation)
            if undo is None:
                raise UnknownUndo(saga_id, row.compensation)
        return AgentStep(self, saga, row, call, undo=undo, guard=guard, abandon_after=abandon)

    def _run_step(
        self, saga: Saga[Any], index: int, abandon: float | None, name: str | None = None
    ) -> Step[Any, Any]:
        action = _await_agent(index, abandon, None)
        return Step(
            saga, index, name or run_step_name(index), StepKind.COMPENSATABLE, action,
            compensation=None, retry=_ONCE, compensation_retry=self.compensation_retry,
            not_applied=(), classifier=None, codec=_ANY,
        )  # fmt: skip


def _await_agent(index: int, abandon_after: float | None, recorded: Any) -> Any:
    """A step's forward action in the worker: wait for the agent to take the run back."""

    def wait(ctx: StepContext, _input: Any) -> Any:
        try:
            ctx.wait_for(resume_signal(index), timeout=abandon_after)
        except SignalTimeout:
            # Maybe applied: a tool call in flight at the crash is undone (after the ledger check).
            raise AgentRunAbandoned(ctx.saga_id) from None
        return recorded  # the agent took it back: the row stays as the agent wrote it

    return wait


class AgentStep(Step[RunInput, Any]):
    """A tool call's step in an agent run's definition.

    Attributes:
        call: the call as its row records it.
    """

    def __init__(
        self,
        agent: AgentSaga,
        saga: Saga[Any],
        row: StepRecord,
        call: ToolCall,
        *,
        undo: Undo | None,
        guard: Guard,
        abandon_after: float | None = None,
    ) -> None:
        self.call = call
        self._guard = guard
        compensation = None if undo is None else _compensation(undo, call, guard, agent.undos)
        abandon = agent.abandon_after if abandon_after is None else abandon_after
        super().__init__(
            saga, row.index, row.name, row.kind, _await_agent(row.index, abandon, call.as_json()),
            compensation=compensation, retry=_ONCE, compensation_retry=agent.compensation_retry,
            not_applied=(), classifier=None, codec=_ANY,
            on_compensation_failure=agent.on_compensation_failure,
        )  # fmt: skip

    def _record(self) -> Any:
        call = self.call
        return self._guard.store.get(derive_explicit_key(self._guard.namespace, call.key, call.effect))

    def never_applied(self) -> bool:
        """Whether the tool call never claimed its effect: no ledger record, or a failed one (the
        call failed *not applied*). A call whose result the row holds did apply."""
        if self.call.done:
            return False
        record = self._record()
        if record is not None and _settled_by_undo(record):
            return False  # undone already (a crash before its row said so): undone again, idempotent
        return record is None or record.state is State.FAILED


def _compensation(undo: Undo, call: ToolCall, guard: Guard, registry: UndoRegistry) -> Any:
    def compensate(ctx: StepContext, _input: Any, result: Any) -> None:
        # The row's result once the call returned; None when the row never recorded one (the
        # outcome is unknown: the undo finds the effect by its arguments or undoing()'s key).
        recorded = ToolCall.from_json(result) or call
        with undoing_call(recorded, registry, guard.namespace, guard.ledger_id):
            undo(recorded.arguments, recorded.result if recorded.done else None)
        if not recorded.done:
            # Undone while its outcome was unknown: its record stops counting as in doubt. Inside
            # the compensation's guarded effect, so a crash before this line runs it again.
            settle_undone(guard, ctx.saga_id, ctx.step, recorded)

    compensate.__name__ = compensate.__qualname__ = f"undo_{call.tool}"
    return compensate
