"""Helpers for the connector tests: an in-process "crash", and a sleep that records its pauses.

A real SIGKILL needs a child process (``tests/test_connector_crash.py``); most connector tests only
need the same *state* a kill leaves behind: the provider applied the call and the record was never
written. :func:`crash_before_record` gets there in-process with :class:`CrashingStore` and a kill
that raises :class:`Crash` (a ``BaseException``, so nothing on the way catches it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from conftest import FakeClock

from sagaguard.idempotency import Guard
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.testing import CrashingStore

LEASE = 30.0


class Crash(BaseException):
    """Stands in for SIGKILL in one process: raised by the store at the crash point."""


def _raise(point: str) -> NoReturn:
    raise Crash(point)


def crashing_guard(store: IdempotencyStore, at: str = "before_complete", **options: Any) -> Guard:
    """A guard whose store "dies" at ``at`` (the first time it gets there)."""
    return Guard(CrashingStore(store, at, kill=_raise), lease=LEASE, sleep=lambda s: None, **options)


def crash_before_record(call: Callable[[], Any]) -> None:
    """Run ``call`` (a guarded effect on a :func:`crashing_guard`) and swallow the crash."""
    try:
        call()
    except Crash:
        return
    raise AssertionError("the call did not reach its crash point")


def after_lease(clock: FakeClock) -> None:
    """Move the fake clock past the dead worker's lease, so the next call takes its record over."""
    clock.advance(LEASE + 1)
