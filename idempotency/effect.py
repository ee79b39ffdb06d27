"""What an effect declares: its policy, error classification, retries and reconciler.

These are the knobs of :meth:`sagaguard.idempotency.guard.Guard.effect`; they hold no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, cast

import tenacity

from sagaguard.idempotency.errors import ConfigurationError, NotApplied
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import Disposition, Record

__all__ = [
    "APPLIED_UNKNOWN",
    "NOT_APPLIED",
    "Applied",
    "AsyncReconciler",
    "Classifier",
    "EffectContext",
    "NotApplied",
    "NotAppliedResolution",
    "Policy",
    "ReconcileRequest",
    "Reconciler",
    "Resolution",
    "Retry",
    "Unknown",
    "current_effect",
]

T = TypeVar("T")


class Policy(enum.StrEnum):
    """What to do with an in-doubt effect that no reconciler or provider key can settle."""

    AT_MOST_ONCE = "at_most_once"
    """Default: raise :class:`~sagaguard.idempotency.errors.OutcomeUnknown`; the record stays IN_DOUBT for an
    operator. A charge is never made twice; it may need a human to say whether it was made once."""
    AT_LEAST_ONCE = "at_least_once"
    """Opt-in: run the effect again. For effects that are harmless to repeat."""


Classifier = Callable[[BaseException], Disposition | None]
"""Maps an exception to a disposition, or None to fall through to the effect's type lists."""


def classify(
    exc: BaseException,
    classifier: Classifier | None,
    permanent: tuple[type[BaseException], ...],
    retryable: tuple[type[BaseException], ...],
) -> Disposition:
    """Classify an exception raised by an effect. Unknown exceptions are AMBIGUOUS.

    Order: the custom classifier (if it answers), then ``permanent``, then ``retryable``, then
    :class:`NotApplied`'s own flag; everything else may have reached the world.
    """
    if classifier is not None:
        found = classifier(exc)
        if found is not None:
            return found
    if isinstance(exc, permanent):
        return Disposition.PERMANENT
    if isinstance(exc, retryable):
        return Disposition.RETRYABLE
    if isinstance(exc, NotApplied):
        return Disposition.RETRYABLE if exc.retryable else Disposition.PERMANENT
    return Disposition.AMBIGUOUS


def _default_wait() -> tenacity.wait.wait_base:
    """0.1 s doubling to 5 s, plus up to 1 s of jitter."""
    try:
        # tenacity >= 9.2 deprecates ``initial`` (a DeprecationWarning on every Retry()).
        return tenacity.wait_exponential_jitter(multiplier=0.1, max=5.0)
    except TypeError:  # older tenacity: no ``multiplier``
        return tenacity.wait_exponential_jitter(initial=0.1, max=5.0)


@dataclass(frozen=True, slots=True)
class Retry:
    """How often and how fast a not-applied retryable error is retried inside one claim.

    Provider-idempotent effects also retry ambiguous errors this way: the re-send carries the same
    provider key, so the provider absorbs a duplicate.
    """

    stop: tenacity.stop.stop_base = field(default_factory=lambda: tenacity.stop_after_attempt(3))
    """When to give up (tenacity stop strategy)."""
    wait: tenacity.wait.wait_base = field(default_factory=_default_wait)
    """How long to wait between attempts (tenacity wait strategy)."""


NO_RETRY = Retry(stop=tenacity.stop_after_attempt(1), wait=tenacity.wait_none())


@dataclass(frozen=True, slots=True)
class Applied(Generic[T]):
    """The reconciler found the effect in the world; ``result`` becomes the recorded result."""

    result: T


@dataclass(frozen=True, slots=True)
class NotAppliedResolution:
    """The reconciler is sure the effect did not happen: it is run now, under the new token."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """The reconciler cannot tell (yet): the provider key or the policy decides."""


NOT_APPLIED = NotAppliedResolution()
APPLIED_UNKNOWN = Unknown()

Resolution = Applied[T] | NotAppliedResolution | Unknown


@dataclass(frozen=True, slots=True)
class ReconcileRequest:
    """What a reconciler is told about an in-doubt effect."""

    identity: EffectIdentity
    """The effect's key and readable parts (scope, name, ordinal), e.g. to match provider metadata."""
    provider_key: str
    """The provider idempotency key the lost attempt used."""
    arguments: Mapping[str, Any]
    """The call's bound arguments."""
    record: Record
    """The record as taken over (its ``created_at`` bounds a provider-side search)."""


class Reconciler(Protocol):
    """Asks the world whether an in-doubt effect happened."""

    def __call__(self, request: ReconcileRequest, /) -> Applied[Any] | NotAppliedResolution | Unknown:
        """Return Applied(result), NOT_APPLIED or Unknown(). Raising counts as Unknown."""
        ...


class AsyncReconciler(Protocol):
    """An async :class:`Reconciler`."""

    def __call__(
        self, request: ReconcileRequest, /
    ) -> Awaitable[Applied[Any] | NotAppliedResolution | Unknown]:
        """Return Applied(result), NOT_APPLIED or Unknown(). Raising counts as Unknown."""
        ...


@dataclass(frozen=True, slots=True)
class EffectContext:
    """The running effect, visible to its body through :func:`current_effect`."""

    identity: EffectIdentity
    token: int
    attempt: int
    """1 for the first try inside this claim, 2 for the first retry, ..."""
    heartbeat: Callable[[], float]
    """Extend the lease now (the guard also does it in the background); returns the new deadline."""

    @property
    def key(self) -> str:
        """The effect key."""
        return self.identity.key

    @property
    def provider_key(self) -> str:
        """Pass this to providers that deduplicate (Stripe ``idempotency_key``, HTTP header)."""
        return self.identity.provider_key


class RunningEffect(NamedTuple):
    """What the guard sets for a running body: the parts of its :class:`EffectContext`.

    Every guarded call sets one; the context itself (a frozen dataclass holding a bound heartbeat)
    is built only when the body asks for it with :func:`current_effect`, so a body that never asks
    never pays for it.
    """

    identity: EffectIdentity
    token: int
    attempt: int
    beat: Callable[[str, int, float], float]
    """Renews a lease: ``beat(key, token, lease)`` (the guard's heartbeater)."""
    lease: float

    def context(self) -> EffectContext:
        """The :class:`EffectContext` of this running effect."""
        identity, token = self.identity, self.token
        return EffectContext(
            identity, token, self.attempt, partial(self.beat, identity.key, token, self.lease)
        )


_current_effect: ContextVar[RunningEffect | EffectContext | None] = ContextVar(
    "sagaguard_effect", default=None
)


def current_effect() -> EffectContext:
    """The effect whose body is running.

    Raises:
        ConfigurationError: called outside a guarded effect.
    """
    found = _current_effect.get()
    if found is None:
        raise ConfigurationError("current_effect() is only available inside a guarded effect")
    if type(found) is RunningEffect:
        return found.context()
    return cast(EffectContext, found)
