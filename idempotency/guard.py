"""The guard: claim before, record after, replay on re-run, resolve what a crash left in doubt.

::

    guard = Guard(open_store("sqlite:///sagaguard.db"))

    @guard.effect("stripe.charge", reconciler=find_charge, permanent=(CardDeclined,))
    def charge(customer: str, amount: int) -> Receipt:
        return psp.charge(customer, amount, idempotency_key=current_effect().provider_key)

    with scope("order-42"):
        charge("cus_1", 1000)   # runs once; a re-run of this block replays the receipt

The decisions live in :mod:`idempotency.flow`; this module only drives them, once for sync code and
once for async code. Each driver takes the common path itself, as plain calls (claim, then run and
record, or replay), and hands every other outcome (a wait, a take-over to resolve, a failure to
record) to the flow's generator, so the rare paths are decided in one place only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
import typing
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from typing import Any, Generic, ParamSpec, TypeVar, cast, overload

from idempotency.driving import Retrier, reconciled, settled
from idempotency.effect import Classifier, Policy, ReconcileRequest, Retry, RunningEffect, _current_effect
from idempotency.errors import CodecError, ConfigurationError
from idempotency.flow import (
    Action,
    Claim,
    Complete,
    EffectSpec,
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
    decide,
)
from idempotency.heartbeat import Heartbeater
from idempotency.holder import is_dead_on_this_host
from idempotency.keys import EffectIdentity, current_scope, fingerprint, key_deriver
from idempotency.offload import in_thread, submit
from idempotency.options import (
    FingerprintSpec,
    binder,
    build_spec,
    check_run_options,
    check_sync_reconciler,
    fingerprint_selector,
    seconds,
)
from idempotency.records import ClaimResult
from idempotency.store import AsyncWrites, IdempotencyStore, WriteCancelled
from idempotency.telemetry import EffectSpan, counter_attributes, effect_counter, tracing

__all__ = ["FingerprintSpec", "Guard", "Operation"]

_new_identity = EffectIdentity.from_fields  # built on every call: the cheaper way, as a global

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

DAY = 86_400.0
DEFAULT_LEASE = 5.0
"""Seconds a claim is owned unless renewed: the longest a claim of a holder that died on another
host blocks a restart (one on this host is taken over at once). The heartbeat renews it every third
of it while the body runs, so a long call keeps its claim through two missed renewals."""
DEFAULT_WAIT = 10.0
"""Seconds a duplicate of a live call waits: two default leases, so it sees the holder finish, or
its claim run out and be taken over, even when the holder died just after a renewal."""

_CLAIM = Claim()
_REPLAY, _EXECUTE = Action.REPLAY, Action.EXECUTE  # globals: cheaper than members read off the enum
_OPERATIONS_KEPT = 256
"""Operations :meth:`Guard.run` keeps built, by name and options; past this many it starts afresh."""


class _Plan:
    """One effect, prepared once for every call: its spec, its key deriver, its counter attributes."""

    __slots__ = ("counted", "derive", "name", "namespace", "spec")

    def __init__(self, spec: EffectSpec[Any], namespace: str) -> None:
        self.spec = spec
        self.name = spec.name
        self.namespace = namespace
        self.derive = key_deriver(namespace, spec.name)
        self.counted = counter_attributes(spec.name)


class EffectDecorator:
    """Returned by :meth:`Guard.effect`; apply it to a sync or async function."""

    def __init__(self, guard: Guard, name: str | None, options: dict[str, Any]) -> None:
        self._guard = guard
        self._name = name
        self._options = options

    @overload
    def __call__(self, fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]: ...

    def __call__(self, fn: Callable[P, Any]) -> Callable[P, Any]:
        return self._guard._wrap(fn, self._name, self._options)


class Operation(Generic[T]):
    """An effect for code that cannot be decorated, declared once and run many times.

    Built by :meth:`Guard.operation`: the options are checked and the spec built there, so each
    :meth:`run` only fingerprints its arguments, derives its key and drives the call.
    """

    __slots__ = ("_async_reconciler", "_guard", "_plan")

    def __init__(self, guard: Guard, plan: _Plan, async_reconciler: bool) -> None:
        self._guard = guard
        self._plan = plan
        self._async_reconciler = async_reconciler

    @property
    def name(self) -> str:
        """The effect's name."""
        return self._plan.name

    def run(
        self, fn: Callable[[], T], *, arguments: Mapping[str, Any] | None = None, key: str | None = None
    ) -> T:
        """Run ``fn`` once as this effect. See :meth:`Guard.run`.

        Raises:
            ConfigurationError: the operation has an async reconciler (use :meth:`arun`).
        """
        if self._async_reconciler:  # a sync call cannot await it: the effect would stay in doubt
            raise ConfigurationError(f"{self.name}: an async reconciler needs an async effect (or arun)")
        guard, args = self._guard, dict(arguments or {})
        return cast(T, guard._drive(self._plan, guard._flow(self._plan, args, args, key), fn))

    async def arun(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        arguments: Mapping[str, Any] | None = None,
        key: str | None = None,
    ) -> T:
        """The async twin of :meth:`run`."""
        guard, args = self._guard, dict(arguments or {})
        return cast(T, await guard._drive_async(self._plan, guard._flow(self._plan, args, args, key), fn))


