"""Running sagas: the sync and async drivers of :class:`sagaguard.saga.coordinator.SagaFlow`.

::

    runner = SagaRunner(SqlJournal("sqlite:///sagas.db"), Guard(open_store("sqlite:///sagas.db")))
    outcome = runner.run(trip, "order-42", order)        # or: await runner.arun(...)
    if not outcome.completed:
        log.warning("trip %s ended %s: %s", outcome.saga_id, outcome.state, outcome.error)

Inside a step's action the effect scope is ``{saga_id}/{step}``, so every guarded effect in it is
deduplicated when the step runs again (a retry, or a resume after a crash). A compensation runs
through the guard under its own key (``{saga_id}/{step}/~compensate``, policy at-least-once, so a
compensation that crashed midway runs again and one that finished is not), with the same string as
the scope of the effects inside it.

While a step, compensation or retry pause runs, a :class:`~sagaguard.saga.renewer.LeaseRenewer` thread renews
the saga's lease; a runner that dies stops renewing, and :func:`sagaguard.saga.recovery.recover` takes over.
Each run is traced (:mod:`sagaguard.saga.telemetry`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

from sagaguard.idempotency.backends.offload import in_thread
from sagaguard.idempotency.checks import count, seconds
from sagaguard.idempotency.effect import Policy
from sagaguard.idempotency.errors import CodecError, ConfigurationError, OutcomeUnknown
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.keys import fingerprint, scope
from sagaguard.idempotency.records import Disposition
from sagaguard.saga.checks import check_saga_id
from sagaguard.saga.coordinator import SagaFlow
from sagaguard.saga.decisions import undo_round
from sagaguard.saga.definition import Saga, StepContext
from sagaguard.saga.errors import NothingToUndo, SagaSuspended, StepTimeout, UnstorableType
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.ops import Act, Begin, Claim, Op, Ran, Sleep, Undo, Write
from sagaguard.saga.records import SagaOutcome, SagaSnapshot
from sagaguard.saga.registry import SagaRegistry
from sagaguard.saga.renewer import LeaseRenewer
from sagaguard.saga.telemetry import RunTrace

__all__ = ["SagaRunner", "compensation_key", "step_scope"]

I = TypeVar("I")  # noqa: E741

DEFAULT_MAX_RECOVERIES = 5
"""Take-overs after a lost lease a saga may have before it needs attention."""


def step_scope(saga_id: str, step: str) -> str:
    """The effect scope of a step's action. Step names never contain ``/``, so it is unambiguous."""
    return f"{saga_id}/{step}"


def compensation_key(saga_id: str, step: str, fresh: int = 0) -> str:
    """The guard key (and effect scope) of a step's compensation. ``~`` never starts a step name.

    ``fresh``: how many fresh retries an operator gave it (:func:`~sagaguard.saga.control.retry`
    with ``fresh=True``); each one is a new key, so the effects inside are sent again under new
    keys instead of replaying what the earlier round recorded."""
    base = f"{saga_id}/{step}/~compensate"
    return base if fresh == 0 else f"{base}/{fresh}"


def _ambiguous(_exc: BaseException) -> Disposition:
    # A failed compensation may have done part of its work: record it in doubt, and (policy
    # at-least-once) run it again on the next try. The runner owns the retry budget.
    return Disposition.AMBIGUOUS


def _unwrap(exc: BaseException) -> BaseException:
    """The compensation's own error rather than the guard's OutcomeUnknown wrapper."""
    if isinstance(exc, OutcomeUnknown) and exc.__cause__ is not None:
        return exc.__cause__
    return exc


