"""The guard: claim before, record after, replay on re-run, resolve what a crash left in doubt.

::

    guard = Guard(open_store("sqlite:///sagaguard.db"))

    @guard.effect("stripe.charge", reconciler=find_charge, permanent=(CardDeclined,))
    def charge(customer: str, amount: int) -> Receipt:
        return psp.charge(customer, amount, idempotency_key=current_effect().provider_key)

    with scope("order-42"):
        charge("cus_1", 1000)   # runs once; a re-run of this block replays the receipt

The decisions live in :mod:`idempotency.flow`; this module only drives them, once for sync code and
once for async code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
import typing
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar, cast, overload

import tenacity
from opentelemetry import context as otel_context
from opentelemetry import trace

from idempotency.codec import Codec
from idempotency.effect import (
    NO_RETRY,
    Classifier,
    EffectContext,
    Policy,
    ReconcileRequest,
    Retry,
    Unknown,
    _current_effect,
)
from idempotency.errors import ConfigurationError
from idempotency.flow import (
    Claim,
    Complete,
    EffectSpec,
    Execute,
    Fail,
    Flow,
    Op,
    Ran,
    Reconcile,
    Sleep,
    abandon,
)
from idempotency.heartbeat import Heartbeater
from idempotency.keys import EffectIdentity, current_scope, fingerprint
from idempotency.store import IdempotencyStore
from idempotency.telemetry import effect_counter, span_attributes, tracer

__all__ = ["Guard"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

log = logging.getLogger("sagaguard.guard")

DAY = 86_400.0

_NEVER_RETRIED = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)

FingerprintSpec = bool | Sequence[str] | Callable[[Mapping[str, Any]], Mapping[str, Any]] | None
"""Which arguments enter the fingerprint: all (None/True), none (False), the named ones, or a
function of the bound arguments."""


@functools.lru_cache(maxsize=512)
def _codec(tp: Any) -> Codec[Any]:
    return Codec(tp)


def _codec_for(tp: Any) -> Codec[Any]:
    try:
        return _codec(tp)
    except TypeError:  # unhashable annotation
        return Codec(tp)


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


class Guard:
    """Wraps calls that change the world so each happens once per identity.

    Args:
        store: the effect ledger.
        namespace: the tenant; part of every key's hash, so tenants never replay each other.
        lease: seconds a claim is owned before another worker may take it over (renewed in the
            background while a call runs).
        retention: seconds a finished record is kept (and replayed) before it may be purged.
        wait: seconds a duplicate call waits, in total, for a live claim before ``AlreadyInProgress``.
        sleep: the sleep used between waits and retries (inject one in tests).
        async_sleep: the same for async calls.
        offload: whether async calls run store I/O in a worker thread, so the event loop never
            blocks on a commit. None (default): the store's ``offload_async`` attribute decides
            (SQL: yes; Redis and memory: no, one round trip costs less than two thread hops).
    """

    def __init__(
        self,
        store: IdempotencyStore,
        *,
        namespace: str = "default",
        lease: float = 60.0,
        retention: float = 7 * DAY,
        wait: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        offload: bool | None = None,
    ) -> None:
        if lease <= 0 or retention <= 0 or wait < 0:
            raise ConfigurationError("lease and retention must be > 0 and wait >= 0")
        self.store = store
        self.namespace = namespace
        self.lease = lease
        self.retention = retention
        self.wait = wait
        self._sleep = sleep
        self._async_sleep = async_sleep
        # By default the store says: a commit that waits on fsync (SQL) goes to a thread; a
        # sub-millisecond round trip (Redis, memory) costs less than the two thread hops.
        self._offload = bool(getattr(store, "offload_async", True)) if offload is None else offload
        self.heartbeater = Heartbeater(store)

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
        return EffectDecorator(self, name, _options(locals()))

    def _spec(self, name: str, result_type: Any, options: Mapping[str, Any]) -> EffectSpec[Any]:
        try:
            policy = Policy(options.get("policy", Policy.AT_MOST_ONCE))
        except ValueError as exc:
            raise ConfigurationError(f"unknown policy {options.get('policy')!r}") from exc
        lease = _seconds(options, "lease", self.lease, zero_ok=False)
        retention = _seconds(options, "retention", self.retention, zero_ok=False)
        wait = _seconds(options, "wait", self.wait, zero_ok=True)
        window = options.get("provider_window")
        provider_window = None if window is None else _seconds(options, "provider_window", 0, zero_ok=False)
        for label in ("permanent", "retryable"):
            value = options.get(label, ())
            if not isinstance(value, tuple | list) or not all(
                isinstance(t, type) and issubclass(t, BaseException) for t in value
            ):
                raise ConfigurationError(f"{label}= takes a tuple of exception types, got {value!r}")
        for label in ("reconciler", "classify"):
            if options.get(label) is not None and not callable(options[label]):
                raise ConfigurationError(f"{label}= must be callable")
        retry = options.get("retry")
        if retry is not None and not isinstance(retry, Retry):
            raise ConfigurationError(f"retry= takes a Retry, got {retry!r}")
        return EffectSpec(
            name=name,
            codec=_codec_for(result_type),
            policy=policy,
            provider_idempotent=bool(options.get("provider_idempotent", False)),
            reconciler=options.get("reconciler"),
            classifier=options.get("classify"),
            permanent=tuple(options.get("permanent", ())),
            retryable=tuple(options.get("retryable", ())),
            retry=retry or Retry(),
            lease=lease,
            retention=retention,
            wait=wait,
            provider_window=provider_window,
        )

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
        spec = self._spec(effect_name, result_type, options)
        if not inspect.iscoroutinefunction(fn):
            _check_sync_reconciler(effect_name, options)
        signature = inspect.signature(fn)
        select = _fingerprint_selector(options.get("fingerprint"), signature)
        key_fn: Callable[..., str] | None = options.get("key")

        bind = _binder(signature, effect_name)

        def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Flow[Any]:
            arguments = bind(args, kwargs)
            explicit = key_fn(**arguments) if key_fn is not None else None
            return self._flow(spec, arguments, select(arguments), explicit)

        if inspect.iscoroutinefunction(fn):
            afn = cast(Callable[..., Coroutine[Any, Any, Any]], fn)

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                flow = prepare(args, kwargs)
                return await self._drive_async(flow, lambda: afn(*args, **kwargs))

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            flow = prepare(args, kwargs)
            return self._drive(flow, lambda: fn(*args, **kwargs))

        return wrapper

    # -- the explicit API ---------------------------------------------------------------------

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
        _check_run_options(options)
        _check_sync_reconciler(name, options)
        spec = self._spec(name, result_type, options)
        args = dict(arguments or {})
        return cast(T, self._drive(self._flow(spec, args, args, key), fn))

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
        _check_run_options(options)
        spec = self._spec(name, result_type, options)
        args = dict(arguments or {})
        return cast(T, await self._drive_async(self._flow(spec, args, args, key), fn))

    def close(self) -> None:
        """Stop the heartbeat thread. The store is the caller's to close."""
        self.heartbeater.close()

    # -- driving a flow ------------------------------------------------------------------------

    def _flow(
        self,
        spec: EffectSpec[Any],
        arguments: Mapping[str, Any],
        printed: Mapping[str, Any],
        key: str | None,
    ) -> Flow[Any]:
        fp = fingerprint(printed)
        if key is not None:
            identity = EffectIdentity.explicit(self.namespace, key, spec.name)
        else:
            unit = current_scope()
            identity = EffectIdentity.of(self.namespace, unit.id, spec.name, unit.next_ordinal(spec.name))
        return Flow(spec, identity, fp, arguments)

    def _store_op(self, flow: Flow[Any], op: Op) -> Any:
        spec, key = flow.spec, flow.identity.key
        if isinstance(op, Claim):
            return self.store.claim(flow.identity, flow.fingerprint, spec.lease)
        if isinstance(op, Complete):
            return self.store.complete(key, op.token, op.result, spec.retention)
        if isinstance(op, Fail):
            return self.store.fail(key, op.token, op.disposition, op.error, spec.retention)
        raise AssertionError(op)  # pragma: no cover

    def _context(self, flow: Flow[Any], token: int, attempt: int) -> EffectContext:
        identity, lease = flow.identity, flow.spec.lease
        return EffectContext(
            identity,
            token,
            attempt,
            functools.partial(self.heartbeater.beat, identity.key, token, lease),
        )

    def _drive(self, flow: Flow[Any], call: Callable[[], Any]) -> Any:
        with _Span(flow):
            gen = flow.run()
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
                        answer = _reconciled(flow, op.request)
                    else:
                        answer = self._store_op(flow, op)
                except BaseException as exc:
                    error = exc

    async def _drive_async(self, flow: Flow[Any], call: Callable[[], Awaitable[Any]]) -> Any:
        with _Span(flow):
            gen = flow.run()
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
                        answer = _reconciled(flow, op.request)
                        if inspect.isawaitable(answer):
                            answer = await _settle(answer)
                    elif self._offload:
                        answer = await self._store_op_in_thread(flow, op)
                    else:
                        answer = self._store_op(flow, op)
                except BaseException as exc:
                    error = exc

    async def _store_op_in_thread(self, flow: Flow[Any], op: Op) -> Any:
        pending = asyncio.ensure_future(asyncio.to_thread(self._store_op, flow, op))
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            # The thread runs on regardless. A claim it makes for this cancelled call is given
            # back, or it would look like a crash and an effect that never ran would be in doubt.
            if isinstance(op, Claim):
                with contextlib.suppress(Exception):
                    release = abandon(await pending)
                    if release is not None:
                        await asyncio.to_thread(self._store_op, flow, release)
            raise

    def _execute(self, flow: Flow[Any], token: int, call: Callable[[], Any]) -> Ran:
        handle = self.heartbeater.register(flow.identity.key, token, flow.spec.lease)
        try:
            retry = _Retrier(flow.spec)
            while True:
                reset = _current_effect.set(self._context(flow, token, retry.attempt))
                try:
                    return Ran(call())
                except BaseException as exc:
                    pause = retry.next_pause(exc)
                    if pause is None:
                        return Ran(error=exc)
                finally:
                    _current_effect.reset(reset)
                self._sleep(pause)
        finally:
            self.heartbeater.unregister(handle)

    async def _execute_async(self, flow: Flow[Any], token: int, call: Callable[[], Awaitable[Any]]) -> Ran:
        handle = self.heartbeater.register(flow.identity.key, token, flow.spec.lease)
        try:
            retry = _Retrier(flow.spec)
            while True:
                reset = _current_effect.set(self._context(flow, token, retry.attempt))
                try:
                    return Ran(await call())
                except BaseException as exc:
                    if isinstance(exc, asyncio.CancelledError):
                        # Cancelled mid-call: the effect may have been sent. Record it in doubt, then
                        # let the cancellation go on (the flow re-raises it after the record).
                        return Ran(error=exc)
                    pause = retry.next_pause(exc)
                    if pause is None:
                        return Ran(error=exc)
                finally:
                    _current_effect.reset(reset)
                await self._async_sleep(pause)
        finally:
            self.heartbeater.unregister(handle)


