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
import math
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import tenacity

from sagaguard.idempotency.codec import Codec
from sagaguard.idempotency.effect import Classifier, Retry
from sagaguard.idempotency.errors import CodecError
from sagaguard.saga.checks import check_callable, check_compensation
from sagaguard.saga.context import StepContext
from sagaguard.saga.errors import (
    DefinitionError,
    DuplicateStep,
    SignatureError,
    StepOrderError,
    UnstorableType,
)
from sagaguard.saga.records import CompensationPolicy, StepKind, StepRecord, StepState
from sagaguard.saga.step import MISSING, Step, _StepDecorator

if TYPE_CHECKING:
    from sagaguard.idempotency.guard import Guard
    from sagaguard.saga.records import SagaSnapshot

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


class Saga(Generic[I]):
    """A saga definition: name, version, input type and ordered steps.

    Args:
        name: the saga's name, recorded in the journal.
        version: recorded in the journal; a saga id resumes only under the version that started it
            (register several versions in a :class:`~sagaguard.saga.registry.SagaRegistry`).
        input: the type of the input every action and compensation receives; must be storable as
            JSON (a dataclass, a pydantic model, plain JSON types).
        timeout: seconds from the saga's start by which it must have started its pivot (or, without
            a pivot, finished); None for no deadline. Past it, the runner stops going forward at
            the next step boundary and compensates (:class:`~sagaguard.saga.errors.SagaDeadlineExceeded`).
            Once the pivot has started the saga only goes forward, deadline or not.
        on_compensation_failure: what happens when a compensation exhausts its retries (a
            :class:`~sagaguard.saga.records.CompensationPolicy` or its value). ``"halt"`` (default): the
            step is COMPENSATION_FAILED and the saga NEEDS_ATTENTION at once; the earlier
            compensations wait for an operator. ``"continue"``: the step is COMPENSATION_FAILED,
            the earlier compensations still run in reverse order, and the saga then ends
            NEEDS_ATTENTION with the cause(s), never COMPENSATED. A step may override it.

    Raises:
        DefinitionError: bad name, version, timeout or ``on_compensation_failure``.
        UnstorableType: ``input`` cannot round-trip through JSON.
    """

    def __init__(
        self,
        name: str,
        *,
        version: int = 1,
        input: type[I],
        timeout: float | None = None,
        on_compensation_failure: CompensationPolicy | str = CompensationPolicy.HALT,
    ) -> None:
        if not _NAME.fullmatch(name):
            raise StepOrderError(f"saga name {name!r} must be a letter or _ then letters, digits, _ . -")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise StepOrderError(f"saga version must be an int >= 1, got {version!r}")
        self.name = name
        self.version = version
        self.timeout = _check_timeout(f"saga {name!r}", timeout)
        self.on_compensation_failure = _check_policy(f"saga {name!r}", on_compensation_failure)
        """What a compensation that exhausts its retries does, unless its step says otherwise."""
        self.input_type: Any = input
        try:
            self.input_codec: Codec[I] = Codec(input)
        except CodecError as exc:
            raise UnstorableType(f"saga {name!r}: input {exc}") from exc
        self.steps: list[Step[I, Any]] = []
        self._frozen = False
        self._started_rows: dict[int, tuple[Any, StepRecord]] = {}
        """By step index: the compensation a STARTED row was built for, and that row."""
        self._coroutines: tuple[list[tuple[Any, Any]], bool] | None = None
        """The steps' (action, compensation) pairs :meth:`has_async` last looked at, and its answer."""

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
        timeout: float | None = None,
        on_compensation_failure: CompensationPolicy | str | None = None,
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
        timeout: float | None = None,
        on_compensation_failure: CompensationPolicy | str | None = None,
    ) -> Any:
        """Declare a compensatable step (bare, or with options).

        Args:
            name: the step's name (default: the function's name).
            compensate: its compensation, or None if the step changes nothing that needs undoing.
                Leave it out to attach one with ``@the_step.compensation``.
            retry: how a failing action is retried before the saga compensates (default: 3 tries).
            compensation_retry: how a failing compensation is retried (default: :data:`FORWARD_RETRY`).
            not_applied: exception types meaning "the step changed nothing": not retried, and its own
                compensation is skipped. :class:`~sagaguard.idempotency.errors.NotApplied` always counts.
            classify: maps an exception to a disposition before ``not_applied`` is consulted.
            timeout: seconds the step may take from its start, all tries included (see
                :attr:`Step.timeout`); None for no limit.
            on_compensation_failure: ``"halt"`` or ``"continue"`` when this step's compensation
                exhausts its retries (see :class:`Saga`); None: the saga's setting.

        Raises:
            DuplicateStep, StepOrderError, SignatureError, UnstorableType, DefinitionError: see
                :mod:`sagaguard.saga.errors`.
        """
        options = {
            "name": name,
            "compensate": compensate,
            "retry": retry,
            "compensation_retry": compensation_retry,
            "not_applied": not_applied,
            "classify": classify,
            "timeout": timeout,
            "on_compensation_failure": on_compensation_failure,
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
        timeout: float | None = None,
    ) -> _StepDecorator[I]: ...

    def pivot(
        self,
        fn: Any = None,
        *,
        name: str | None = None,
        retry: Retry | None = None,
        not_applied: tuple[type[BaseException], ...] = (),
        classify: Classifier | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Declare the pivot: the go/no-go step. At most one; options as for :meth:`step`.

        If it fails *not applied*, the steps before it are compensated; if it fails in a way that
        may have applied it, the saga needs attention (compensating could undo a booking that
        happened).
        """
        options = {
            "name": name,
            "retry": retry,
            "not_applied": not_applied,
            "classify": classify,
            "timeout": timeout,
        }
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
        timeout: float | None = None,
    ) -> _StepDecorator[I]: ...

    def retriable(
        self,
        fn: Any = None,
        *,
        name: str | None = None,
        retry: Retry | None = None,
        classify: Classifier | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Declare a retriable step (after the pivot): retried forward, never compensated.

        Its default retry is :data:`FORWARD_RETRY`; when that runs out the saga needs attention.
        """
        options = {"name": name, "retry": retry, "classify": classify, "timeout": timeout}
        return self._declare(fn, StepKind.RETRIABLE, options)

    def wait(
        self,
        signal: str,
        *,
        name: str | None = None,
        timeout: float | None = None,
        payload: type[R] | Any = Any,
    ) -> Step[I, R]:
        """Declare a step that only waits for the signal ``signal`` and returns its payload.

        The saga parks as WAITING (no process held) until :func:`saga.signal` delivers it; later
        steps read it with ``ctx.result(the_step)``. When ``timeout`` seconds pass first, the step
        fails *not applied* (:class:`~sagaguard.saga.errors.SignalTimeout`): before the pivot the saga
        compensates, after it the saga needs attention. The step is compensatable (with nothing to
        undo) before the pivot and retriable after it.

        Args:
            signal: the signal's name.
            name: the step's name (default: ``signal``).
            timeout: seconds from the start of the wait to its deadline; None waits forever (or
                until the saga's deadline).
            payload: the payload's type (storable as JSON).

        Raises:
            DuplicateStep, SignatureError, UnstorableType: see :mod:`sagaguard.saga.errors`.
        """
        step_name = name if name is not None else signal
        if not _NAME.fullmatch(signal):
            raise SignatureError(f"signal name {signal!r} must be a letter or _ then letters, digits, _ . -")
        wait_timeout = _check_timeout(f"wait {signal!r}", timeout)
        try:
            codec: Codec[Any] = Codec(payload)
        except CodecError as exc:
            raise UnstorableType(f"saga {self.name!r} wait {signal!r}: payload {exc}") from exc

        def wait(ctx: StepContext, _input: Any) -> Any:
            return ctx.wait_for(signal, timeout=wait_timeout, payload_type=payload)

        wait.__name__ = wait.__qualname__ = step_name
        kind = StepKind.COMPENSATABLE if self.pivot_index is None else StepKind.RETRIABLE
        return self._add(
            wait,
            kind,
            name=step_name,
            compensate=None,
            retry=Retry(stop=tenacity.stop_after_attempt(1)),
            codec=codec,
            signal=signal,
        )

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
            "timeout": None,
            "on_compensation_failure": None,
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
        timeout: float | None = None,
        codec: Codec[Any] | None = None,
        signal: str | None = None,
        on_compensation_failure: CompensationPolicy | str | None = None,
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
        step_timeout = _check_timeout(f"step {step_name!r}", timeout)
        policy = (
            self.on_compensation_failure
            if on_compensation_failure is None
            else _check_policy(f"step {step_name!r}", on_compensation_failure)
        )
        if kind is not StepKind.COMPENSATABLE:
            compensate = None
        elif compensate is not MISSING and compensate is not None:
            check_compensation(step_name, compensate)
        check_callable(step_name, "action", fn, 2)
        default_retry = FORWARD_RETRY if kind is StepKind.RETRIABLE else Retry()
        step: Step[I, Any] = Step(
            self,
            len(self.steps),
            step_name,
            kind,
            fn,
            compensation=compensate,
            retry=retry or default_retry,
            compensation_retry=compensation_retry or FORWARD_RETRY,
            not_applied=tuple(not_applied),
            classifier=classify,
            timeout=step_timeout,
            codec=codec,
            signal=signal,
            on_compensation_failure=policy,
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

    def has_async(self) -> bool:
        """Whether a step's action or compensation is a coroutine function (``async def``).

        The runner asks on every run, so the answer is kept for the callables it was worked out for
        (looking at each function costs more than a short step's own work); a step whose action or
        compensation was replaced since is looked at again.
        """
        current = [(s.action, s.compensation_fn) for s in self.steps]
        cached = self._coroutines
        if cached is None or cached[0] != current:
            found = any(_is_async(action) or _is_async(undo) for action, undo in current)
            self._coroutines = cached = (current, found)
        return cached[1]

    def started_row(self, index: int) -> StepRecord:
        """Step ``index``'s row as a run writes it STARTED: its compensation registered, no trace,
        no journal times yet.

        Records are immutable, so one row serves every run of the definition (building one per step
        shows in a step's overhead); it is built again if the step's compensation was replaced.
        """
        step = self.steps[index]
        cached = self._started_rows.get(index)
        if cached is not None and cached[0] is step.compensation_fn:
            return cached[1]
        row = StepRecord(index, step.name, step.kind, StepState.STARTED, compensation=step.compensation_name)
        self._started_rows[index] = (step.compensation_fn, row)
        return row

    def for_run(self, snapshot: SagaSnapshot, guard: Guard) -> Saga[Any]:
        """The definition that drives the instance ``snapshot`` (just claimed), whose effects go
        through ``guard``. A declared saga: itself. A saga whose steps are decided as it runs (an
        agent run's, :class:`sagaguard.saga.agent.AgentSaga`) builds one from the journal's rows.

        Raises:
            DefinitionMismatch: the rows name something this process cannot run.
        """
        return self

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


def _is_async(fn: Any) -> bool:
    return fn is not None and inspect.iscoroutinefunction(fn)


def _check_policy(what: str, policy: CompensationPolicy | str) -> CompensationPolicy:
    try:
        return CompensationPolicy(policy)
    except (ValueError, TypeError):
        choices = " or ".join(repr(p.value) for p in CompensationPolicy)
        raise DefinitionError(f"{what}: on_compensation_failure must be {choices}, got {policy!r}") from None


def _check_timeout(what: str, timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout):
        raise SignatureError(f"{what}: timeout must be a finite number of seconds, got {timeout!r}")
    if timeout < 0:
        raise SignatureError(f"{what}: timeout must be >= 0, got {timeout!r}")
    return float(timeout)
