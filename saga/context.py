"""What a step's action or compensation is told: :class:`StepContext`, and its wait for a signal.

A step waits for a human (or any outside event) with :meth:`StepContext.wait_for`::

    @trip.step(compensate=None)
    def approve(ctx: StepContext, order: Order) -> Approval:
        return ctx.wait_for("approval", timeout=3 * DAY, payload_type=Approval)

The first time, no signal is recorded: ``wait_for`` raises :class:`~sagaguard.saga.errors.SagaSuspended`, the
runner parks the saga as WAITING and returns, holding nothing. :func:`saga.signal` records the
payload; the recovery sweeper (or a later ``run``) takes the saga over and runs the step again from its
start, and this time ``wait_for`` returns the payload. If the deadline passes first, ``wait_for``
raises :class:`~sagaguard.saga.errors.SignalTimeout`: the step fails *not applied* and the saga compensates.
Because the step runs again from its start, put the wait first in its step (or use
:meth:`Saga.wait <sagaguard.saga.definition.Saga.wait>`, a step that only waits).
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sagaguard.idempotency.codec import Codec
from sagaguard.saga.errors import ResultUnavailable, SagaSuspended, SignalTimeout

if TYPE_CHECKING:
    from sagaguard.saga.definition import Step

__all__ = ["StepContext"]

R = TypeVar("R")
P = TypeVar("P")


@functools.lru_cache(maxsize=256)
def _codec(tp: Any) -> Codec[Any]:
    return Codec(tp)


def _decode(tp: Any, text: str) -> Any:
    try:
        codec = _codec(tp)
    except TypeError:  # unhashable annotation
        codec = Codec(tp)
    return codec.decode(text)


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
    deadline: float | None = None
    """When the step must have finished (journal time: its timeout, or the saga's deadline before
    the pivot), or None. Pass what is left of it to the calls the step makes."""
    now: float = 0.0
    """The journal's clock at the runner's latest commit, shortly before this call."""
    _results: Mapping[str, Any] = field(default_factory=dict, repr=False)
    _signals: Mapping[str, str] = field(default_factory=dict, repr=False)
    _wait: tuple[str | None, float] = field(default=(None, 0.0), repr=False)

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

    def signal(self, name: str, payload_type: type[P] | Any = Any) -> P:
        """The payload of the signal ``name``, delivered earlier, read as ``payload_type``.

        Raises:
            ResultUnavailable: no such signal was delivered (yet).
            CodecError: the payload does not read back as ``payload_type``.
        """
        if name not in self._signals:
            raise ResultUnavailable(f"signal:{name}")
        return typing.cast(P, _decode(payload_type, self._signals[name]))

    def wait_for(
        self,
        name: str,
        *,
        timeout: float | None = None,
        deadline: float | None = None,
        payload_type: type[P] | Any = Any,
    ) -> P:
        """The payload of the signal ``name``; if it has not arrived, park the saga until it does.

        Args:
            name: the signal's name, unique within the saga instance (each name is delivered once).
            timeout: seconds from the first wait until the wait fails; None waits forever (or
                until the saga's own deadline). Waiting again after a crash keeps the first deadline.
            deadline: an absolute deadline on the journal's clock instead of ``timeout``.
            payload_type: the type the payload is read back as (a dataclass, pydantic model, ...).

        Raises:
            SagaSuspended: the signal is not here yet; let it propagate (it is a BaseException).
            SignalTimeout: the deadline passed without the signal; the step fails *not applied*.
            CodecError: the payload does not read back as ``payload_type``.
        """
        if name in self._signals:
            return typing.cast(P, _decode(payload_type, self._signals[name]))
        waiting_for, wait_until = self._wait
        if waiting_for == name and 0 < wait_until <= self.now:
            raise SignalTimeout(name)
        raise SagaSuspended(name, timeout=timeout, deadline=deadline)