class _Retrier:
    """In-claim retries: tenacity's stop and wait strategies, consulted only after a failure."""

    __slots__ = ("_spec", "_state", "attempt")

    def __init__(self, spec: EffectSpec[Any]) -> None:
        self._spec = spec
        self._state: tenacity.RetryCallState | None = None
        self.attempt = 1

    def next_pause(self, exc: BaseException) -> float | None:
        """Seconds to wait before the next try, or None to stop and report ``exc``."""
        spec = self._spec
        if isinstance(exc, _NEVER_RETRIED) or spec.retry is NO_RETRY or not spec.retries(exc):
            return None
        if self._state is None:
            self._state = tenacity.RetryCallState(cast(Any, None), None, (), {})
        state = self._state
        state.attempt_number = self.attempt
        state.set_exception((type(exc), exc, exc.__traceback__))
        if spec.retry.stop(state):
            return None
        pause = float(spec.retry.wait(state))
        self.attempt += 1
        return pause


def _reconciled(flow: Flow[Any], request: ReconcileRequest) -> Any:
    """Call the reconciler; an exception means it could not tell."""
    try:
        return flow.spec.reconciler(request)  # type: ignore[misc]
    except Exception as exc:
        log.warning("reconciler for %s failed; treating as unknown: %r", flow.spec.name, exc)
        return Unknown()


