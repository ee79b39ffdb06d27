"""What the guard's two drivers share besides the flow: in-claim retries and calling a reconciler."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, cast

import tenacity

from idempotency.effect import NO_RETRY, ReconcileRequest, Unknown
from idempotency.flow import EffectSpec, Flow

__all__ = ["Retrier", "reconciled", "settled"]

log = logging.getLogger("sagaguard.guard")

_NEVER_RETRIED = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)


class Retrier:
    """In-claim retries: tenacity's stop and wait strategies, consulted only after a failure."""

    __slots__ = ("_spec", "_state", "attempt")

    def __init__(self, spec: EffectSpec[Any]) -> None:
        self._spec = spec
        self._state: tenacity.RetryCallState | None = None
        self.attempt = 1

    def next_pause(self, exc: BaseException) -> float | None:
        """Seconds to wait before the next try, or None to stop and report ``exc``."""
        spec = self._spec
        if isinstance(exc, _NEVER_RETRIED) or spec.retry is NO_RETRY or not spec.retries(exc):
            return None
        if self._state is None:
            self._state = tenacity.RetryCallState(cast(Any, None), None, (), {})
        state = self._state
        state.attempt_number = self.attempt
        state.set_exception((type(exc), exc, exc.__traceback__))
        if spec.retry.stop(state):
            return None
        pause = float(spec.retry.wait(state))
        self.attempt += 1
        return pause


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
