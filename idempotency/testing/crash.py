"""Crash points: die with a real SIGKILL where ``$SAGAGUARD_CRASH_AT`` says, in an effect body
(:func:`crash_point`) or around a store call (:class:`CrashingStore`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Collection
from typing import NoReturn

from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import ClaimResult, Disposition, Record, State
from sagaguard.idempotency.store import IdempotencyStore

CRASH_ENV = "SAGAGUARD_CRASH_AT"
"""The environment variable that tells a (child) process where to die: a crash point's name."""

STORE_CRASH_POINTS = (
    "before_claim",
    "after_claim",
    "before_complete",
    "after_complete",
    "before_fail",
    "after_fail",
)
"""Where :class:`CrashingStore` can die. ``before_complete`` is "the effect happened, its result was
not recorded": the crash every guard exists for. ``*_fail`` are the same around a failed attempt."""


def crash_at() -> str | None:
    """The crash point named by ``$SAGAGUARD_CRASH_AT``, or None."""
    value = os.environ.get(CRASH_ENV, "").strip()
    return value or None


def sigkill(point: str) -> NoReturn:
    """Kill this process with SIGKILL, saying where on stderr first (SIGKILL itself is silent)."""
    os.write(2, f"sagaguard.testing: SIGKILL at {point} (pid {os.getpid()})\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # pragma: no cover - the signal is delivered before os.kill returns
        time.sleep(1)


def crash_point(name: str) -> None:
    """Die here, with a real SIGKILL, when ``$SAGAGUARD_CRASH_AT`` names this point.

    Call it from an effect body, e.g. ``crash_point("after_effect")`` right after the HTTP call and
    before returning, to lose a result the world has already acted on. Does nothing otherwise.
    """
    if crash_at() == name:
        sigkill(name)


class CrashingStore:
    """Wraps any :class:`~sagaguard.idempotency.store.IdempotencyStore` and SIGKILLs the process at one point.

    The points are :data:`STORE_CRASH_POINTS`: ``before_claim``, ``after_claim`` (the claim is
    written, the effect has not run), ``before_complete`` (the effect ran, its result is not
    recorded), ``after_complete`` (recorded, the caller has not seen it), and the same two around
    ``fail``. The first call that reaches the point dies; every other call is passed through.

    Args:
        inner: the store to wrap.
        at: the crash point; by default ``$SAGAGUARD_CRASH_AT``. A name that is not a store point
            (say ``after_effect``, meant for :func:`crash_point`) makes this store a plain pass-through.
        kill: what "die" means; the default is :func:`sigkill`. In-process tests may pass a function
            that raises instead (a ``BaseException``, so nothing on the way catches it).

    Raises:
        ValueError: ``at`` was given explicitly and is not one of :data:`STORE_CRASH_POINTS`.
    """

    def __init__(
        self,
        inner: IdempotencyStore,
        at: str | None = None,
        *,
        kill: Callable[[str], NoReturn] = sigkill,
    ) -> None:
        if at is not None and at not in STORE_CRASH_POINTS:
            raise ValueError(f"unknown store crash point {at!r}; choose one of {STORE_CRASH_POINTS}")
        self.inner = inner
        self.at = at if at is not None else crash_at()
        self._kill = kill

    def _point(self, name: str) -> None:
        if self.at == name:
            self._kill(name)

    def now(self) -> float:
        return self.inner.now()

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        self._point("before_claim")
        result = self.inner.claim(identity, fingerprint, lease)
        self._point("after_claim")
        return result

    def get(self, key: str) -> Record | None:
        return self.inner.get(key)

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        self._point("before_complete")
        record = self.inner.complete(key, token, result, retention)
        self._point("after_complete")
        return record

    def fail(
        self, key: str, token: int, disposition: Disposition, error: str, retention: float
    ) -> Record | None:
        self._point("before_fail")
        record = self.inner.fail(key, token, disposition, error, retention)
        self._point("after_fail")
        return record

    def heartbeat(self, key: str, token: int, lease: float) -> float:
        return self.inner.heartbeat(key, token, lease)

    def take_over(self, key: str, token: int, lease: float) -> Record | None:
        return self.inner.take_over(key, token, lease)

    def list(
        self,
        *,
        states: Collection[State] | None = None,
        namespace: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[Record]:
        return self.inner.list(states=states, namespace=namespace, limit=limit, after=after)

    def purge(self, *, limit: int = 1000) -> int:
        return self.inner.purge(limit=limit)

    def ledger_id(self) -> str:
        # Forwarded: the wrapped ledger's provider keys must be the ones its guard derives unwrapped.
        return self.inner.ledger_id()

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"CrashingStore({self.inner!r}, at={self.at!r})"
