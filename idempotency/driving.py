"""What the guard's two drivers share besides the flow: in-claim retries and calling a reconciler."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import tenacity

from idempotency.effect import NO_RETRY, ReconcileRequest, Unknown
from idempotency.flow import EffectSpec, Flow

__all__ = ["Retrier", "reconciled", "settled"]

log = logging.getLogger("sagaguard.guard")

_NEVER_RETRIED = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)


class Retrier:
    """In-claim retries decided by tenacity's :class:`~tenacity.Retrying`, slept by the caller.

    The guard runs each try itself (inside the claim, under its heartbeat) and sleeps in its own
    way, synchronously or on the event loop; so tenacity is driven through its public attempt
    iterator: a failure is handed to the current attempt, and the iterator's next step says
    whether to try again (after the pause tenacity hands to its ``sleep``, noted here) or to stop
    (``RetryError``). Built on the first failure, so a call that succeeds never builds one.
    """

    __slots__ = ("_attempts", "_current", "_pause", "_spec", "attempt")

    def __init__(self, spec: EffectSpec[Any]) -> None:
        self._spec = spec
        self._pause = 0.0
        retrying = tenacity.Retrying(
            stop=spec.retry.stop,
            wait=spec.retry.wait,
            retry=tenacity.retry_if_exception(spec.retries),
            sleep=self._note,
        )
        self._attempts = iter(retrying)
        self._current: tenacity.AttemptManager | None = next(self._attempts)
        self.attempt = 1
        """The number of the try about to run (1 for the first)."""

    def _note(self, seconds: float) -> None:
        self._pause = float(seconds)

    def next_pause(self, exc: BaseException) -> float | None:
        """Seconds to wait before the next try, or None to stop and report ``exc``."""
        spec, current = self._spec, self._current
        if current is None or isinstance(exc, _NEVER_RETRIED) or spec.retry is NO_RETRY:
            return None
        if not spec.retries(exc):
            return None  # decided here: tenacity would re-raise ``exc`` and add to its traceback
        current.__exit__(type(exc), exc, exc.__traceback__)  # the try failed with ``exc``
        try:
            self._current = next(self._attempts)
        except tenacity.RetryError:  # a stop strategy said so
            self._current = None
            return None
        self.attempt = self._current.retry_state.attempt_number
        return self._pause


def reconciled(flow: Flow[Any], request: ReconcileRequest) -> Any:
    """Call the reconciler; an exception means it could not tell."""
    try:
        return flow.spec.reconciler(request)  # type: ignore[misc]
    except Exception as exc:
        log.warning("reconciler for %s failed; treating as unknown: %r", flow.spec.name, exc)
        return Unknown()


async def settled(pending: Awaitable[Any]) -> Any:
    """Await an async reconciler's answer; an exception means it could not tell."""
    try:
        return await pending
    except Exception as exc:
        log.warning("async reconciler failed; treating as unknown: %r", exc)
        return Unknown()
