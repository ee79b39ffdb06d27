"""One declared saga step (:class:`Step`) and the decorator :meth:`Saga.step` returns with options."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from sagaguard.idempotency.codec import Codec
from sagaguard.idempotency.effect import Classifier, Retry, classify
from sagaguard.idempotency.records import Disposition
from sagaguard.saga.checks import check_compensation, result_codec
from sagaguard.saga.context import StepContext
from sagaguard.saga.errors import StepOrderError
from sagaguard.saga.records import CompensationPolicy, StepKind

if TYPE_CHECKING:
    from sagaguard.saga.definition import Saga

__all__ = ["MISSING", "Action", "Compensation", "Step"]

I = TypeVar("I")  # noqa: E741  (the saga's input type)
R = TypeVar("R")


class _Missing:
    """Marks a compensatable step whose compensation was not given (yet)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


Action = Callable[[StepContext, Any], Any]
Compensation = Callable[[StepContext, Any, Any], Any]


class Step(Generic[I, R]):
    """One declared step: returned by :meth:`Saga.step`, :meth:`Saga.pivot`, :meth:`Saga.retriable`.

    Attributes:
        name: unique in its saga; part of effect scopes and journal rows.
        kind: compensatable, pivot or retriable.
        action: the forward call, ``action(ctx, input) -> R``.
        compensation_fn: ``compensation(ctx, input, result | None)``; None when nothing is undone.
        retry: how the action is retried before the step counts as failed.
        compensation_retry: how the compensation is retried before the saga needs attention.
        timeout: seconds the step may take from its start (all tries), or None. Past it the step
            fails as *maybe applied* (:class:`~sagaguard.saga.errors.StepTimeout`): it is not retried and its
            compensation runs with ``result=None``.
        signal: for a step declared with :meth:`Saga.wait`, the signal it waits for.
        on_compensation_failure: halt, or continue with the earlier compensations, when the
            compensation exhausts its retries (the step's own setting, else the saga's).
        codec: stores the action's result as JSON.
    """

    def __init__(
        self,
        saga: Saga[I],
        index: int,
        name: str,
        kind: StepKind,
        action: Action,
        *,
        compensation: Compensation | None,
        retry: Retry,
        compensation_retry: Retry,
        not_applied: tuple[type[BaseException], ...],
        classifier: Classifier | None,
        timeout: float | None = None,
        codec: Codec[Any] | None = None,
        signal: str | None = None,
        on_compensation_failure: CompensationPolicy = CompensationPolicy.HALT,
    ) -> None:
        self.saga = saga
        self.index = index
        self.name = name
        self.kind = kind
        self.action = action
        self.compensation_fn: Compensation | None = compensation
        self.retry = retry
        self.compensation_retry = compensation_retry
        self.not_applied = not_applied
        self.classifier = classifier
        self.timeout = timeout
        self.signal = signal
        self.on_compensation_failure = on_compensation_failure
        self.codec: Codec[R] = codec if codec is not None else result_codec(saga.name, name, action)

    def compensation(
        self, fn: Callable[[StepContext, I, R | None], Any]
    ) -> Callable[[StepContext, I, R | None], Any]:
        """Decorator: attach ``fn`` as this step's compensation. Returns ``fn`` unchanged.

        Raises:
            StepOrderError: the step is a pivot or retriable, already has a compensation, or the saga
                is frozen.
            SignatureError: ``fn`` cannot be called as ``fn(ctx, input, result_or_none)``.
        """
        if self.kind is not StepKind.COMPENSATABLE:
            raise StepOrderError(f"step {self.name!r} is {self.kind}: only compensatable steps are undone")
        if self.compensation_fn is not MISSING:
            raise StepOrderError(f"step {self.name!r} already has a compensation")
        self.saga._check_open()
        check_compensation(self.name, fn)
        self.compensation_fn = fn
        return fn

    def never_applied(self) -> bool:
        """Whether the step's effect provably never happened, so its compensation has nothing to
        undo; asked (it may read the effect ledger) before each compensation runs. A declared step:
        False, its compensation decides; an agent step: whether its tool call never claimed its
        effect (see :mod:`sagaguard.saga.agent.definition`)."""
        return False

    def disposition(self, exc: BaseException) -> Disposition:
        """Classify an exception raised by the action (see :func:`sagaguard.idempotency.effect.classify`)."""
        return classify(exc, self.classifier, self.not_applied, ())

    @property
    def compensation_name(self) -> str | None:
        """The compensation's qualified name, recorded in the journal when the step starts."""
        fn = self.compensation_fn
        if fn is None or fn is MISSING:
            return None
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    def __repr__(self) -> str:
        return f"Step({self.saga.name!r}, {self.name!r}, {self.kind})"


class _StepDecorator(Generic[I]):
    """Returned by :meth:`Saga.step` and friends when called with options."""

    def __init__(self, saga: Saga[I], kind: StepKind, options: dict[str, Any]) -> None:
        self._saga = saga
        self._kind = kind
        self._options = options

    @overload
    def __call__(self, fn: Callable[[StepContext, I], Awaitable[R]]) -> Step[I, R]: ...

    @overload
    def __call__(self, fn: Callable[[StepContext, I], R]) -> Step[I, R]: ...

    def __call__(self, fn: Callable[[StepContext, I], Any]) -> Step[I, Any]:
        return self._saga._add(fn, self._kind, **self._options)
