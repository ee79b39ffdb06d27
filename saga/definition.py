"""Declaring a saga: a name, a version, an input type and ordered steps.

::

    trip = Saga("book_trip", version=1, input=Order)

    @trip.step(compensate=refund)
    def charge(ctx: StepContext, order: Order) -> Receipt: ...

    @trip.step
    def reserve(ctx: StepContext, order: Order) -> Seat: ...

    @reserve.compensation
    def release(ctx: StepContext, order: Order, seat: Seat | None) -> None: ...

    @trip.pivot
    def book(ctx: StepContext, order: Order) -> Booking: ...

    @trip.retriable
    def email(ctx: StepContext, order: Order) -> None:
        send_receipt(order, ctx.result(charge))

An action is called as ``action(ctx, input)``; a compensation as ``compensation(ctx, input, result)``
where ``result`` is None when a crash landed between the step's effect and its record. Both may be
``async def``. Everything that can be checked is checked when the step is declared (kinds and order,
names, signatures, storable types); whether every compensatable step got its compensation is checked
by :meth:`Saga.freeze`, which the runner calls before the first run.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, Union, overload

import tenacity

from idempotency.codec import Codec
from idempotency.effect import Classifier, Retry, classify
from idempotency.errors import CodecError
from idempotency.records import Disposition
from saga.errors import (
    DuplicateStep,
    ResultUnavailable,
    SignatureError,
    StepOrderError,
    UnstorableType,
)
from saga.records import StepKind

__all__ = ["FORWARD_RETRY", "Saga", "Step", "StepContext"]

I = TypeVar("I")  # noqa: E741  (the saga's input type)
R = TypeVar("R")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,99}")

FORWARD_RETRY = Retry(
    stop=tenacity.stop_after_attempt(10),
    wait=tenacity.wait_exponential(multiplier=0.5, max=60.0) + tenacity.wait_random(0, 1),
)
"""Default retry of retriable steps and compensations: both must end in success, so they get a
larger budget than compensatable steps (whose failure simply triggers compensation)."""


class _Missing:
    """Marks a compensatable step whose compensation was not given (yet)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


