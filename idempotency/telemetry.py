"""OpenTelemetry for guarded effects: one span per call, a counter, and the conventions decided once.

- An agent's tool call (an effect declared with ``tool=True``, as the framework adapters do) is an
  ``execute_tool {name}`` span with the GenAI tool attributes; every other guarded effect (a Stripe
  refund, an email the relay sends, a compensation's bookkeeping) is a ``sagaguard.effect {name}``
  span. Both carry ``sagaguard.effect.name`` and ``sagaguard.effect.outcome``: :func:`effect_naming`.
- An ERROR span carries ``error.type``, the exception's fully-qualified type name: :func:`error_type`.
- Identifiers (saga id, scope, a business key) go on spans only when opted in, in one place:
  :func:`expose_identifiers`; see :func:`business_key`.

Depends on ``opentelemetry-api`` only: without an SDK configured every call here is a no-op. Raw keys,
arguments and results never go on spans (a replay is reported as ``replayed``, never as a new effect).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace

from sagaguard.idempotency.errors import ConfigurationError

__all__ = [
    "TOOL_CALL_ID",
    "EffectNaming",
    "EffectSpan",
    "Identifier",
    "Outcome",
    "business_key",
    "counter_attributes",
    "effect_counter",
    "effect_naming",
    "error_type",
    "error_type_name",
    "expose_identifiers",
    "exposed",
    "identifier_attributes",
    "span_attributes",
    "tracer",
    "tracing",
]

tracer = trace.get_tracer("sagaguard.idempotency")
_meter = metrics.get_meter("sagaguard.idempotency")
effect_counter = _meter.create_counter(
    "sagaguard.effects",
    unit="{effect}",
    description="Guarded effect calls by outcome (executed, replayed, reconciled, conflict, in_doubt)",
)

TOOL_SPAN = "execute_tool"
"""``gen_ai.operation.name`` of an agent's tool call, and its span name's prefix."""
EFFECT_SPAN = "sagaguard.effect"
"""The span name's prefix of every other guarded effect."""

TOOL_CALL_ID: ContextVar[str | None] = ContextVar("sagaguard_tool_call_id", default=None)
"""Set by framework adapters to the model's tool call id; reported as ``gen_ai.tool.call.id``."""


class Outcome(enum.StrEnum):
    """``sagaguard.effect.outcome``: what a guarded call did."""

    EXECUTED = "executed"
    REPLAYED = "replayed"
    RECONCILED = "reconciled"
    CONFLICT = "conflict"
    IN_DOUBT = "in_doubt"
    FAILED = "failed"
    BUSY = "busy"


class EffectNaming:
    """How one effect's calls appear in telemetry, decided once per effect by :func:`effect_naming`.

    Attributes:
        span_name: ``execute_tool {name}`` for a tool call, else ``sagaguard.effect {name}``.
        attributes: the span attributes known before any call (shared: never mutate).
        tool: whether the effect is an agent's tool call.
    """

    __slots__ = ("attributes", "span_name", "tool")

    def __init__(self, span_name: str, attributes: dict[str, str], tool: bool) -> None:
        self.span_name = span_name
        self.attributes = attributes
        self.tool = tool


def effect_naming(name: str, *, tool: bool = False) -> EffectNaming:
    """The span name and fixed attributes of the effect ``name``: the one place they are decided.

    Only an agent's tool call (``tool=True``: the framework adapters' tool wrappers) follows the
    GenAI ``execute_tool`` conventions, so GenAI dashboards count tool calls and nothing else.
    """
    if tool:
        attributes = {
            "gen_ai.operation.name": TOOL_SPAN,
            "gen_ai.tool.name": name,
            "gen_ai.tool.type": "function",
            "sagaguard.effect.name": name,
        }
        return EffectNaming(f"{TOOL_SPAN} {name}", attributes, True)
    return EffectNaming(f"{EFFECT_SPAN} {name}", {"sagaguard.effect.name": name}, False)


def span_attributes(naming: EffectNaming, identity: Any = None) -> dict[str, str]:
    """The attributes of one call's span when it starts: the effect's fixed ones, the model's tool
    call id (tool calls only), and the identifiers opted into (:func:`expose_identifiers`).

    Args:
        naming: the effect's :func:`effect_naming`.
        identity: the call's :class:`~sagaguard.idempotency.keys.EffectIdentity` (its ``scope``), if known.
    """
    attrs = dict(naming.attributes)
    if naming.tool:
        call_id = TOOL_CALL_ID.get()
        if call_id is not None:
            attrs["gen_ai.tool.call.id"] = call_id
    if _exposed:
        if Identifier.SCOPE in _exposed and identity is not None:
            attrs["sagaguard.effect.scope"] = identity.scope
        attrs.update(identifier_attributes())
    return attrs


def error_type(error: BaseException | type[BaseException]) -> str:
    """``error.type`` of an exception: its fully-qualified type name (``sagaguard.idempotency.errors.
    OutcomeUnknown``); a builtin's plain name (``TimeoutError``), as Python's tracebacks print it."""
    tp = error if isinstance(error, type) else type(error)
    return error_type_name(f"{tp.__module__}.{tp.__qualname__}")


def error_type_name(qualified: str) -> str:
    """``error.type`` of a type recorded by its qualified name (the codec's ``builtins.KeyError``)."""
    return qualified.removeprefix("builtins.")


