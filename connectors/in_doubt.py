"""What an agent's tool call does when an effect it makes is left in doubt.

An effect in doubt (``OutcomeUnknown``: it may or may not have happened, and nothing may repeat it)
is parked on its record for an operator (``sagaguard effects resolve``). The framework adapters
(``ToolGuard``, ``GuardMiddleware``, ``AgentRun``, ``CrewGuard``) take ``on_doubt=``, one of:

- :class:`Stop` (the default): the tool call raises ``OutcomeUnknown`` and the run stops. Rerun it
  after the operator resolved the effect: the tool call then replays the resolved result.
- :class:`ReturnPending`: the tool call returns a structured "pending" result (:class:`Pending`, as
  JSON) that the model can read, and the run goes on. Nothing of it is recorded: the effect stays
  parked, and the tool's next run (a rerun of the same call) replays what the operator resolved.
- :class:`WaitForOperator`: the tool call polls the effect's record until an operator resolved it,
  then runs again (replaying the resolved result; an effect resolved as not applied runs now), up
  to a timeout, after which it does what ``then`` says.

::

    ToolGuard(guard, on_doubt=ReturnPending())
    AgentRun(guard, run_key, on_doubt=WaitForOperator(timeout=600))
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from sagaguard.idempotency.checks import seconds
from sagaguard.idempotency.errors import OutcomeUnknown
from sagaguard.idempotency.records import State
from sagaguard.idempotency.store import IdempotencyStore

__all__ = ["OnDoubt", "Pending", "ReturnPending", "Stop", "WaitForOperator", "asettle", "settle"]

T = TypeVar("T")

_TEXT = (
    "The outcome of {effect!r} is unknown: it may or may not have happened, and it is not repeated "
    "automatically. It is parked for an operator. Do not call the tool again for this request; "
    "tell the user that it is pending confirmation."
)


@dataclass(frozen=True, slots=True)
class Pending:
    """The "pending" tool result handed to the model by :class:`ReturnPending`."""

    effect: str
    """The name of the effect in doubt."""
    key: str
    """Its effect key: ``sagaguard effects show KEY`` / ``effects resolve KEY``."""
    message: str
    """What the model is told."""
    status: str = "pending"

    def as_json(self) -> str:
        """The result as a JSON object: ``{"status": "pending", "effect", "key", "message"}``."""
        return json.dumps(
            {"status": self.status, "effect": self.effect, "key": self.key, "message": self.message}
        )


@dataclass(frozen=True, slots=True)
class Stop:
    """Raise ``OutcomeUnknown``: the run stops until an operator resolved the effect."""


@dataclass(frozen=True, slots=True)
class ReturnPending:
    """Return a :class:`Pending` result the model can read; the run goes on."""

    message: str = _TEXT
    """The text the model reads; ``{effect}`` and ``{key}`` are filled in."""

    def pending(self, exc: OutcomeUnknown) -> Pending:
        """The pending result for the effect ``exc`` is about."""
        effect = exc.record.name
        return Pending(effect=effect, key=exc.key, message=self.message.format(effect=effect, key=exc.key))


@dataclass(frozen=True, slots=True)
class WaitForOperator:
    """Poll the effect's record until an operator resolved it, then run the tool call again.

    Raises:
        ConfigurationError: ``timeout`` is not a finite number of seconds >= 0 or ``interval`` not
            one > 0, naming the option."""

    timeout: float = 300.0
    """Seconds to wait in total (per tool call) before doing what :attr:`then` says."""
    interval: float = 2.0
    """Seconds between two looks at the record."""
    then: Stop | ReturnPending = field(default_factory=Stop)
    """What to do once the timeout passed with the effect still in doubt."""
    sleep: Callable[[float], None] = time.sleep
    """The sleep of sync tool calls (inject one in tests)."""
    async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    """The sleep of async tool calls."""
    clock: Callable[[], float] = time.monotonic
    """The clock the timeout is measured on."""

    def __post_init__(self) -> None:
        # A NaN or negative interval would make a waiting tool call poll without pausing.
        seconds("timeout", self.timeout, zero_ok=True)
        seconds("interval", self.interval)


OnDoubt = Stop | ReturnPending | WaitForOperator
"""The choices of ``on_doubt=``."""


def _still_in_doubt(store: IdempotencyStore, key: str) -> bool:
    record = store.get(key)
    return record is not None and record.state is State.IN_DOUBT


async def _athere(store: IdempotencyStore, key: str) -> bool:
    # The store is sync: read it in a worker thread, off the event loop.
    return await asyncio.to_thread(_still_in_doubt, store, key)


def _still_unknown(on_doubt: OnDoubt, exc: OutcomeUnknown, pending: Callable[[Pending], T]) -> T:
    """What a call that stays in doubt answers, for both drivers: the pending result
    (``ReturnPending``, or a wait ``then=ReturnPending()``), else ``exc`` raised."""
    fallback = on_doubt.then if isinstance(on_doubt, WaitForOperator) else on_doubt
    if isinstance(fallback, ReturnPending):
        return pending(fallback.pending(exc))
    raise exc


def settle(
    call: Callable[[], T], on_doubt: OnDoubt, store: IdempotencyStore, pending: Callable[[Pending], T]
) -> T:
    """Run ``call`` (a guarded tool call) and handle an ``OutcomeUnknown`` as ``on_doubt`` says.

    Args:
        call: the tool call.
        on_doubt: the choice.
        store: where the effect's record is read while waiting.
        pending: turns a :class:`Pending` into the framework's tool result.

    Raises:
        OutcomeUnknown: with :class:`Stop`, or after the wait with ``then=Stop()``.
    """
    deadline: float | None = None
    while True:
        try:
            return call()
        except OutcomeUnknown as exc:
            if isinstance(on_doubt, WaitForOperator):
                if deadline is None:
                    deadline = on_doubt.clock() + on_doubt.timeout
                while on_doubt.clock() < deadline and _still_in_doubt(store, exc.key):
                    on_doubt.sleep(on_doubt.interval)
                if not _still_in_doubt(store, exc.key):
                    continue  # resolved: the call replays (or runs, when resolved as not applied)
            return _still_unknown(on_doubt, exc, pending)


async def asettle(
    call: Callable[[], Awaitable[T]],
    on_doubt: OnDoubt,
    store: IdempotencyStore,
    pending: Callable[[Pending], T],
) -> T:
    """The async twin of :func:`settle` (the record is read in a worker thread)."""
    deadline: float | None = None
    while True:
        try:
            return await call()
        except OutcomeUnknown as exc:
            if isinstance(on_doubt, WaitForOperator):
                if deadline is None:
                    deadline = on_doubt.clock() + on_doubt.timeout
                while on_doubt.clock() < deadline and await _athere(store, exc.key):
                    await on_doubt.async_sleep(on_doubt.interval)
                if not await _athere(store, exc.key):
                    continue
            return _still_unknown(on_doubt, exc, pending)
