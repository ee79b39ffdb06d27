"""In-claim retries (:class:`sagaguard.idempotency.driving.Retrier`), decided by tenacity's ``Retrying``.

Table tests of the decision alone: which failure is retried, after what pause, and when the stop
strategy ends it. Nothing sleeps: the Retrier only says how long the guard should wait.
"""

from __future__ import annotations

from typing import Any

import pytest
import tenacity

from sagaguard.idempotency.driving import Retrier
from sagaguard.idempotency.effect import NO_RETRY, Retry
from sagaguard.idempotency.options import build_spec


class Flaky(Exception):
    """Declared retryable below."""


class Broken(Exception):
    """Declared permanent below."""


def retrier(retry: Retry) -> Retrier:
    options: dict[str, Any] = {"retry": retry, "retryable": (Flaky,), "permanent": (Broken,)}
    return Retrier(build_spec("pay.charge", Any, options, lease=30.0, retention=60.0, wait=0.0))


def test_retries_until_the_stop_strategy_says_so() -> None:
    tries = retrier(Retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_fixed(0.5)))
    assert tries.attempt == 1
    assert tries.next_pause(Flaky()) == 0.5
    assert tries.attempt == 2
    assert tries.next_pause(Flaky()) == 0.5
    assert tries.attempt == 3
    assert tries.next_pause(Flaky()) is None  # the third try was the last
    assert tries.next_pause(Flaky()) is None  # and it stays stopped


def test_the_wait_strategy_sees_the_attempt_number() -> None:
    tries = retrier(Retry(stop=tenacity.stop_after_attempt(4), wait=tenacity.wait_exponential(multiplier=1)))
    assert [tries.next_pause(Flaky()) for _ in range(4)] == [1.0, 2.0, 4.0, None]


@pytest.mark.parametrize("exc", [Broken(), KeyboardInterrupt(), ValueError("not declared")])
def test_what_is_not_retryable_stops_at_once(exc: BaseException) -> None:
    tries = retrier(Retry(stop=tenacity.stop_after_attempt(5), wait=tenacity.wait_fixed(1)))
    assert tries.next_pause(exc) is None
    assert tries.attempt == 1


def test_no_retry_never_retries() -> None:
    assert retrier(NO_RETRY).next_pause(Flaky()) is None


def test_the_failure_keeps_its_own_traceback() -> None:
    """Deciding a retry adds no frame of tenacity's to the exception the guard reports."""
    tries = retrier(Retry(stop=tenacity.stop_after_attempt(1), wait=tenacity.wait_none()))
    try:
        raise Flaky()
    except Flaky as caught:
        exc = caught
    before = exc.__traceback__
    assert tries.next_pause(exc) is None
    assert exc.__traceback__ is before