async def _settle(pending: Awaitable[Any]) -> Any:
    try:
        return await pending
    except Exception as exc:
        log.warning("async reconciler failed; treating as unknown: %r", exc)
        return Unknown()


class _Span:
    """The ``execute_tool {name}`` span and the outcome counter around one guarded call."""

    __slots__ = ("_flow", "_span", "_token")

    def __init__(self, flow: Flow[Any]) -> None:
        self._flow = flow

    def __enter__(self) -> None:
        # What ``tracer.start_as_current_span(..., record_exception=False,
        # set_status_on_exception=False)`` does, without its two nested generator context managers
        # (the proxy tracer's and the real one's), which cost more than the rest of the span on a
        # hot path: start the span, make it current; __exit__ detaches it, then ends it.
        name = self._flow.spec.name
        span = tracer.start_span(
            f"execute_tool {name}",
            kind=trace.SpanKind.INTERNAL,
            attributes=span_attributes(name),
            record_exception=False,
            set_status_on_exception=False,
        )
        self._token = otel_context.attach(trace.set_span_in_context(span))
        self._span = span

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        span = self._span
        try:
            outcome = self._flow.outcome.value
            if span.is_recording():
                span.set_attribute("sagaguard.effect.outcome", outcome)
                if tp is not None:
                    # The type only: messages may carry arguments, which stay off spans.
                    span.set_attribute("error.type", tp.__qualname__)
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
            effect_counter.add(
                1, {"sagaguard.effect.outcome": outcome, "gen_ai.tool.name": self._flow.spec.name}
            )
        finally:
            otel_context.detach(self._token)
            span.end()