class Guard:
    """Wraps calls that change the world so each happens once per identity.

    Args:
        store: the effect ledger.
        namespace: the tenant; part of every key's hash, so tenants never replay each other.
        lease: seconds a claim is owned before another worker may take it over (renewed in the
            background while a call runs, and while a reconciler runs). A claim whose holder died
            on this host is taken over at once, whatever its lease (see :mod:`idempotency.holder`).
        retention: seconds a finished record is kept (and replayed) before it may be purged.
        wait: seconds a duplicate call waits, in total, for a live claim before ``AlreadyInProgress``.
        sleep: the sleep used between waits and retries (inject one in tests).
        async_sleep: the same for async calls.
        offload: whether async calls run store I/O in a worker thread, so the event loop never
            blocks on a commit. None (default): the store's ``offload_async`` attribute decides
            (SQL: yes; Redis and memory: no, one round trip costs less than two thread hops).

    Raises:
        ConfigurationError: ``lease``, ``retention`` or ``wait`` is not a finite number of seconds
            (> 0; ``wait`` may be 0), naming the option.
    """

    def __init__(
        self,
        store: IdempotencyStore,
        *,
        namespace: str = "default",
        lease: float = DEFAULT_LEASE,
        retention: float = 7 * DAY,
        wait: float = DEFAULT_WAIT,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        offload: bool | None = None,
    ) -> None:
        self.store = store
        self.namespace = namespace
        self.lease = seconds("lease", lease)
        self.retention = seconds("retention", retention)
        self.wait = seconds("wait", wait, zero_ok=True)
        self._sleep = sleep
        self._async_sleep = async_sleep
        # By default the store says: a commit that waits on fsync (SQL) goes to a thread; a
        # sub-millisecond round trip (Redis, memory) costs less than the two thread hops.
        self._offload = bool(getattr(store, "offload_async", True)) if offload is None else offload
        # A store whose hot writes can be awaited (SQLite with the write lock free, Postgres on a
        # non-blocking socket) makes them on the event loop; the thread is then only for writes
        # that would wait.
        self._native: AsyncWrites | None = (
            store if offload is None and self._offload and isinstance(store, AsyncWrites) else None
        )
        self.heartbeater = Heartbeater(store)
        self._operations: dict[Any, Operation[Any]] = {}

    # -- declaring effects -------------------------------------------------------------------

    def effect(
        self,
        name: str | None = None,
        *,
        result_type: Any = inspect.Parameter.empty,
        policy: Policy | str = Policy.AT_MOST_ONCE,
        provider_idempotent: bool = False,
        provider_window: float | None = None,
        reconciler: Callable[[ReconcileRequest], Any] | None = None,
        classify: Classifier | None = None,
        permanent: tuple[type[BaseException], ...] = (),
        retryable: tuple[type[BaseException], ...] = (),
        retry: Retry | None = None,
        fingerprint: FingerprintSpec = None,
        key: Callable[..., str] | None = None,
        lease: float | None = None,
        retention: float | None = None,
        wait: float | None = None,
    ) -> EffectDecorator:
        """Declare a guarded effect.

        Args:
            name: the effect's name in keys and spans (default: the function's qualified name).
            result_type: the type results are stored as (default: the return annotation).
            policy: what an in-doubt effect that nothing else settles does (see :class:`Policy`).
            provider_idempotent: the provider deduplicates on :attr:`EffectContext.provider_key`
                within its window, so an in-doubt call is re-sent under the same key.
            provider_window: seconds the provider keeps a provider key (Stripe: 24 hours); an
                in-doubt record older than this is not re-sent but settled by the policy. None
                (default): the provider deduplicates forever.
            reconciler: asks the world whether an in-doubt call happened (sync or async).
            classify: maps exceptions to dispositions before the type lists are consulted.
            permanent: exception types meaning "not applied, never will be": recorded FAILED and
                replayed as themselves.
            retryable: exception types meaning "not applied, try again": retried in the claim.
            retry: retry budget and backoff for retryable errors (default: 3 tries, jittered).
            fingerprint: which arguments must match on replay (see ``FingerprintSpec``).
            key: derive an explicit key from the call's arguments instead of scope + ordinal.
            lease, retention, wait: override the guard's defaults for this effect.

        Raises:
            CodecError: the result type cannot be stored as JSON (raised when decorating).
            ConfigurationError: any other bad option.
        """
        given = locals()
        return EffectDecorator(
            self, name, {k: v for k, v in given.items() if k not in ("self", "name", "given")}
        )

    def _plan(self, name: str, result_type: Any, options: Mapping[str, Any]) -> _Plan:
        defaults = {"lease": self.lease, "retention": self.retention, "wait": self.wait}
        return _Plan(build_spec(name, result_type, options, **defaults), self.namespace)

    def _wrap(self, fn: Callable[P, Any], name: str | None, options: Mapping[str, Any]) -> Callable[P, Any]:
        effect_name = name or f"{fn.__module__}.{fn.__qualname__}"
        result_type = options.get("result_type", inspect.Parameter.empty)
        if result_type is inspect.Parameter.empty:
            try:
                hints = typing.get_type_hints(fn)
            except NameError as exc:
                raise ConfigurationError(
                    f"cannot resolve the return annotation of {effect_name}: {exc}; "
                    "pass result_type= explicitly"
                ) from exc
            result_type = hints.get("return", Any)
        plan = self._plan(effect_name, result_type, options)
        is_async = inspect.iscoroutinefunction(fn)
        if not is_async:
            check_sync_reconciler(effect_name, options)
        signature = inspect.signature(fn)
        select = fingerprint_selector(options.get("fingerprint"), signature)
        key_fn: Callable[..., str] | None = options.get("key")
        bind = binder(signature, effect_name)
        spec, namespace, derive = plan.spec, plan.namespace, plan.derive

        def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Flow[Any]:
            arguments = bind(args, kwargs)
            if key_fn is not None:
                return self._flow(plan, arguments, select(arguments), key_fn(**arguments))
            # What _flow does for a scoped call, inlined: this runs on every call of the effect.
            fp = fingerprint(select(arguments))
            unit = current_scope()
            ordinal = unit.next_ordinal(effect_name)
            identity = _new_identity(namespace, unit.id, effect_name, ordinal, derive(unit.id, ordinal))
            return Flow(spec, identity, fp, arguments)

        if is_async:
            afn = cast(Callable[..., Coroutine[Any, Any, Any]], fn)

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                flow = prepare(args, kwargs)
                return await self._drive_async(plan, flow, lambda: afn(*args, **kwargs))

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            flow = prepare(args, kwargs)
            return self._drive(plan, flow, lambda: fn(*args, **kwargs))

        return wrapper

    # -- the explicit API ---------------------------------------------------------------------

    def operation(self, name: str, *, result_type: Any = Any, **options: Any) -> Operation[Any]:
        """Declare the effect ``name`` once, for code that cannot be decorated; run it per call.

        ::

            charge = guard.operation("psp.charge", result_type=Receipt, permanent=(Declined,))
            with scope("order-42"):
                receipt = charge.run(lambda: psp.charge(42), arguments={"order": 42})

        Args:
            name: the effect's name.
            result_type: the type results are stored as.
            options: as for :meth:`effect` (those :meth:`run` takes).

        Raises:
            CodecError: the result type cannot be stored as JSON.
            ConfigurationError: any other bad option.
        """
        check_run_options(options)
        plan = self._plan(name, result_type, options)
        return Operation(self, plan, inspect.iscoroutinefunction(options.get("reconciler")))

    def _operation(self, name: str, result_type: Any, options: dict[str, Any]) -> Operation[Any]:
        """:meth:`operation`, kept by name, type and options so a repeated :meth:`run` builds nothing."""
        try:
            cache_key: Any = (name, result_type, *options.items())
            found = self._operations.get(cache_key)
        except TypeError:  # an unhashable option: built afresh each time
            return self.operation(name, result_type=result_type, **options)
        if found is None:
            found = self.operation(name, result_type=result_type, **options)
            if len(self._operations) >= _OPERATIONS_KEPT:
                self._operations.clear()
            self._operations[cache_key] = found
        return found

    def run(
        self,
        name: str,
        fn: Callable[[], T],
        *,
        arguments: Mapping[str, Any] | None = None,
        key: str | None = None,
        result_type: Any = Any,
        **options: Any,
    ) -> T:
        """Run ``fn`` once as the effect ``name``, for code that cannot be decorated.

        Repeated calls with the same name, type and options reuse the checked spec; code that runs
        one effect many times can also hold on to :meth:`operation`'s result.

        Args:
            name: the effect's name.
            fn: the call, with its arguments bound (a lambda or ``functools.partial``).
            arguments: what must match on replay (the fingerprint); usually the call's arguments.
            key: an explicit key instead of scope + ordinal.
            result_type: the type results are stored as.
            options: as for :meth:`effect`.

        Raises:
            KeyConflict, AlreadyInProgress, OutcomeUnknown, LostOwnership, StoreError: see
            :mod:`idempotency.errors`; and whatever ``fn`` raises for a not-applied failure.
        """
        return cast(T, self._operation(name, result_type, options).run(fn, arguments=arguments, key=key))

    async def arun(
        self,
        name: str,
        fn: Callable[[], Awaitable[T]],
        *,
        arguments: Mapping[str, Any] | None = None,
        key: str | None = None,
        result_type: Any = Any,
        **options: Any,
    ) -> T:
        """The async twin of :meth:`run`."""
        operation = self._operation(name, result_type, options)
        return cast(T, await operation.arun(fn, arguments=arguments, key=key))

    def close(self) -> None:
        """Stop the heartbeat thread. The store is the caller's to close."""
        self.heartbeater.close()

    # -- driving a flow ------------------------------------------------------------------------

    def _flow(
        self,
        plan: _Plan,
        arguments: Mapping[str, Any],
        printed: Mapping[str, Any],
        key: str | None,
    ) -> Flow[Any]:
        fp = fingerprint(printed)
        name = plan.name
        if key is not None:
            identity = EffectIdentity.explicit(plan.namespace, key, name)
        else:
            unit = current_scope()
            ordinal = unit.next_ordinal(name)
            identity = _new_identity(plan.namespace, unit.id, name, ordinal, plan.derive(unit.id, ordinal))
        return Flow(plan.spec, identity, fp, arguments)

    def _store_op(self, flow: Flow[Any], op: Op) -> Any:
        spec, key = flow.spec, flow.identity.key
        if isinstance(op, Claim):
            return self.store.claim(flow.identity, flow.fingerprint, spec.lease)
        if isinstance(op, Complete):
            return self.store.complete(key, op.token, op.result, spec.retention)
        if isinstance(op, Fail):
            return self.store.fail(key, op.token, op.disposition, op.error, spec.retention)
        if isinstance(op, TakeOver):
            return self.store.take_over(key, op.token, spec.lease)
        raise AssertionError(op)  # pragma: no cover

    def _probe(self, op: Probe) -> bool:
        """The answer to :class:`Probe`: a store that cannot take a claim over (a wrapper written
        before :meth:`~idempotency.store.IdempotencyStore.take_over`) has the flow wait instead."""
        return hasattr(self.store, "take_over") and is_dead_on_this_host(op.holder)

    def _reconciled(self, flow: Flow[Any], op: Reconcile) -> Any:
        """Ask the reconciler under a heartbeat: a slow provider lookup keeps the taken-over claim."""
        handle = self.heartbeater.register(flow.identity.key, op.request.record.token, flow.spec.lease)
        try:
            return reconciled(flow, op.request)
        finally:
            self.heartbeater.unregister(handle)

    def _context(self, flow: Flow[Any], token: int, attempt: int) -> RunningEffect:
        # A tuple: the EffectContext is built only if the body asks for it (current_effect()).
        return RunningEffect(flow.identity, token, attempt, self.heartbeater.beat, flow.spec.lease)

    def _drive(self, plan: _Plan, flow: Flow[Any], call: Callable[[], Any]) -> Any:
        if tracing():
            with EffectSpan(plan.name, plan.counted, flow):
                return self._settle(flow, call)
        # No tracer provider: every span would be a no-op, so only the outcome is counted.
        try:
            return self._settle(flow, call)
        finally:
            effect_counter.add(1, plan.counted[flow.outcome])

    def _settle(self, flow: Flow[Any], call: Callable[[], Any]) -> Any:
        """The common path as plain calls; any other outcome goes on in the flow's generator."""
        spec, identity, store = flow.spec, flow.identity, self.store
        claim = store.claim(identity, flow.fingerprint, spec.lease)
        record = claim.record
        action = decide(claim, flow.fingerprint, identity.name)
        if action is _REPLAY:
            return flow.replay(record)
        if action is not _EXECUTE:
            return self._loop(flow, flow.run(claim), call)
        ran = self._execute(flow, record.token, call)
        if ran.error is None:
            try:
                text = spec.codec.encode(ran.value)
            except CodecError:
                pass  # the flow records it in doubt (and encodes again, to raise the same error)
            else:
                store.complete(identity.key, record.token, text, spec.retention)
                return ran.value
        return self._loop(flow, flow.finish(record, ran), call)

    def _loop(self, flow: Flow[Any], gen: Generator[Op, Any, Any], call: Callable[[], Any]) -> Any:
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = gen.send(answer) if error is None else gen.throw(error)
            except StopIteration as stop:
                return stop.value
            answer, error = None, None
            try:
                if isinstance(op, Execute):
                    answer = self._execute(flow, op.token, call)
                elif isinstance(op, Sleep):
                    self._sleep(op.seconds)
                elif isinstance(op, Reconcile):
                    answer = self._reconciled(flow, op)
                elif isinstance(op, Probe):
                    answer = self._probe(op)
                else:
                    answer = self._store_op(flow, op)
            except BaseException as exc:
                error = exc

    async def _drive_async(self, plan: _Plan, flow: Flow[Any], call: Callable[[], Awaitable[Any]]) -> Any:
        if tracing():
            with EffectSpan(plan.name, plan.counted, flow):
                return await self._settle_async(flow, call)
        try:
            return await self._settle_async(flow, call)
        finally:
            effect_counter.add(1, plan.counted[flow.outcome])

    async def _settle_async(self, flow: Flow[Any], call: Callable[[], Awaitable[Any]]) -> Any:
        """The async twin of :meth:`_settle`."""
        spec, identity, store = flow.spec, flow.identity, self.store
        native = self._native
        if not self._offload:
            claim = store.claim(identity, flow.fingerprint, spec.lease)
        else:
            tried = None
            if native is not None:
                try:
                    tried = await native.aclaim(identity, flow.fingerprint, spec.lease)
                except WriteCancelled as cancelled:
                    await self._give_back(flow, cancelled.outcome)
                    raise
            claim = await self._store_op_in_thread(flow, _CLAIM) if tried is None else tried
        record = claim.record
        action = decide(claim, flow.fingerprint, identity.name)
        if action is _REPLAY:
            return flow.replay(record)
        if action is not _EXECUTE:
            return await self._loop_async(flow, flow.run(claim), call)
        ran = await self._execute_async(flow, record.token, call)
        if ran.error is None:
            try:
                text = spec.codec.encode(ran.value)
            except CodecError:
                pass  # the flow records it in doubt (and encodes again, to raise the same error)
            else:
                if not self._offload:
                    store.complete(identity.key, record.token, text, spec.retention)
                elif (
                    native is None
                    or await native.acomplete(identity.key, record.token, text, spec.retention) is None
                ):
                    await self._store_op_in_thread(flow, Complete(record.token, text))
                return ran.value
        return await self._loop_async(flow, flow.finish(record, ran), call)

    async def _loop_async(
        self, flow: Flow[Any], gen: Generator[Op, Any, Any], call: Callable[[], Awaitable[Any]]
    ) -> Any:
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = gen.send(answer) if error is None else gen.throw(error)
            except StopIteration as stop:
                return stop.value
            answer, error = None, None
            try:
                if isinstance(op, Execute):
                    answer = await self._execute_async(flow, op.token, call)
                elif isinstance(op, Sleep):
                    await self._async_sleep(op.seconds)
                elif isinstance(op, Reconcile):
                    handle = self.heartbeater.register(
                        flow.identity.key, op.request.record.token, flow.spec.lease
                    )
                    try:
                        answer = reconciled(flow, op.request)
                        if inspect.isawaitable(answer):
                            answer = await settled(answer)
                    finally:
                        self.heartbeater.unregister(handle)
                elif isinstance(op, Probe):
                    answer = self._probe(op)  # a read of /proc: no thread needed
                elif self._offload:
                    answer = await self._store_op_in_thread(flow, op)
                else:
                    answer = self._store_op(flow, op)
            except BaseException as exc:
                error = exc

    async def _store_op_in_thread(self, flow: Flow[Any], op: Op) -> Any:
        pending = submit(self._store_op, flow, op)
        if not isinstance(op, Claim):
            return await pending  # cancelled: the thread records on regardless
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            # The thread runs on regardless; what it claims for this cancelled call is given back.
            with contextlib.suppress(Exception):
                await self._give_back(flow, await pending)
            raise

    async def _give_back(self, flow: Flow[Any], claimed: Any) -> None:
        """Release a claim made for a call cancelled before it ran (``claimed``: what the claim
        returned, or the error it raised), or it would look like a crash, and an effect that never
        ran would be in doubt."""
        if isinstance(claimed, ClaimResult):
            release = abandon(claimed)
            if release is not None:
                with contextlib.suppress(Exception):
                    await in_thread(self._store_op, flow, release)

    def _execute(self, flow: Flow[Any], token: int, call: Callable[[], Any]) -> Ran:
        handle = self.heartbeater.register(flow.identity.key, token, flow.spec.lease)
        try:
            retry: Retrier | None = None  # built on the first failure only
            attempt = 1
            while True:
                reset = _current_effect.set(self._context(flow, token, attempt))
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
            self.heartbeater.unregister(handle)

    async def _execute_async(self, flow: Flow[Any], token: int, call: Callable[[], Awaitable[Any]]) -> Ran:
        handle = self.heartbeater.register(flow.identity.key, token, flow.spec.lease)
        try:
            retry: Retrier | None = None  # built on the first failure only
            attempt = 1
            while True:
                reset = _current_effect.set(self._context(flow, token, attempt))
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
                await self._async_sleep(pause)
        finally:
            self.heartbeater.unregister(handle)
