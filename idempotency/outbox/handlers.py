"""The :class:`Outbox`: a table, its handlers, and guarded effects that can be deferred through it.

::

    outbox = Outbox()

    @outbox.handler("email.receipt")
    def send_receipt(message: Message) -> None:
        mailer.send(message.payload["to"], idempotency_key=message.provider_key)

    @outbox.effect(guard, "stripe.refund")          # a guarded effect, inline or deferred
    def refund(charge_id: str, amount: int) -> Refund: ...

    refund("ch_1", 500)                            # inline: runs now, once (the guard)
    refund.defer(session, "ch_1", 500)             # deferred: a message in the caller's transaction;
                                                   # a relay runs it after commit, once (the guard)

A deferred effect runs under the guard in the scope ``outbox/<message id>``, so a redelivery (a
relay died after the call, before its ack) replays the recorded result instead of calling again,
and its provider key is the message's :attr:`~sagaguard.idempotency.outbox.Message.provider_key`.

Deferring is itself once per effect: inside a scope, :meth:`DeferredEffect.defer` enqueues under the
effect's key (scope + name + ordinal, as an inline call would be keyed) as the message's dedup key,
so a unit of work that runs again (a step re-run after a crash, before or after its transaction
committed) finds the message it enqueued the first time instead of enqueueing a second one.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

import sqlalchemy as sa

from sagaguard.idempotency.checks import count, storable_text
from sagaguard.idempotency.codec import Codec
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.keys import EffectIdentity, current_scope, scope
from sagaguard.idempotency.outbox.control import OutboxControl
from sagaguard.idempotency.outbox.enqueue import DEFAULT_MAX_ATTEMPTS, MAX_PAYLOAD_BYTES, aenqueue, enqueue
from sagaguard.idempotency.outbox.model import DEFAULT_TABLE, check_table_name, migrate, uuid7
from sagaguard.idempotency.outbox.records import Message

if TYPE_CHECKING:
    from sagaguard.idempotency.guard import Guard
    from sagaguard.idempotency.outbox.relay import Relay

__all__ = ["DeferredEffect", "Outbox"]

P = ParamSpec("P")
R = TypeVar("R")

Handler = Callable[[Message], Any]

EFFECT_AGGREGATE = "sagaguard.effect"
"""The default ``aggregatetype`` of deferred effects."""


class Outbox:
    """One outbox table and the handlers that deliver its messages.

    Args:
        table_name: the outbox table (several outboxes may share a database under other names).
        clock: seconds since the epoch for enqueued rows (tests); default: the database's clock.
        max_attempts: deliveries tried before a message is dead-lettered (per message overridable).
        max_payload_bytes: larger payloads are refused at enqueue.

    Raises:
        ConfigurationError: a bad table name, or ``max_attempts`` or ``max_payload_bytes`` not an
            int >= 1 (naming the option), at construction rather than at the first enqueue.
    """

    def __init__(
        self,
        table_name: str = DEFAULT_TABLE,
        *,
        clock: Callable[[], float] | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        self.table_name = check_table_name(table_name)
        self.clock = clock
        self.max_attempts = count("max_attempts", max_attempts)
        self.max_payload_bytes = count("max_payload_bytes", max_payload_bytes)
        self.handlers: dict[str, Handler] = {}
        """Message type -> handler. Relays look handlers up here for every message."""

    # -- handlers ------------------------------------------------------------------------------

    def register(self, type: str, handler: Handler) -> None:
        """Deliver messages of ``type`` to ``handler`` (a sync or async callable of a Message).

        Raises:
            ConfigurationError: ``type`` already has a handler or is not storable text (empty, a NUL
                character; a lone surrogate: CodecError), or ``handler`` is not callable.
        """
        storable_text("a message type", type)
        if not callable(handler):
            raise ConfigurationError(f"the handler of {type!r} must be callable")
        if type in self.handlers:
            raise ConfigurationError(f"message type {type!r} already has a handler")
        self.handlers[type] = handler

    def handler(self, type: str) -> Callable[[Callable[[Message], R]], Callable[[Message], R]]:
        """Decorator form of :meth:`register`; returns the function unchanged."""

        def decorate(fn: Callable[[Message], R]) -> Callable[[Message], R]:
            self.register(type, fn)
            return fn

        return decorate

    # -- producing -----------------------------------------------------------------------------

    def enqueue(
        self,
        session: Any,
        type: str,
        payload: Any = None,
        *,
        aggregate_type: str | None = None,
        aggregate_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        provider_key: str | None = None,
        dedup_key: str | None = None,
        delay: float = 0.0,
        max_attempts: int | None = None,
        message_id: Any = None,
    ) -> str:
        """:func:`~sagaguard.idempotency.outbox.enqueue` into this outbox's table, with its clock and
        limits."""
        return enqueue(session, type, payload, **self._options(locals()))

    async def aenqueue(
        self,
        session: Any,
        type: str,
        payload: Any = None,
        *,
        aggregate_type: str | None = None,
        aggregate_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        provider_key: str | None = None,
        dedup_key: str | None = None,
        delay: float = 0.0,
        max_attempts: int | None = None,
        message_id: Any = None,
    ) -> str:
        """:func:`~sagaguard.idempotency.outbox.aenqueue` (an ``AsyncSession``) into this outbox's table."""
        return await aenqueue(session, type, payload, **self._options(locals()))

    def _options(self, given: dict[str, Any]) -> dict[str, Any]:
        options = {k: v for k, v in given.items() if k not in ("self", "session", "type", "payload")}
        if options["max_attempts"] is None:
            options["max_attempts"] = self.max_attempts
        options.update(table_name=self.table_name, clock=self.clock, max_payload_bytes=self.max_payload_bytes)
        return options

    def effect(
        self,
        guard: Guard,
        name: str,
        *,
        aggregate_type: str = EFFECT_AGGREGATE,
        aggregate_id: Callable[[Mapping[str, Any]], str] | None = None,
        max_attempts: int | None = None,
        **options: Any,
    ) -> Callable[[Callable[P, R]], DeferredEffect[P, R]]:
        """Declare a guarded effect (``guard.effect(name, **options)``) that can also be deferred.

        Args:
            guard: the guard that records the effect.
            name: the effect's name; also the message type of its deferred calls.
            aggregate_type: ``aggregatetype`` of its messages.
            aggregate_id: the aggregate of a deferred call, from its bound arguments (messages of
                one aggregate are delivered in order). Default: the current scope's id if one is
                set (so the effects one unit of work defers keep their order), else none.
            max_attempts: deliveries before a deferred call is dead-lettered.
            options: as for :meth:`Guard.effect`.

        Raises:
            ConfigurationError, CodecError: as :meth:`Guard.effect`, or a parameter whose type
                cannot travel as JSON, or ``*args``/``**kwargs`` parameters.
        """

        def decorate(fn: Callable[P, R]) -> DeferredEffect[P, R]:
            return DeferredEffect(
                self,
                guard,
                name,
                fn,
                aggregate_type=aggregate_type,
                aggregate_id=aggregate_id,
                max_attempts=max_attempts,
                options=options,
            )

        return decorate

    # -- operating -----------------------------------------------------------------------------

    def create_tables(self, engine: sa.Engine) -> int:
        """Create or migrate this outbox's table (see :func:`~sagaguard.idempotency.outbox.migrate`)."""
        return migrate(engine, self.table_name)

    def relay(self, engine: sa.Engine | str, **settings: Any) -> Relay:
        """A :class:`~sagaguard.idempotency.outbox.Relay` for this outbox (``settings``: RelaySettings
        fields)."""
        from sagaguard.idempotency.outbox.policy import RelaySettings
        from sagaguard.idempotency.outbox.relay import Relay

        return Relay(self, engine, RelaySettings(**settings), clock=self.clock)

    def control(self, engine: sa.Engine) -> OutboxControl:
        """The operator controls of this outbox's table."""
        return OutboxControl(engine, self.table_name, clock=self.clock)