def _binder(
    signature: inspect.Signature, effect_name: str
) -> Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]:
    """``signature.bind(*args, **kwargs)`` + ``apply_defaults()``, as the arguments dict.

    A call that passes every parameter of a plain signature (no ``/``, ``*``, ``*args`` or
    ``**kwargs``), the common case, is mapped directly: the same dict, in the same parameter order,
    that ``bind`` would build, without its general-purpose walk over the parameters.
    """
    params = signature.parameters.values()
    names = (
        tuple(p.name for p in params)
        if all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
        else None
    )

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if names is not None and len(args) + len(kwargs) == len(names):
            arguments = dict(zip(names, args, strict=False))
            if not kwargs:
                return arguments
            rest = names[len(args) :]
            if kwargs.keys() == set(rest):
                for name in rest:
                    arguments[name] = kwargs[name]
                return arguments
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigurationError(f"{effect_name}: {exc}") from exc
        bound.apply_defaults()
        return bound.arguments

    return bind


def _fingerprint_selector(
    spec: FingerprintSpec, signature: inspect.Signature
) -> Callable[[Mapping[str, Any]], Mapping[str, Any]]:
    if spec is None or spec is True:
        return lambda arguments: arguments
    if spec is False:
        return lambda arguments: {}
    if callable(spec):
        return spec
    names = list(spec)
    unknown = [n for n in names if n not in signature.parameters]
    if unknown:
        raise ConfigurationError(f"fingerprint= names unknown parameters: {unknown}")
    return lambda arguments: {n: arguments[n] for n in names}


_RUN_OPTIONS = frozenset(
    {
        "policy",
        "provider_idempotent",
        "provider_window",
        "reconciler",
        "classify",
        "permanent",
        "retryable",
        "retry",
        "lease",
        "retention",
        "wait",
    }
)
"""The options of :meth:`Guard.effect` that :meth:`Guard.run` takes (its ``arguments`` are the
fingerprint and its ``key`` the explicit key)."""


def _check_run_options(options: Mapping[str, Any]) -> None:
    # A typo (``polcy=``) must not silently fall back to the default policy.
    unknown = sorted(set(options) - _RUN_OPTIONS)
    if unknown:
        raise ConfigurationError(f"unknown options {unknown}; run() takes {sorted(_RUN_OPTIONS)}")


def _check_sync_reconciler(name: str, options: Mapping[str, Any]) -> None:
    # A sync call cannot await it: the reconciler would never run and the effect stay in doubt.
    if inspect.iscoroutinefunction(options.get("reconciler")):
        raise ConfigurationError(f"{name}: an async reconciler needs an async effect (or arun)")


def _seconds(options: Mapping[str, Any], label: str, default: float, *, zero_ok: bool) -> float:
    """A per-effect duration, or the guard's default when it is not given (None)."""
    value = options.get(label)
    if value is None:
        return float(default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or value < 0
        or (value == 0 and not zero_ok)
    ):
        raise ConfigurationError(
            f"{label}= must be a number of seconds {'>= 0' if zero_ok else '> 0'}, got {value!r}"
        )
    return float(value)


def _options(values: dict[str, Any]) -> dict[str, Any]:
    """The options of :meth:`Guard.effect` as a dict, without ``self`` and ``name``."""
    return {k: v for k, v in values.items() if k not in ("self", "name")}