class Identifier(enum.StrEnum):
    """An identifier that may go on spans once opted into with :func:`expose_identifiers`.

    Off by default: identifiers are often business data (an order number, a customer's id).
    """

    SAGA_ID = "saga_id"
    """``sagaguard.saga.id`` on saga, step and compensation spans."""
    SCOPE = "scope"
    """``sagaguard.effect.scope`` on effect spans: the scope's id, or the explicit ``key=``."""
    BUSINESS_KEY = "business_key"
    """``sagaguard.business_key`` on the effect, saga, step, compensation and outbox ``create`` spans
    started inside :func:`business_key`."""


_exposed: frozenset[Identifier] = frozenset()
_BUSINESS_KEY: ContextVar[str | None] = ContextVar("sagaguard_business_key", default=None)


def expose_identifiers(*identifiers: Identifier | str) -> frozenset[Identifier]:
    """Choose the identifiers that go on spans (none by default); replaces the previous choice.

    ::

        from sagaguard.idempotency.telemetry import expose_identifiers
        expose_identifiers("saga_id", "business_key")   # once, where tracing is configured

    Args:
        identifiers: :class:`Identifier` members or their values; none turns every one off.

    Returns:
        The previous choice (to restore it).

    Raises:
        ConfigurationError: an unknown identifier.
    """
    global _exposed
    chosen: set[Identifier] = set()
    for given in identifiers:
        try:
            chosen.add(Identifier(given))
        except ValueError:
            known = ", ".join(i.value for i in Identifier)
            raise ConfigurationError(f"unknown span identifier {given!r}; known: {known}") from None
    previous, _exposed = _exposed, frozenset(chosen)
    return previous


def exposed() -> frozenset[Identifier]:
    """The identifiers :func:`expose_identifiers` let onto spans."""
    return _exposed


@contextmanager
def business_key(value: str) -> Iterator[None]:
    """Tag the spans started inside with ``sagaguard.business_key`` (an order number, say), when
    :attr:`Identifier.BUSINESS_KEY` is exposed; without that opt-in nothing goes on any span.

    ::

        with business_key("order-1001"), scope("order-1001"):
            charge("cus_42", 1000)
    """
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"a business key is a non-empty string, got {value!r}")
    token = _BUSINESS_KEY.set(value)
    try:
        yield
    finally:
        _BUSINESS_KEY.reset(token)


def identifier_attributes(saga_id: str | None = None) -> dict[str, str]:
    """The opted-in identifiers for a span starting now: the business key in context and, given,
    the saga's id. Empty when none is exposed."""
    if not _exposed:
        return {}
    attrs: dict[str, str] = {}
    if saga_id is not None and Identifier.SAGA_ID in _exposed:
        attrs["sagaguard.saga.id"] = saga_id
    if Identifier.BUSINESS_KEY in _exposed:
        key = _BUSINESS_KEY.get()
        if key is not None:
            attrs["sagaguard.business_key"] = key
    return attrs


_traced: list[bool] = []
"""Holds True once a real tracer provider was seen (the global can be set only once)."""


def tracing() -> bool:
    """Whether spans may be recorded: a tracer provider other than the API's no-op one is set.

    Without one every span is a non-recording no-op, so the guard skips creating and attaching it.
    Once a real provider is seen the answer is remembered (OpenTelemetry sets the global provider at
    most once); before that, ``trace.get_tracer_provider()`` is asked on each call.
    """
    if _traced:
        return True
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return False
    _traced.append(True)
    return True


def counter_attributes(name: str) -> dict[Outcome, dict[str, str]]:
    """The outcome counter's attributes for each outcome of the effect ``name``, built once per effect.

    The dicts are shared by every call of the effect: never mutate one.
    """
    return {o: {"sagaguard.effect.outcome": o.value, "sagaguard.effect.name": name} for o in Outcome}


class _Call(Protocol):
    @property
    def outcome(self) -> Outcome: ...

    @property
    def identity(self) -> Any: ...


class EffectSpan:
    """The span (see :func:`effect_naming`) and the outcome counter around one guarded call.

    Args:
        naming: the effect's :func:`effect_naming`.
        counted: :func:`counter_attributes` of its name.
        call: what reports the call's identity, and its outcome once it is over (a
            :class:`~sagaguard.idempotency.flow.Flow`).
    """

    __slots__ = ("_call", "_counted", "_naming", "_span", "_token")

    def __init__(self, naming: EffectNaming, counted: dict[Outcome, dict[str, str]], call: _Call) -> None:
        self._naming = naming
        self._counted = counted
        self._call = call

    def __enter__(self) -> None:
        # No tracer provider: every span would be a no-op, and attaching one would hide the
        # caller's own span from a propagator in the body; only the outcome is counted.
        if not tracing():
            self._span = None
            return
        # What ``tracer.start_as_current_span(..., record_exception=False,
        # set_status_on_exception=False)`` does, spelt out: start the span, make it current;
        # __exit__ detaches it, then ends it.
        naming = self._naming
        span = tracer.start_span(
            naming.span_name,
            kind=trace.SpanKind.INTERNAL,
            attributes=span_attributes(naming, self._call.identity),
            record_exception=False,
            set_status_on_exception=False,
        )
        self._token = otel_context.attach(trace.set_span_in_context(span))
        self._span = span

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        span = self._span
        if span is None:
            effect_counter.add(1, self._counted[self._call.outcome])
            return
        try:
            outcome = self._call.outcome
            if span.is_recording():
                span.set_attribute("sagaguard.effect.outcome", outcome.value)
                if tp is not None:
                    # The type only: messages may carry arguments, which stay off spans.
                    span.set_attribute("error.type", error_type(tp))
                    span.set_status(trace.Status(trace.StatusCode.ERROR))
            effect_counter.add(1, self._counted[outcome])
        finally:
            otel_context.detach(self._token)
            span.end()