class DeferredEffect(Generic[P, R]):
    """A guarded effect that runs inline when called, or later through the outbox with
    :meth:`defer`. Made by :meth:`Outbox.effect`."""

    def __init__(
        self,
        outbox: Outbox,
        guard: Guard,
        name: str,
        fn: Callable[P, R],
        *,
        aggregate_type: str,
        aggregate_id: Callable[[Mapping[str, Any]], str] | None,
        max_attempts: int | None,
        options: Mapping[str, Any],
    ) -> None:
        self._outbox = outbox
        self._guard = guard
        self.name = name
        self._aggregate_type = aggregate_type
        self._aggregate_id = aggregate_id
        self._max_attempts = max_attempts
        self._signature = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn)
        except NameError as exc:
            raise ConfigurationError(f"cannot resolve the annotations of {name}: {exc}") from exc
        self._codecs: dict[str, Codec[Any]] = {}
        for param in self._signature.parameters.values():
            if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise ConfigurationError(f"{name}: a deferrable effect cannot take *args or **kwargs")
            self._codecs[param.name] = Codec(hints.get(param.name, Any))
        self._guarded: Callable[..., Any] = guard.effect(name, **options)(fn)
        self._async = inspect.iscoroutinefunction(fn)
        outbox.register(name, self._deliver_async if self._async else self._deliver)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the effect now, once, under the guard."""
        return typing.cast(R, self._guarded(*args, **kwargs))

    def defer(self, session: Any, /, *args: P.args, **kwargs: P.kwargs) -> str:
        """Enqueue the call in ``session``: a relay runs it, once, after the session commits.

        Inside a scope the call is enqueued once per effect: its dedup key is the effect key
        (scope, name, ordinal), so deferring it again when the unit of work re-runs, in this
        transaction or a later one, enqueues nothing and returns the message already there (until it
        is purged after delivery). Outside any scope every call enqueues a new message.

        Returns:
            The message id.

        Raises:
            KeyConflict: this effect was deferred with other arguments.
            CodecError: an argument cannot travel as JSON.
            ConfigurationError: the arguments do not fit the signature; or ``session`` is an
                ``AsyncSession`` inside a scope (``await`` :meth:`adefer`).
        """
        return self._outbox.enqueue(session, self.name, **self._message(args, kwargs))

    async def adefer(self, session: Any, /, *args: P.args, **kwargs: P.kwargs) -> str:
        """:meth:`defer` into an ``AsyncSession`` (the row is inserted at once, in its transaction)."""
        return await self._outbox.aenqueue(session, self.name, **self._message(args, kwargs))

    def _message(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The enqueue arguments of a deferred call (consumes the effect's ordinal in its scope)."""
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigurationError(f"{self.name}: {exc}") from exc
        bound.apply_defaults()
        arguments = bound.arguments
        payload = {name: json.loads(self._codecs[name].encode(value)) for name, value in arguments.items()}
        message_id = uuid7(None if self._outbox.clock is None else self._outbox.clock())
        try:
            unit = current_scope()
        except ConfigurationError:
            unit = None
        dedup_key = None
        if unit is not None:
            # Keyed as an inline call of the effect would be at this point of the unit of work.
            ordinal = unit.next_ordinal(self.name)
            dedup_key = EffectIdentity.of(self._guard.namespace, unit.id, self.name, ordinal).key
        if self._aggregate_id is not None:
            aggregate = self._aggregate_id(arguments)
        else:
            aggregate = unit.id if unit is not None else str(message_id)
        # The effect the relay runs for the message, in this guard's ledger: its provider key is
        # the one the handler's guarded call derives (current_effect().provider_key).
        scope_id = _scope_of(str(message_id))
        identity = EffectIdentity.of(self._guard.namespace, scope_id, self.name, 0, self._guard.ledger_id)
        return {
            "payload": payload,
            "aggregate_type": self._aggregate_type,
            "aggregate_id": aggregate,
            "provider_key": identity.provider_key,
            "dedup_key": dedup_key,
            "max_attempts": self._max_attempts,
            "message_id": message_id,
        }

    def _arguments(self, message: Message) -> dict[str, Any]:
        payload = message.payload
        if not isinstance(payload, dict):
            raise ConfigurationError(f"{self.name}: the message payload is not an arguments object")
        return {name: self._codecs[name].decode(json.dumps(value)) for name, value in payload.items()}

    def _deliver(self, message: Message) -> Any:
        arguments = self._arguments(message)
        with scope(_scope_of(message.id)):
            return self._guarded(**arguments)

    async def _deliver_async(self, message: Message) -> Any:
        arguments = self._arguments(message)
        with scope(_scope_of(message.id)):
            call = typing.cast(Callable[..., Coroutine[Any, Any, Any]], self._guarded)
            return await call(**arguments)


def _scope_of(message_id: str) -> str:
    return f"outbox/{message_id}"