@dataclass(frozen=True, slots=True)
class StepContext:
    """What an action or compensation is told about the step it runs for.

    The step's *identity* is ``saga_id`` + ``step``; :attr:`step_scope` is the effect scope of the
    step's action, so a compensation can reconcile against the effects the action made.
    """

    saga_id: str
    saga: str
    version: int
    step: str
    index: int
    attempt: int
    """1 for the first try in this process, 2 for the first retry, ..."""
    compensating: bool = False
    """True when this is the step's compensation running."""
    error: str | None = None
    """For a compensation: the error (JSON) that made the saga compensate."""
    _results: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def step_scope(self) -> str:
        """The effect scope of the step's action: ``{saga_id}/{step}``."""
        return f"{self.saga_id}/{self.step}"

    def result(self, step: Step[Any, R]) -> R:
        """The recorded result of an earlier step of this saga.

        Raises:
            ResultUnavailable: that step has not succeeded.
        """
        if step.name not in self._results:
            raise ResultUnavailable(step.name)
        return typing.cast(R, self._results[step.name])


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
        codec: stores the action's result as JSON.
    """

    def __init__(  # noqa: PLR0917  (internal: built by Saga._add only)
        self,
        saga: Saga[I],
        index: int,
        name: str,
        kind: StepKind,
        action: Action,
        compensation: Compensation | None,
        retry: Retry,
        compensation_retry: Retry,
        not_applied: tuple[type[BaseException], ...],
        classifier: Classifier | None,
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
        self.codec: Codec[R] = _result_codec(saga.name, name, action)

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
        _check_compensation(self.name, fn)
        self.compensation_fn = fn
        return fn

    def disposition(self, exc: BaseException) -> Disposition:
        """Classify an exception raised by the action (see :func:`idempotency.effect.classify`)."""
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


class Saga(Generic[I]):
    """A saga definition: name, version, input type and ordered steps.

    Args:
        name: the saga's name, recorded in the journal.
        version: recorded in the journal; a saga id resumes only under the version that started it.
        input: the type of the input every action and compensation receives; must be storable as
            JSON (a dataclass, a pydantic model, plain JSON types).

    Raises:
        DefinitionError: bad name or version.
        UnstorableType: ``input`` cannot round-trip through JSON.
    """

    def __init__(self, name: str, *, version: int = 1, input: type[I]) -> None:
        if not _NAME.fullmatch(name):
            raise StepOrderError(f"saga name {name!r} must be a letter or _ then letters, digits, _ . -")
        if not isinstance(version, int) or version < 1:
            raise StepOrderError(f"saga version must be an int >= 1, got {version!r}")
        self.name = name
        self.version = version
        self.input_type: Any = input
        try:
            self.input_codec: Codec[I] = Codec(input)
        except CodecError as exc:
            raise UnstorableType(f"saga {name!r}: input {exc}") from exc
        self.steps: list[Step[I, Any]] = []
        self._frozen = False

    # -- declaring steps --------------------------------------------------------------------

    @overload
    def step(self, fn: Callable[[StepContext, I], Awaitable[R]], /) -> Step[I, R]: ...

    @overload
    def step(self, fn: Callable[[StepContext, I], R], /) -> Step[I, R]: ...

    @overload
    def step(
        self,
        *,
        name: str | None = None,
        compensate: Callable[[StepContext, I, Any], Any] | None = MISSING,
        retry: Retry | None = None,
        compensation_retry: Retry | None = None,
        not_applied: tuple[type[BaseException], ...] = (),
        classify: Classifier | None = None,
    ) -> _StepDecorator[I]: ...

    def step(
        self,
        fn: Any = None,
        *,
        name: str | None = None,
        compensate: Any = MISSING,
        retry: Retry | None = None,
        compensation_retry: Retry | None = None,
        not_applied: tuple[type[BaseException], ...] = (),
        classify: Classifier | None = None,
    ) -> Any:
        """Declare a compensatable step (bare, or with options).

        Args:
            name: the step's name (default: the function's name).
            compensate: its compensation, or None if the step changes nothing that needs undoing.
                Leave it out to attach one with ``@the_step.compensation``.
            retry: how a failing action is retried before the saga compensates (default: 3 tries).
            compensation_retry: how a failing compensation is retried (default: :data:`FORWARD_RETRY`).
            not_applied: exception types meaning "the step changed nothing": not retried, and its own
                compensation is skipped. :class:`~idempotency.errors.NotApplied` always counts.
            classify: maps an exception to a disposition before ``not_applied`` is consulted.

        Raises:
            DuplicateStep, StepOrderError, SignatureError, UnstorableType: see :mod:`saga.errors`.
        """
        options = {
            "name": name,
            "compensate": compensate,
            "retry": retry,
            "compensation_retry": compensation_retry,
            "not_applied": not_applied,
            "classify": classify,
        }
        return self._declare(fn, StepKind.COMPENSATABLE, options)

    @overload
    def pivot(self, fn: Callable[[StepContext, I], Awaitable[R]], /) -> Step[I, R]: ...

    @overload
    def pivot(self, fn: Callable[[StepContext, I], R], /) -> Step[I, R]: ...

    @overload
    def pivot(
        self,
        *,
        name: str | None = None,
        retry: Retry | None = None,
        not_applied: tuple[type[BaseException], ...] = (),
        classify: Classifier | None = None,
    ) -> _StepDecorator[I]: ...

    def pivot(
        self,
        fn: Any = None,
        *,
        name: str | None = None,
        retry: Retry | None = None,
        not_applied: tuple[type[BaseException], ...] = (),
        classify: Classifier | None = None,
    ) -> Any:
        """Declare the pivot: the go/no-go step. At most one; options as for :meth:`step`.

        If it fails *not applied*, the steps before it are compensated; if it fails in a way that
        may have applied it, the saga needs attention (compensating could undo a booking that
        happened).
        """
        options = {"name": name, "retry": retry, "not_applied": not_applied, "classify": classify}
        return self._declare(fn, StepKind.PIVOT, options)

    @overload
    def retriable(self, fn: Callable[[StepContext, I], Awaitable[R]], /) -> Step[I, R]: ...

    @overload
    def retriable(self, fn: Callable[[StepContext, I], R], /) -> Step[I, R]: ...

    @overload
    def retriable(
        self,
        *,
        name: str | None = None,
        retry: Retry | None = None,
        classify: Classifier | None = None,
    ) -> _StepDecorator[I]: ...

    def retriable(
        self,
        fn: Any = None,
        *,
        name: str | None = None,
        retry: Retry | None = None,
        classify: Classifier | None = None,
    ) -> Any:
        """Declare a retriable step (after the pivot): retried forward, never compensated.

        Its default retry is :data:`FORWARD_RETRY`; when that runs out the saga needs attention.
        """
        options = {"name": name, "retry": retry, "classify": classify}
        return self._declare(fn, StepKind.RETRIABLE, options)

    def _declare(self, fn: Any, kind: StepKind, options: dict[str, Any]) -> Any:
        if fn is None:
            return _StepDecorator(self, kind, options)
        defaults = {
            "name": None,
            "compensate": MISSING,
            "retry": None,
            "compensation_retry": None,
            "not_applied": (),
            "classify": None,
        }
        if any(options[k] is not defaults[k] and options[k] != defaults[k] for k in options):
            raise SignatureError("pass options as keywords: @saga.step(name=...), not with the function")
        return self._add(fn, kind)

    def _add(
        self,
        fn: Callable[..., Any],
        kind: StepKind,
        *,
        name: str | None = None,
        compensate: Any = MISSING,
        retry: Retry | None = None,
        compensation_retry: Retry | None = None,
        not_applied: tuple[type[BaseException], ...] = (),
        classify: Classifier | None = None,
    ) -> Step[I, Any]:
        self._check_open()
        step_name = name if name is not None else getattr(fn, "__name__", "")
        if not _NAME.fullmatch(step_name):
            raise SignatureError(
                f"step name {step_name!r} must be a letter or _ then up to 99 letters, digits, _ . -"
            )
        if any(s.name == step_name for s in self.steps):
            raise DuplicateStep(self.name, step_name)
        if not callable(fn):
            raise SignatureError(f"step {step_name!r}: the action must be callable")
        if not all(isinstance(t, type) and issubclass(t, BaseException) for t in not_applied):
            raise SignatureError(f"step {step_name!r}: not_applied= takes a tuple of exception types")
        self._check_order(step_name, kind)
        if kind is not StepKind.COMPENSATABLE:
            compensate = None
        elif compensate is not MISSING and compensate is not None:
            _check_compensation(step_name, compensate)
        _check_callable(step_name, "action", fn, 2)
        default_retry = FORWARD_RETRY if kind is StepKind.RETRIABLE else Retry()
        step: Step[I, Any] = Step(
            self,
            len(self.steps),
            step_name,
            kind,
            fn,
            compensate,
            retry or default_retry,
            compensation_retry or FORWARD_RETRY,
            tuple(not_applied),
            classify,
        )
        self.steps.append(step)
        return step

    def _check_order(self, step_name: str, kind: StepKind) -> None:
        pivot = self.pivot_index
        if kind is StepKind.PIVOT and pivot is not None:
            raise StepOrderError(
                f"saga {self.name!r} already has a pivot ({self.steps[pivot].name!r}); "
                f"{step_name!r} cannot be another"
            )
        if kind is StepKind.COMPENSATABLE and pivot is not None:
            raise StepOrderError(
                f"step {step_name!r} comes after the pivot {self.steps[pivot].name!r}: steps after "
                "the pivot are never compensated; declare it with @saga.retriable"
            )
        if kind is StepKind.RETRIABLE and pivot is None:
            raise StepOrderError(
                f"retriable step {step_name!r} comes before any pivot: declare the pivot first "
                "(@saga.pivot), or make the step compensatable"
            )

    # -- queries ------------------------------------------------------------------------------

    @property
    def pivot_index(self) -> int | None:
        """The index of the pivot step, or None."""
        for step in self.steps:
            if step.kind is StepKind.PIVOT:
                return step.index
        return None

    @property
    def frozen(self) -> bool:
        """Whether :meth:`freeze` ran; a frozen saga takes no more steps or compensations."""
        return self._frozen

    def freeze(self) -> Saga[I]:
        """Check the definition is complete and close it to changes. Idempotent; returns self.

        Raises:
            StepOrderError: no steps, or a compensatable step has no compensation and was not
                declared with ``compensate=None``.
        """
        if self._frozen:
            return self
        if not self.steps:
            raise StepOrderError(f"saga {self.name!r} has no steps")
        for step in self.steps:
            if step.compensation_fn is MISSING:
                raise StepOrderError(
                    f"step {step.name!r} of saga {self.name!r} has no compensation: attach one with "
                    f"@{step.name}.compensation, or declare it with compensate=None if it changes nothing"
                )
        self._frozen = True
        return self

    def _check_open(self) -> None:
        if self._frozen:
            raise StepOrderError(f"saga {self.name!r} is frozen (it already ran); declare steps first")

    def __repr__(self) -> str:
        return f"Saga({self.name!r}, version={self.version}, steps={[s.name for s in self.steps]})"


# -- definition-time checks -------------------------------------------------------------------


def _check_callable(step: str, role: str, fn: Callable[..., Any], arity: int) -> inspect.Signature:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise SignatureError(f"step {step!r}: cannot read the {role}'s signature: {exc}") from exc
    try:
        signature.bind(*range(arity))
    except TypeError as exc:
        shape = "(ctx, input)" if arity == 2 else "(ctx, input, result)"
        raise SignatureError(f"step {step!r}: the {role} must take {shape}: {exc}") from exc
    return signature


def _accepts_none(annotation: Any) -> bool:
    if annotation in (Any, object, None, type(None), inspect.Parameter.empty):
        return True
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return any(_accepts_none(arg) for arg in typing.get_args(annotation))
    return False


def _check_compensation(step: str, fn: Callable[..., Any]) -> None:
    """The compensation is called as ``fn(ctx, input, result)`` with ``result`` possibly None."""
    if not callable(fn):
        raise SignatureError(f"step {step!r}: compensate= must be callable or None")
    signature = _check_callable(step, "compensation", fn, 3)
    bound = signature.bind(0, 1, 2)
    names = list(bound.arguments)
    result_param = signature.parameters[names[-1]]
    if result_param.kind is inspect.Parameter.VAR_POSITIONAL:
        return
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError):
        hints = {}
    annotation = hints.get(result_param.name, result_param.annotation)
    if not _accepts_none(annotation):
        raise SignatureError(
            f"step {step!r}: the compensation's {result_param.name!r} parameter must accept None "
            f"(annotate it `{getattr(annotation, '__name__', annotation)} | None`): it is None when a "
            "crash came between the step's effect and its record"
        )


def _result_codec(saga: str, step: str, fn: Callable[..., Any]) -> Codec[Any]:
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError) as exc:
        raise UnstorableType(
            f"saga {saga!r} step {step!r}: cannot resolve the return annotation: {exc}"
        ) from exc
    try:
        return Codec(hints.get("return", Any))
    except CodecError as exc:
        raise UnstorableType(f"saga {saga!r} step {step!r}: {exc}") from exc
