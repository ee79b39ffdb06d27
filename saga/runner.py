"""Running sagas: the sync and async drivers of :class:`saga.coordinator.SagaFlow`.

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
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from idempotency.effect import Policy
from idempotency.errors import CodecError, ConfigurationError, OutcomeUnknown
from idempotency.guard import Guard
from idempotency.keys import fingerprint, scope
from idempotency.records import Disposition
from saga.coordinator import Act, Begin, Op, Ran, SagaFlow, Sleep, Undo, Write
from saga.definition import Saga, StepContext
from saga.errors import UnstorableType
from saga.journal import SagaJournal
from saga.records import SagaOutcome

__all__ = ["SagaRunner", "compensation_key", "step_scope"]

I = TypeVar("I")  # noqa: E741


def step_scope(saga_id: str, step: str) -> str:
    """The effect scope of a step's action. Step names never contain ``/``, so it is unambiguous."""
    return f"{saga_id}/{step}"


def compensation_key(saga_id: str, step: str) -> str:
    """The guard key (and effect scope) of a step's compensation. ``~`` never starts a step name."""
    return f"{saga_id}/{step}/~compensate"


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
        lease: seconds a runner owns a saga after each commit; another runner may take it over
            once the lease runs out (renewal during long steps comes with the recovery sweeper).
        wait: seconds :meth:`run` attaches to a saga another runner holds before
            :class:`~saga.errors.SagaInProgress`.
        sleep: the sleep between retries (inject one in tests).
        async_sleep: the same for :meth:`arun`.
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
    ) -> None:
        if lease <= 0 or wait < 0:
            raise ConfigurationError("lease must be > 0 and wait >= 0")
        self.journal = journal
        self.guard = guard
        self.lease = lease
        self.wait = wait
        self._sleep = sleep
        self._async_sleep = async_sleep

    def _flow(self, saga: Saga[I], saga_id: str, value: I) -> SagaFlow:
        if not saga_id:
            raise ConfigurationError("a saga id must not be empty")
        saga.freeze()
        try:
            text = saga.input_codec.encode(value)
            printed = fingerprint({"input": value})
        except CodecError as exc:
            raise UnstorableType(f"saga {saga.name!r}: input cannot be stored: {exc}") from exc
        return SagaFlow(saga, saga_id, value, text, printed, lease=self.lease, wait=self.wait)

    def _journal_op(self, flow: SagaFlow, op: Begin | Write) -> Any:
        if isinstance(op, Begin):
            saga = flow.saga
            return self.journal.start(
                flow.saga_id,
                name=saga.name,
                version=saga.version,
                input=flow.input_text,
                fingerprint=flow.fingerprint,
                lease=self.lease,
            )
        return self.journal.commit(flow.saga_id, op.token, op.phase)

    def _guard_options(self, flow: SagaFlow, ctx: StepContext) -> dict[str, Any]:
        return {
            "arguments": {"saga_id": ctx.saga_id, "step": ctx.step},
            "key": compensation_key(ctx.saga_id, ctx.step),
            "policy": Policy.AT_LEAST_ONCE,
            "classify": _ambiguous,
            "result_type": type(None),
        }

    # -- sync -------------------------------------------------------------------------------

    def run(self, saga: Saga[I], saga_id: str, input: I) -> SagaOutcome:
        """Run the saga instance ``saga_id`` to its end, or return its recorded outcome.

        Starting an id that finished (or is parked for an operator) returns the recorded outcome
        with ``replayed=True``; one that another runner holds is waited for (``wait``), then
        resumed if that runner's lease ran out; one whose runner crashed is resumed where its
        journal stands.

        Returns:
            The outcome: COMPLETED, COMPENSATED, FAILED or NEEDS_ATTENTION, with step results.

        Raises:
            SagaConflict: the id was started with another input.
            DefinitionMismatch: the id was started by another saga or version.
            SagaInProgress: another runner still holds it after ``wait`` seconds.
            LostSagaLease: another runner took the saga over while this one ran.
            JournalError: the journal failed (the saga resumes from its last commit).
            ConfigurationError: the saga has async steps (use :meth:`arun`) or a bad id.
        """
        if any(_is_async(s.action) or _is_async(s.compensation_fn) for s in saga.steps):
            raise ConfigurationError(f"saga {saga.name!r} has async steps: run it with arun()")
        flow = self._flow(saga, saga_id, input)
        gen = flow.run()
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                op: Op = gen.send(answer) if error is None else gen.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            answer, error = None, None
            try:
                if isinstance(op, Act):
                    answer = self._act(flow, op)
                elif isinstance(op, Undo):
                    answer = self._undo(flow, op)
                elif isinstance(op, Sleep):
                    self._sleep(op.seconds)
                else:
                    answer = self._journal_op(flow, op)
            except BaseException as exc:
                error = exc

    def _act(self, flow: SagaFlow, op: Act) -> Ran:
        ctx = op.context
        action = flow.saga.steps[ctx.index].action
        with scope(step_scope(ctx.saga_id, ctx.step)):
            try:
                return Ran(action(ctx, flow.input))
            except BaseException as exc:
                return Ran(error=exc)

    def _undo(self, flow: SagaFlow, op: Undo) -> Ran:
        ctx = op.context
        fn = flow.saga.steps[ctx.index].compensation_fn
        assert fn is not None

        def call() -> None:
            with scope(compensation_key(ctx.saga_id, ctx.step)):
                fn(ctx, flow.input, op.result)

        try:
            self.guard.run(f"sagaguard.compensate.{flow.saga.name}", call, **self._guard_options(flow, ctx))
        except BaseException as exc:
            return Ran(error=_unwrap(exc))
        return Ran()

    # -- async ------------------------------------------------------------------------------

    async def arun(self, saga: Saga[I], saga_id: str, input: I) -> SagaOutcome:
        """The async twin of :meth:`run`. Steps and compensations may be sync or async; sync ones
        and journal calls run in a worker thread so the event loop never blocks on them."""
        flow = self._flow(saga, saga_id, input)
        gen = flow.run()
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                op: Op = gen.send(answer) if error is None else gen.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            answer, error = None, None
            try:
                if isinstance(op, Act):
                    answer = await self._act_async(flow, op)
                elif isinstance(op, Undo):
                    answer = await self._undo_async(flow, op)
                elif isinstance(op, Sleep):
                    await self._async_sleep(op.seconds)
                else:
                    answer = await asyncio.to_thread(self._journal_op, flow, op)
            except BaseException as exc:
                error = exc

    async def _act_async(self, flow: SagaFlow, op: Act) -> Ran:
        ctx = op.context
        action = flow.saga.steps[ctx.index].action
        if not _is_async(action):
            return await asyncio.to_thread(self._act, flow, op)
        with scope(step_scope(ctx.saga_id, ctx.step)):
            try:
                return Ran(await action(ctx, flow.input))
            except BaseException as exc:
                return Ran(error=exc)

    async def _undo_async(self, flow: SagaFlow, op: Undo) -> Ran:
        ctx = op.context
        fn = flow.saga.steps[ctx.index].compensation_fn
        assert fn is not None
        if not _is_async(fn):
            return await asyncio.to_thread(self._undo, flow, op)

        async def call() -> None:
            with scope(compensation_key(ctx.saga_id, ctx.step)):
                await fn(ctx, flow.input, op.result)

        try:
            await self.guard.arun(
                f"sagaguard.compensate.{flow.saga.name}", call, **self._guard_options(flow, ctx)
            )
        except BaseException as exc:
            return Ran(error=_unwrap(exc))
        return Ran()


def _is_async(fn: Any) -> bool:
    return fn is not None and inspect.iscoroutinefunction(fn)