class SagaRunner:
    """Runs saga instances against a journal, with step effects deduplicated by a guard.

    Args:
        journal: where sagas and their steps are recorded.
        guard: deduplicates the effects inside steps and runs compensations once each.
        lease: seconds a runner owns a saga after each commit or renewal; another runner may take it
            over once the lease runs out.
        wait: seconds :meth:`run` attaches to a saga another runner holds before
            :class:`~sagaguard.saga.errors.SagaInProgress`.
        sleep: the sleep between retries (inject one in tests).
        async_sleep: the same for :meth:`arun`.
        registry: other versions of the sagas this runner runs: an instance started on another
            registered version finishes on it instead of raising
            :class:`~sagaguard.saga.errors.DefinitionMismatch`.
        max_recoveries: take-overs after a lost lease a saga may have before this runner parks it
            as NEEDS_ATTENTION (:class:`~sagaguard.saga.errors.RecoveryExhausted`); None for no cap.
        renewer: renews leases during long calls: True (default) for one of its own, with a daemon
            thread started on first use; False for none (each commit still renews the lease).
        compensation_inline: seconds a run may sleep between attempts of one failing compensation.
            A longer pause parks the saga COMPENSATING, its lease ending when the next attempt is
            due, and :meth:`run` returns: the recovery worker (:mod:`sagaguard.saga.recovery`) retries it
            then, with the compensation's retry policy going on from the attempts already made.

    Raises:
        ConfigurationError: ``lease`` is not a finite number of seconds > 0, ``wait`` or
            ``compensation_inline`` not one >= 0, or ``max_recoveries`` not an int >= 0 (or None);
            the message names the option.
    """

    def __init__(
        self,
        journal: SagaJournal,
        guard: Guard,
        *,
        lease: float = 60.0,
        wait: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        registry: SagaRegistry | None = None,
        max_recoveries: int | None = DEFAULT_MAX_RECOVERIES,
        renewer: LeaseRenewer | bool = True,
        compensation_inline: float = 2.0,
    ) -> None:
        self.lease = seconds("lease", lease)
        self.wait = seconds("wait", wait, zero_ok=True)
        self.compensation_inline = seconds("compensation_inline", compensation_inline, zero_ok=True)
        self.max_recoveries = (
            None if max_recoveries is None else count("max_recoveries", max_recoveries, minimum=0)
        )
        self.journal = journal
        self.guard = guard
        self.registry = registry
        self._sleep = sleep
        self._async_sleep = async_sleep
        if renewer is True:
            renewer = LeaseRenewer(journal, lease)
        self.renewer: LeaseRenewer | None = renewer if isinstance(renewer, LeaseRenewer) else None
        self._start_takes_first = _takes(journal.start, "first")

    def close(self) -> None:
        """Stop the lease renewer's thread (the journal and guard are the caller's to close)."""
        if self.renewer is not None:
            self.renewer.close()

    def _flow(self, saga: Saga[I], saga_id: str, value: I) -> SagaFlow:
        check_saga_id(saga_id)
        saga.freeze()
        try:
            text = saga.input_codec.encode(value)
            printed = fingerprint({"input": value})
        except CodecError as exc:
            raise UnstorableType(f"saga {saga.name!r}: input cannot be stored: {exc}") from exc
        return SagaFlow(
            saga, saga_id, value, text, printed,
            lease=self.lease, wait=self.wait, max_recoveries=self.max_recoveries, registry=self.registry,
            compensation_inline=self.compensation_inline,
        )  # fmt: skip

    def _claimed_flow(self, saga: Saga[Any], snapshot: SagaSnapshot) -> SagaFlow:
        saga.freeze()
        return SagaFlow.claimed(
            saga, snapshot, lease=self.lease, max_recoveries=self.max_recoveries,
            compensation_inline=self.compensation_inline,
        )  # fmt: skip

    def _journal_op(self, flow: SagaFlow, op: Begin | Claim | Write) -> Any:
        if isinstance(op, Begin):
            saga = flow.saga
            # Only pass the deadline and the first step when there are, and the first step only to
            # a journal that takes it, so journals written against older code still fit (the flow
            # then registers the first step with a commit of its own).
            extra: dict[str, Any] = {"timeout": saga.timeout} if saga.timeout is not None else {}
            if op.first is not None and self._start_takes_first:
                extra["first"] = op.first
            return self.journal.start(
                flow.saga_id,
                name=saga.name,
                version=saga.version,
                input=flow.input_text,
                fingerprint=flow.fingerprint,
                lease=self.lease,
                **extra,
            )
        if isinstance(op, Claim):
            return self.journal.claim(flow.saga_id, lease=self.lease)
        return self.journal.commit(flow.saga_id, op.token, op.phase)

    def _guard_options(self, ctx: StepContext, key: str) -> dict[str, Any]:
        return {
            "arguments": {"saga_id": ctx.saga_id, "step": ctx.step},
            "key": key,
            "policy": Policy.AT_LEAST_ONCE,
            "classify": _ambiguous,
            "result_type": type(None),
        }

    def _hold(self, flow: SagaFlow, op: Act | Undo | Sleep) -> contextlib.AbstractContextManager[None]:
        if self.renewer is None or op.token <= 0:
            return contextlib.nullcontext()
        until = op.context.deadline if isinstance(op, Act) else None
        return self.renewer.hold(flow.saga_id, op.token, until=until)

    # -- sync -------------------------------------------------------------------------------

    def run(self, saga: Saga[I], saga_id: str, input: I) -> SagaOutcome:
        """Run the saga instance ``saga_id`` until it ends or waits, or return its recorded outcome.

        Starting an id that finished (or is parked for an operator, or waits for a signal) returns
        the recorded outcome with ``replayed=True``; one that another runner holds is waited for
        (``wait``), then resumed if that runner's lease ran out; one whose runner crashed, or that
        waited and whose signal, deadline or cancellation has come, is resumed where its journal
        stands.

        Returns:
            The outcome: COMPLETED, COMPENSATED, FAILED or NEEDS_ATTENTION, with step results; or
            WAITING (``waiting_for`` names the signal) when a step waits: nothing is held then; or
            COMPENSATING when a compensation keeps failing past ``compensation_inline``: the saga
            is parked for the recovery worker, which retries it when the next attempt is due.

        Raises:
            SagaConflict: the id was started with another input.
            DefinitionMismatch: the id was started by another saga, or a version the runner's
                registry does not hold; :class:`~sagaguard.saga.errors.StepMismatch` when the journal's steps
                no longer match the definition's.
            SagaInProgress: another runner still holds it after ``wait`` seconds.
            LostSagaLease: another runner took the saga over while this one ran.
            JournalError: the journal failed (the saga resumes from its last commit).
            ConfigurationError: the saga has async steps (use :meth:`arun`), or the id is empty,
                not a str or holds a NUL character (a lone surrogate: CodecError); nothing is
                stored then.
        """
        _refuse_async(saga)
        flow = self._flow(saga, saga_id, input)
        return self._drive(flow, flow.run())

    def resume(self, saga: Saga[Any], snapshot: SagaSnapshot) -> SagaOutcome:
        """Drive a saga this process has just taken over with ``journal.claim`` (``snapshot`` is
        the claim's answer) until it ends or waits. Used by :func:`sagaguard.saga.recovery.recover`.
        It raises what :meth:`run` raises.
        """
        _refuse_async(saga)
        flow = self._claimed_flow(saga, snapshot)
        return self._drive(flow, flow.resume(snapshot))

    def _drive(self, flow: SagaFlow, gen: Generator[Op, Any, SagaOutcome]) -> SagaOutcome:
        run = RunTrace(flow)
        with run.running():
            answer: Any = None
            error: BaseException | None = None
            while True:
                try:
                    op: Op = gen.send(answer) if error is None else gen.throw(error)
                except StopIteration as stop:
                    run.finished(stop.value)
                    return stop.value  # type: ignore[no-any-return]
                answer, error = None, None
                try:
                    if isinstance(op, Act):
                        with self._hold(flow, op), run.step(op):
                            answer = self._act(flow, op)
                    elif isinstance(op, Undo):
                        with self._hold(flow, op), run.compensation(op) as span:
                            answer = self._undo(flow, op)
                            run.compensated(span, answer.error)
                    elif isinstance(op, Sleep):
                        with self._hold(flow, op):
                            self._sleep(op.seconds)
                    else:
                        answer = self._journal_op(flow, op)
                        if isinstance(op, Write):
                            run.written(op.phase.steps)
                except BaseException as exc:
                    error = exc

    def _act(self, flow: SagaFlow, op: Act) -> Ran:
        ctx = op.context
        action = flow.saga.steps[ctx.index].action
        with scope(step_scope(ctx.saga_id, ctx.step)):
            try:
                ran = Ran(action(ctx, flow.input))
            except BaseException as exc:
                ran = Ran(error=exc)
        return self._finished(ctx, ran)

    def _finished(self, ctx: StepContext, ran: Ran) -> Ran:
        """Stamp the journal's time on a call that had a deadline or parked."""
        if ctx.deadline is None and not isinstance(ran.error, SagaSuspended):
            return ran
        return Ran(ran.value, ran.error, self.journal.now())

    def _undo(self, flow: SagaFlow, op: Undo) -> Ran:
        ctx = op.context
        step = flow.saga.steps[ctx.index]
        fn = step.compensation_fn
        assert fn is not None
        if step.never_applied():
            # Outside the guard: a skipped undo leaves no record of its own in the ledger.
            return Ran(error=NothingToUndo(ctx.step))
        key = compensation_key(ctx.saga_id, ctx.step, undo_round(flow.signals, ctx.index))

        def call() -> None:
            with scope(key):
                fn(ctx, flow.input, op.result)

        try:
            self.guard.run(f"sagaguard.compensate.{flow.saga.name}", call, **self._guard_options(ctx, key))
        except BaseException as exc:
            return Ran(error=_unwrap(exc))
        return Ran()

    # -- async ------------------------------------------------------------------------------

    async def arun(self, saga: Saga[I], saga_id: str, input: I) -> SagaOutcome:
        """The async twin of :meth:`run`. Steps and compensations may be sync or async; sync ones
        and journal calls run in a worker thread so the event loop never blocks on them. An async
        step with a timeout is cancelled when it runs past it."""
        flow = self._flow(saga, saga_id, input)
        return await self._adrive(flow, flow.run())

    async def aresume(self, saga: Saga[Any], snapshot: SagaSnapshot) -> SagaOutcome:
        """The async twin of :meth:`resume`."""
        flow = self._claimed_flow(saga, snapshot)
        return await self._adrive(flow, flow.resume(snapshot))

    async def _adrive(self, flow: SagaFlow, gen: Generator[Op, Any, SagaOutcome]) -> SagaOutcome:
        run = RunTrace(flow)
        with run.running():
            answer: Any = None
            error: BaseException | None = None
            while True:
                try:
                    op: Op = gen.send(answer) if error is None else gen.throw(error)
                except StopIteration as stop:
                    run.finished(stop.value)
                    return stop.value  # type: ignore[no-any-return]
                answer, error = None, None
                try:
                    if isinstance(op, Act):
                        with self._hold(flow, op), run.step(op):
                            answer = await self._act_async(flow, op)
                    elif isinstance(op, Undo):
                        with self._hold(flow, op), run.compensation(op) as span:
                            answer = await self._undo_async(flow, op)
                            run.compensated(span, answer.error)
                    elif isinstance(op, Sleep):
                        with self._hold(flow, op):
                            await self._async_sleep(op.seconds)
                    else:
                        answer = await in_thread(self._journal_op, flow, op)
                        if isinstance(op, Write):
                            run.written(op.phase.steps)
                except BaseException as exc:
                    error = exc

    async def _act_async(self, flow: SagaFlow, op: Act) -> Ran:
        ctx = op.context
        step = flow.saga.steps[ctx.index]
        if not _is_async(step.action):
            return await in_thread(self._act, flow, op)
        with scope(step_scope(ctx.saga_id, ctx.step)):
            ran = await _call_async(step.action, ctx, flow.input)
        if ctx.deadline is None and not isinstance(ran.error, SagaSuspended):
            return ran  # nothing to stamp: no need for a thread
        return await in_thread(self._finished, ctx, ran)

    async def _undo_async(self, flow: SagaFlow, op: Undo) -> Ran:
        ctx = op.context
        step = flow.saga.steps[ctx.index]
        fn = step.compensation_fn
        assert fn is not None
        if not _is_async(fn):
            return await in_thread(self._undo, flow, op)
        if await in_thread(step.never_applied):
            return Ran(error=NothingToUndo(ctx.step))
        key = compensation_key(ctx.saga_id, ctx.step, undo_round(flow.signals, ctx.index))

        async def call() -> None:
            with scope(key):
                await fn(ctx, flow.input, op.result)

        try:
            await self.guard.arun(
                f"sagaguard.compensate.{flow.saga.name}", call, **self._guard_options(ctx, key)
            )
        except BaseException as exc:
            return Ran(error=_unwrap(exc))
        return Ran()


async def _call_async(action: Any, ctx: StepContext, value: Any) -> Ran:
    """Await an async action; past ``ctx.deadline`` it is cancelled and fails with StepTimeout."""
    try:
        if ctx.deadline is None:
            return Ran(await action(ctx, value))
        timer = asyncio.timeout(max(0.0, ctx.deadline - ctx.now))
        try:
            async with timer:
                result = await action(ctx, value)
        except TimeoutError as exc:
            if not timer.expired():
                raise  # the step's own timeout error, not ours
            return Ran(error=StepTimeout(ctx.step, ctx.deadline - ctx.now).with_traceback(exc.__traceback__))
        return Ran(result)
    except BaseException as exc:
        return Ran(error=exc)


def _takes(method: Callable[..., Any], name: str) -> bool:
    """Whether ``method`` accepts the keyword argument ``name`` (or any keyword)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _refuse_async(saga: Saga[Any]) -> None:
    if saga.has_async():
        raise ConfigurationError(f"saga {saga.name!r} has async steps: run it with arun()")


def _is_async(fn: Any) -> bool:
    return fn is not None and inspect.iscoroutinefunction(fn)
