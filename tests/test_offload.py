"""The worker threads that async code hands blocking store calls to (:mod:`idempotency.offload`).

What ``asyncio.to_thread`` promises, kept: the outcome (value or exception) reaches the awaiting
task, the call sees the caller's contextvars, a cancelled caller does not stop the call; a closing
loop waits for a call still running, and a forked child gets threads of its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import threading

import pytest

from idempotency import offload

who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


def test_the_value_comes_back_from_a_worker_thread() -> None:
    def work(a: int, b: int) -> tuple[int, str]:
        return a + b, threading.current_thread().name

    total, thread = asyncio.run(offload.in_thread(work, 2, 3))
    assert total == 5
    assert thread != threading.current_thread().name


def test_the_exception_is_raised_in_the_awaiting_task() -> None:
    def work() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        asyncio.run(offload.in_thread(work))


def test_stop_iteration_arrives_as_a_runtime_error() -> None:
    """A future refuses StopIteration (asyncio.to_thread would leave its caller waiting for ever)."""

    def work() -> None:
        raise StopIteration

    with pytest.raises(RuntimeError, match="StopIteration") as raised:
        asyncio.run(asyncio.wait_for(offload.in_thread(work), 10))
    assert isinstance(raised.value.__cause__, StopIteration)


def test_the_call_sees_the_callers_context_and_changes_none_of_it() -> None:
    def work() -> str:
        seen = who.get()
        who.set("worker")
        return seen

    async def main() -> tuple[str, str]:
        who.set("caller")
        seen = await offload.in_thread(work)
        return seen, who.get()

    assert asyncio.run(main()) == ("caller", "caller")


def test_a_cancelled_caller_does_not_stop_the_call() -> None:
    started, proceed, finished = threading.Event(), threading.Event(), threading.Event()

    def work() -> int:
        started.set()
        proceed.wait(10)
        finished.set()
        return 1

    async def main() -> None:
        task = asyncio.ensure_future(offload.in_thread(work))
        await offload.in_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        proceed.set()
        await offload.in_thread(finished.wait, 10)

    asyncio.run(main())
    assert finished.is_set()
    assert asyncio.run(offload.in_thread(lambda: 2)) == 2  # the worker serves on


def test_a_loop_closing_waits_for_a_call_still_running() -> None:
    # A store write handed to a thread by a call whose loop then closes is not cut off:
    # asyncio.run shuts the default executor down, which waits for it.
    started, proceed, done = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        proceed.wait(10)
        done.set()

    async def main() -> None:
        offload.submit(work)  # never awaited
        await offload.in_thread(started.wait, 10)
        proceed.set()

    asyncio.run(main())
    assert done.is_set()
    assert asyncio.run(offload.in_thread(lambda: 7)) == 7  # the next loop's calls run


def test_many_calls_at_once_all_run() -> None:
    calls = 100  # more than the default executor's threads: the rest wait their turn

    async def main() -> list[int]:
        return list(await asyncio.gather(*(offload.in_thread(lambda i=i: i) for i in range(calls))))

    assert asyncio.run(main()) == list(range(calls))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_starts_its_own_workers() -> None:
    """The child has none of the parent's threads: its own loop's executor starts its own."""
    assert asyncio.run(offload.in_thread(lambda: 1)) == 1  # the parent has a worker, idle
    pid = os.fork()
    if pid == 0:  # the child: the alarm turns a hang into a failure
        code = 1
        try:
            signal.alarm(10)
            code = 0 if asyncio.run(offload.in_thread(lambda: 42)) == 42 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
