"""The guard: claim before, record after, replay on re-run, resolve what a crash left in doubt.

::

    guard = Guard(open_store("sqlite:///sagaguard.db"))

    @guard.effect("stripe.charge", reconciler=find_charge, permanent=(CardDeclined,))
    def charge(customer: str, amount: int) -> Receipt:
        return psp.charge(customer, amount, idempotency_key=current_effect().provider_key)

    with scope("order-42"):
        charge("cus_1", 1000)   # runs once; a re-run of this block replays the receipt

This module declares effects (:class:`Guard`, its decorators and :class:`Operation`); the decisions
live in :mod:`sagaguard.idempotency.flow`, and :mod:`sagaguard.idempotency.driving` drives them, once for sync
code and once for async code.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
import typing
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Generic, ParamSpec, TypeVar, Unpack, cast, overload

from sagaguard.idempotency.checks import seconds, storable_text
from sagaguard.idempotency.driving import AsyncDriver, SyncDriver
from sagaguard.idempotency.effect import Classifier, Policy, ReconcileRequest, Retry
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.flow import EffectSpec, Flow
from sagaguard.idempotency.heartbeat import Heartbeater
from sagaguard.idempotency.keys import (
    LEGACY_LEDGER,
    EffectIdentity,
    check_ledger_id,
    current_scope,
    fingerprint,
    key_deriver,
)
from sagaguard.idempotency.keys import provider_key as derive_provider_key
from sagaguard.idempotency.options import (
    FingerprintSpec,
    RunOptions,
    binder,
    build_spec,
    check_run_options,
    check_sync_reconciler,
    fingerprint_selector,
)
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.telemetry import EffectNaming, Outcome, counter_attributes, effect_naming

__all__ = ["DEFAULT_LEASE", "DEFAULT_WAIT", "FingerprintSpec", "Guard", "Operation"]

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

_OPERATIONS_KEPT = 256
"""Operations :meth:`Guard.run` keeps built, by name and options; past this many it starts afresh."""


class Plan:
    """One effect, prepared once for every call: its spec, its key deriver, its telemetry."""

    __slots__ = ("counted", "derive", "name", "namespace", "naming", "spec")

    def __init__(self, spec: EffectSpec[Any], namespace: str, tool: bool = False) -> None:
        self.spec = spec
        self.name = spec.name
        self.namespace = namespace
        self.derive: Callable[[str, int], str] = key_deriver(namespace, spec.name)
        self.counted: dict[Outcome, dict[str, str]] = counter_attributes(spec.name)
        self.naming: EffectNaming = effect_naming(spec.name, tool=tool)


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

    def __init__(self, guard: Guard, plan: Plan, async_reconciler: bool) -> None:
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
        return cast(T, guard._driver(self._plan, guard._flow(self._plan, args, args, key), fn))

    async def arun(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        arguments: Mapping[str, Any] | None = None,
        key: str | None = None,
    ) -> T:
        """The async twin of :meth:`run`."""
        guard, args = self._guard, dict(arguments or {})
        return cast(T, await guard._async_driver(self._plan, guard._flow(self._plan, args, args, key), fn))


class Guard:
    """Wraps calls that change the world so each happens once per identity.

    Args:
        store: the effect ledger.
        namespace: the tenant; part of every key's hash, so tenants never replay each other.
        lease: seconds a claim is owned before another worker may take it over (renewed in the
            background while a call runs, and while a reconciler runs). A claim whose holder died
            on this host is taken over at once, whatever its lease (see :mod:`sagaguard.idempotency.holder`).
        retention: seconds a finished record is kept (and replayed) before it may be purged.
        wait: seconds a duplicate call waits, in total, for a live claim before ``AlreadyInProgress``.
        sleep: the sleep used between waits and retries (inject one in tests).
        async_sleep: the same for async calls.
        offload: whether async calls run store I/O in a worker thread, so the event loop never
            blocks on a commit. None (default): the store's ``offload_async`` attribute decides
            (SQL: yes, a commit waits on the disk or the server; Redis and memory: no, see
            docs/backends.md).

    Raises:
        ConfigurationError: ``lease``, ``retention`` or ``wait`` is not a finite number of seconds
            (> 0; ``wait`` may be 0), naming the option; ``namespace`` is not storable text (a NUL
            character; a lone surrogate raises CodecError).
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
        self.namespace = storable_text("namespace", namespace, empty_ok=True)
        self.lease = seconds("lease", lease)
        self.retention = seconds("retention", retention)
        self.wait = seconds("wait", wait, zero_ok=True)
        # By default the store says: a commit that waits on fsync or a server (SQL) goes to a
        # thread; a sub-millisecond round trip (Redis, memory) costs less than the thread hop.
        self._offload = bool(getattr(store, "offload_async", True)) if offload is None else offload
        self._driver = SyncDriver(self, sleep)
        self._async_driver = AsyncDriver(self, async_sleep, self._offload)
        self.heartbeater = Heartbeater(store)
        self._operations: dict[Any, Operation[Any]] = {}
        self._ledger: str | None = None

    @property
    def ledger_id(self) -> str:
        """The store's ledger id (:meth:`IdempotencyStore.ledger_id
        <sagaguard.idempotency.store.IdempotencyStore.ledger_id>`), read once; the empty id for a
        store that has none (one written before ledger ids: the keys it always derived)."""
        if self._ledger is None:
            read = getattr(self.store, "ledger_id", None)
            self._ledger = LEGACY_LEDGER if read is None else check_ledger_id(read())
        return self._ledger

    def provider_key(self, identity: EffectIdentity) -> str:
        """The provider key this guard sends for ``identity``'s effect (what
        :attr:`EffectContext.provider_key` is inside the call): of its key in this guard's ledger.
        Use it to re-derive the key outside the call (an undo, a reconciler, a lookup), e.g.
        ``guard.provider_key(EffectIdentity.of(guard.namespace, scope, "pay.charge", 0))``.

        Raises:
            StoreUnavailable: the ledger id was not read yet and the store cannot be reached.
        """
        return derive_provider_key(identity.key, self.ledger_id)

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
        tool: bool = False,
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
            tool: the effect is an agent's tool call (the framework adapters set it): its span
                is ``execute_tool {name}`` (GenAI conventions) instead of ``sagaguard.effect {name}``.

        Raises:
            CodecError: the result type cannot be stored as JSON (raised when decorating).
            ConfigurationError: any other bad option.
        """
        options = {
            "result_type": result_type, "policy": policy, "provider_idempotent": provider_idempotent,
            "provider_window": provider_window, "reconciler": reconciler, "classify": classify,
            "permanent": permanent, "retryable": retryable, "retry": retry, "fingerprint": fingerprint,
            "key": key, "lease": lease, "retention": retention, "wait": wait, "tool": tool,
        }  # fmt: skip
        return EffectDecorator(self, name, options)

    def _plan(self, name: str, result_type: Any, options: Mapping[str, Any]) -> Plan:
        defaults = {"lease": self.lease, "retention": self.retention, "wait": self.wait}
        tool = options.get("tool", False)
        if not isinstance(tool, bool):
            raise ConfigurationError(f"tool= takes True or False, got {tool!r}")
        return Plan(build_spec(name, result_type, options, **defaults), self.namespace, tool)

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

        def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Flow[Any]:
            arguments = bind(args, kwargs)
            key = None if key_fn is None else key_fn(**arguments)
            return self._flow(plan, arguments, select(arguments), key)

        if is_async:
            afn = cast(Callable[..., Coroutine[Any, Any, Any]], fn)

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                flow = prepare(args, kwargs)
                return await self._async_driver(plan, flow, lambda: afn(*args, **kwargs))

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            flow = prepare(args, kwargs)
            return self._driver(plan, flow, lambda: fn(*args, **kwargs))

        return wrapper

    # -- the explicit API ---------------------------------------------------------------------

    def operation(
        self, name: str, *, result_type: Any = Any, **options: Unpack[RunOptions]
    ) -> Operation[Any]:
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

    def _operation(self, name: str, result_type: Any, options: RunOptions) -> Operation[Any]:
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
        **options: Unpack[RunOptions],
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
                :mod:`sagaguard.idempotency.errors`; and whatever ``fn`` raises for a not-applied
                failure.
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
        **options: Unpack[RunOptions],
    ) -> T:
        """The async twin of :meth:`run`."""
        operation = self._operation(name, result_type, options)
        return cast(T, await operation.arun(fn, arguments=arguments, key=key))

    def close(self) -> None:
        """Stop the heartbeat thread. The store is the caller's to close."""
        self.heartbeater.close()

    # -- building a flow -----------------------------------------------------------------------

    def _flow(
        self,
        plan: Plan,
        arguments: Mapping[str, Any],
        printed: Mapping[str, Any],
        key: str | None,
    ) -> Flow[Any]:
        """One call of ``plan``'s effect: its identity (``key``, or the scope and the effect's next
        ordinal in it) and the fingerprint of ``printed``."""
        fp = fingerprint(printed)
        name = plan.name
        if key is not None:
            identity = EffectIdentity.explicit(
                plan.namespace, key, name, self.ledger_id, plan.spec.codec.type_name
            )
        else:
            unit = current_scope()
            ordinal = unit.next_ordinal(name)
            key = plan.derive(unit.id, ordinal)
            identity = EffectIdentity(
                plan.namespace, unit.id, name, ordinal, key, self.ledger_id, plan.spec.codec.type_name
            )
        return Flow(plan.spec, identity, fp, arguments)
