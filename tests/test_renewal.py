"""The shared lease renewer: a run of short holds wakes its thread once, not once per hold."""

from __future__ import annotations

import threading
import time

from sagaguard.idempotency.renewal import Renewer


class _CountingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__()
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def test_short_holds_after_the_first_do_not_wake_the_thread() -> None:
    clock = [100.0]  # renewals are scheduled on this clock; it never reaches the first due time
    renewer = Renewer("test-renewal", monotonic=lambda: clock[0])
    cond = renewer._cond = _CountingCondition()  # count the thread's wake-ups
    try:
        renewer.release(renewer.hold(lambda: True, 10.0))  # starts the thread
        deadline = time.monotonic() + 30
        while renewer._wakes_at == 0.0 and time.monotonic() < deadline:
            time.sleep(0.001)  # until the thread waits: a condition, not a duration
        # The thread waits for the first hold's renewal time although that hold is gone, so the
        # holds of the calls that follow (due no sooner) leave it asleep.
        assert renewer._wakes_at == 110.0
        before = cond.notified
        for _ in range(50):
            renewer.release(renewer.hold(lambda: True, 10.0))
        assert cond.notified == before
        # A hold due sooner than the thread wakes still wakes it.
        renewer.release(renewer.hold(lambda: True, 1.0))
        assert cond.notified == before + 1
    finally:
        renewer.close()
