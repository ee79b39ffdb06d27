"""Driving a guarded call's :class:`~sagaguard.idempotency.flow.Flow`: once for sync code, once for async
code.

The flow decides; a driver only answers the I/O it asks for (the httpx ``auth_flow`` and tenacity
``iter`` pattern). :class:`SyncDriver` and :class:`AsyncDriver` read line for line alike: each sends
the flow the answer to its last request (or throws the error that request raised) and answers the
next one, until the flow returns the call's result or raises. The async driver differs only where
async code must: it awaits the body, its sleeps and an async reconciler; it runs blocking store
calls in a worker thread (:mod:`sagaguard.idempotency.backends.offload`) unless the guard runs them inline;
and a claim made for a call cancelled meanwhile is given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any, Protocol

import tenacity

from sagaguard.idempotency.backends.offload import in_thread, submit
from sagaguard.idempotency.effect import (
    NO_RETRY,
    ReconcileRequest,
    Retry,
    RunningEffect,
    Unknown,
    _current_effect,
)
from sagaguard.idempotency.flow import (
    Claim,
    Complete,
    Execute,
    Fail,
    Flow,
    Op,
    Probe,
    Ran,
    Reconcile,
    Sleep,
    TakeOver,
    abandon,
)
from sagaguard.idempotency.holder import is_dead_on_this_host
from sagaguard.idempotency.records import ClaimResult
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.telemetry import EffectSpan

if TYPE_CHECKING:
    from sagaguard.idempotency.guard import Guard, Plan

__all__ = ["AsyncDriver", "Retrier", "RetryPolicy", "SyncDriver", "reconciled", "settled", "store_call"]

log = logging.getLogger("sagaguard.guard")

_NEVER_RETRIED = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)


class RetryPolicy(Protocol):
    """What :class:`Retrier` retries by: a budget and backoff, and which failures are retried
    (an effect's :class:`~sagaguard.idempotency.flow.EffectSpec` is one)."""

    @property
    def retry(self) -> Retry:
        """The stop and wait strategies."""
        ...

    def retries(self, exc: BaseException) -> bool:
        """Whether a try that failed with ``exc`` may be tried again."""
        ...


class Retrier:
    """Retries decided by tenacity's :class:`~tenacity.Retrying`, slept by the caller.

    The caller runs each try itself (the guard inside the claim, under its heartbeat; the saga
    flow as a step of its own) and sleeps in its own way, synchronously or on the event loop; so
    tenacity is driven through its public attempt iterator: a failure is handed to the current
    attempt, and the iterator's next step says whether to try again (after the pause tenacity
    hands to its ``sleep``, noted here) or to stop (``RetryError``). Built on the first failure,
    so a call that succeeds never builds one.

    Args:
        policy: the budget and which failures it covers.
        first: the number of the first try, when earlier tries were made before (a compensation
            retried by the recovery worker goes on from the attempts already made).
    """

    __slots__ = ("_attempts", "_current", "_pause", "_policy", "attempt")

    def __init__(self, policy: RetryPolicy, *, first: int = 1) -> None:
        self._policy = policy
        self._pause = 0.0
        retrying = tenacity.Retrying(
            stop=policy.retry.stop,
            wait=policy.retry.wait,
            retry=tenacity.retry_if_exception(policy.retries),
            sleep=self._note,
        )
        self._attempts = iter(retrying)
        self._current: tenacity.AttemptManager | None = next(self._attempts)
        # The iterator counts from 1 on its one call state; the strategies read its number.
        self._current.retry_state.attempt_number = first
        self.attempt = first
        """The number of the try about to run (``first`` for the first)."""

    def _note(self, seconds: float) -> None:
        self._pause = float(seconds)

    def next_pause(self, exc: BaseException) -> float | None:
        """Seconds to wait before the next try, or None to stop and report ``exc``."""
        policy, current = self._policy, self._current
        if current is None or isinstance(exc, _NEVER_RETRIED) or policy.retry is NO_RETRY:
            return None
        if not policy.retries(exc):
            return None  # decided here: tenacity would re-raise ``exc`` and add to its traceback
        current.__exit__(type(exc), exc, exc.__traceback__)  # the try failed with ``exc``
        try:
            self._current = next(self._attempts)
        except tenacity.RetryError:  # a stop strategy said so
            self._current = None
            return None
        self.attempt = self._current.retry_state.attempt_number
        return self._pause


def reconciled(flow: Flow[Any], request: ReconcileRequest) -> Any:
    """Call the reconciler; an exception means it could not tell."""
    try:
        return flow.spec.reconciler(request)  # type: ignore[misc]
    except Exception as exc:
        log.warning("reconciler for %s failed; treating as unknown: %r", flow.spec.name, exc)
        return Unknown()


async def settled(pending: Awaitable[Any]) -> Any:
    """Await an async reconciler's answer; an exception means it could not tell."""
    try:
        return await pending
    except Exception as exc:
        log.warning("async reconciler failed; treating as unknown: %r", exc)
        return Unknown()


def store_call(store: IdempotencyStore, flow: Flow[Any], op: Claim | Complete | Fail | TakeOver) -> Any:
    """The store's answer to a write the flow asks for."""
    spec, key = flow.spec, flow.identity.key
    if isinstance(op, Claim):
        return store.claim(flow.identity, flow.fingerprint, spec.lease)
    if isinstance(op, Complete):
        return store.complete(key, op.token, op.result, spec.retention)
    if isinstance(op, Fail):
        return store.fail(key, op.token, op.disposition, op.error, spec.retention)
    return store.take_over(key, op.token, spec.lease)


def _probe(store: IdempotencyStore, op: Probe) -> bool:
    """The answer to :class:`Probe`: a store that cannot take a claim over (a wrapper written
    before :meth:`~sagaguard.idempotency.store.IdempotencyStore.take_over`) has the flow wait instead. A read
    of ``/proc``: no thread needed."""
    return hasattr(store, "take_over") and is_dead_on_this_host(op.holder)


class SyncDriver:
    """Drives a guard's flows for sync calls, in the calling thread."""

    def __init__(self, guard: Guard, sleep: Callable[[float], None]) -> None:
        self._guard = guard
        self._sleep = sleep

    def __call__(self, plan: Plan, flow: Flow[Any], call: Callable[[], Any]) -> Any:
        """Run ``call`` as the guarded call ``flow``; returns its result (or the replayed one)."""
        with EffectSpan(plan.naming, plan.counted, flow):
            return self._drive(flow, flow.run(), call)

    def _drive(self, flow: Flow[Any], steps: Generator[Op, Any, Any], call: Callable[[], Any]) -> Any:
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = steps.send(answer) if error is None else steps.throw(error)
            except StopIteration as stop:
                return stop.value
            answer, error = None, None
            try:
                if isinstance(op, Execute):
                    answer = self._execute(flow, op.token, call)
                elif isinstance(op, Reconcile):
                    answer = self._reconcile(flow, op)
                elif isinstance(op, Sleep):
                    self._sleep(op.seconds)
                elif isinstance(op, Probe):
                    answer = _probe(self._guard.store, op)
                else:
                    answer = store_call(self._guard.store, flow, op)
            except BaseException as exc:
                error = exc

    def _execute(self, flow: Flow[Any], token: int, call: Callable[[], Any]) -> Ran:
        """Run the body under the claim's heartbeat, retrying what the effect's retry policy allows."""
        beats = self._guard.heartbeater
        handle = beats.register(flow.identity.key, token, flow.spec.lease)
        try:
            retry: Retrier | None = None  # built on the first failure only
            attempt = 1
            while True:
                running = RunningEffect(flow.identity, token, attempt, beats.beat, flow.spec.lease)
                reset = _current_effect.set(running)
                try:
                    return Ran(call())
                except BaseException as exc:
                    retry = retry or Retrier(flow.spec)
                    pause = retry.next_pause(exc)
                    if pause is None:
                        return Ran(None, exc)
                    attempt = retry.attempt
                finally:
                    _current_effect.reset(reset)
                self._sleep(pause)
        finally:
            beats.unregister(handle)

    def _reconcile(self, flow: Flow[Any], op: Reconcile) -> Any:
        """Ask the reconciler under a heartbeat: a slow provider lookup keeps the taken-over claim."""
        beats = self._guard.heartbeater
        handle = beats.register(flow.identity.key, op.request.record.token, flow.spec.lease)
        try:
            return reconciled(flow, op.request)
        finally:
            beats.unregister(handle)


class AsyncDriver:
    """Drives a guard's flows for async calls; the twin of :class:`SyncDriver`.

    Args:
        guard: the guard whose store and heartbeat it uses.
        sleep: the event loop's sleep (inject one in tests).
        offload: run each store call in a worker thread
            (:func:`sagaguard.idempotency.backends.offload.in_thread`), so the event loop never blocks on a
            commit; False runs them inline on the loop.
    """

    def __init__(self, guard: Guard, sleep: Callable[[float], Awaitable[None]], offload: bool) -> None:
        self._guard = guard
        self._sleep = sleep
        self.offload = offload

    async def __call__(self, plan: Plan, flow: Flow[Any], call: Callable[[], Awaitable[Any]]) -> Any:
        """Await ``call`` as the guarded call ``flow``; returns its result (or the replayed one)."""
        with EffectSpan(plan.naming, plan.counted, flow):
            return await self._drive(flow, flow.run(), call)

    async def _drive(
        self, flow: Flow[Any], steps: Generator[Op, Any, Any], call: Callable[[], Awaitable[Any]]
    ) -> Any:
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = steps.send(answer) if error is None else steps.throw(error)
            except StopIteration as stop:
                return stop.value
            answer, error = None, None
            try:
                if isinstance(op, Execute):
                    answer = await self._execute(flow, op.token, call)
                elif isinstance(op, Reconcile):
                    answer = await self._reconcile(flow, op)
                elif isinstance(op, Sleep):
                    await self._sleep(op.seconds)
                elif isinstance(op, Probe):
                    answer = _probe(self._guard.store, op)
                else:
                    answer = await self._store_call(flow, op)
            except BaseException as exc:
                error = exc

    async def _execute(self, flow: Flow[Any], token: int, call: Callable[[], Awaitable[Any]]) -> Ran:
        """The twin of :meth:`SyncDriver._execute`."""
        beats = self._guard.heartbeater
        handle = beats.register(flow.identity.key, token, flow.spec.lease)
        try:
            retry: Retrier | None = None  # built on the first failure only
            attempt = 1
            while True:
                running = RunningEffect(flow.identity, token, attempt, beats.beat, flow.spec.lease)
                reset = _current_effect.set(running)
                try:
                    return Ran(await call())
                except BaseException as exc:
                    if isinstance(exc, asyncio.CancelledError):
                        # Cancelled mid-call: the effect may have been sent. Record it in doubt, then
                        # let the cancellation go on (the flow re-raises it after the record).
                        return Ran(None, exc)
                    retry = retry or Retrier(flow.spec)
                    pause = retry.next_pause(exc)
                    if pause is None:
                        return Ran(None, exc)
                    attempt = retry.attempt
                finally:
                    _current_effect.reset(reset)
                await self._sleep(pause)
        finally:
            beats.unregister(handle)

    async def _reconcile(self, flow: Flow[Any], op: Reconcile) -> Any:
        """The twin of :meth:`SyncDriver._reconcile`; the reconciler may be sync or async."""
        beats = self._guard.heartbeater
        handle = beats.register(flow.identity.key, op.request.record.token, flow.spec.lease)
        try:
            answer = reconciled(flow, op.request)
            return await settled(answer) if inspect.isawaitable(answer) else answer
        finally:
            beats.unregister(handle)

    async def _store_call(self, flow: Flow[Any], op: Claim | Complete | Fail | TakeOver) -> Any:
        """:func:`store_call`, in a worker thread unless the guard runs store calls inline.

        A cancelled caller does not stop a thread: a write other than a claim is then made all the
        same, and what a claim made for the cancelled call is given back (:func:`abandon`), or the
        claim would look like a crash and an effect that never ran would be in doubt.
        """
        store = self._guard.store
        if not self.offload:
            return store_call(store, flow, op)
        if not isinstance(op, Claim):
            return await in_thread(store_call, store, flow, op)
        claiming = submit(store_call, store, flow, op)
        try:
            return await asyncio.shield(claiming)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                claimed = await claiming
                release = abandon(claimed) if isinstance(claimed, ClaimResult) else None
                if release is not None:
                    await in_thread(store_call, store, flow, release)
            raise
