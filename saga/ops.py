"""The I/O a :class:`~sagaguard.saga.coordinator.SagaFlow` asks its driver for, and the answers it gets.

Each request carries what the driver needs and nothing it must decide: the journal calls, the step
and compensation calls, the sleeps. ``token`` on a call is the saga's fencing token while it runs,
which the driver's lease renewer uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sagaguard.saga.context import StepContext
from sagaguard.saga.records import Phase, StepRecord

__all__ = ["Act", "Begin", "Claim", "Op", "Ran", "Sleep", "Undo", "Write"]


@dataclass(frozen=True, slots=True)
class Begin:
    """Start (create or take over) the saga in the journal. Answer: :class:`StartResult`.

    ``first`` is the first step's STARTED row, written with the saga if this start creates it.
    """

    first: StepRecord | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """Take the saga over if it is due (``journal.claim``). Answer: a snapshot or None."""


@dataclass(frozen=True, slots=True)
class Write:
    """Commit ``phase`` under ``token``. Answer: the saga row after the commit."""

    token: int
    phase: Phase


@dataclass(frozen=True, slots=True)
class Act:
    """Run the action of step ``context.index`` in its scope. Answer: :class:`Ran`.

    ``context.deadline`` (journal time), when set, bounds the call: the driver cancels an async
    action at it, keeps renewing the lease no longer than it, and reports ``finished_at``.
    """

    context: StepContext
    token: int


@dataclass(frozen=True, slots=True)
class Undo:
    """Run the compensation of step ``context.index`` through the guard. Answer: :class:`Ran`.

    ``link`` is the ``traceparent`` the step's journal row keeps, for the compensation span's link.
    """

    context: StepContext
    result: Any
    token: int
    link: str | None = None


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait (the lease is renewed meanwhile). Answer: None."""

    seconds: float
    token: int


@dataclass(frozen=True, slots=True)
class Ran:
    """The outcome of :class:`Act` or :class:`Undo`: a value, or the exception raised.

    ``finished_at`` is the journal's clock after the call, when the call had a deadline or parked.
    """

    value: Any = None
    error: BaseException | None = None
    finished_at: float | None = None


Op = Begin | Claim | Write | Act | Undo | Sleep
