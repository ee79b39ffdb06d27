"""The worker threads that async code hands blocking store calls to
(:mod:`sagaguard.idempotency.backends.offload`).

What ``asyncio.to_thread`` promises, kept: the outcome (value or exception) reaches the awaiting
task, the call sees the caller's contextvars, a cancelled caller does not stop the call; and what a
shared pool must add: the workers survive a loop that closed under them, stay bounded, and a forked
child gets its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import threading

import pytest

from sagaguard.idempotency.backends import offload

who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


def test_the_value_comes_back_from_a_worker_thread() -> None:
    def work(a: int, b: int) -> tuple[int, str]:
        return a + b, threading.current_thread().name

    total, thread = asyncio.run(offload.in_thread(work, 2, 3))
    assert total == 5
    assert thread.startswith("sagaguard-io-")


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


def test_a_loop_closed_while_its_call_ran_does_not_kill_the_worker() -> None:
    started, proceed, done = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        proceed.wait(10)
        done.set()

    async def main() -> None:
        offload.submit(work)  # never awaited: the loop closes while it runs
        await offload.in_thread(started.wait, 10)

    asyncio.run(main())
    proceed.set()
    assert done.wait(10)
    for _ in range(3 * offload._MAX_WORKERS):  # every worker still serves
        assert asyncio.run(offload.in_thread(lambda: 7)) == 7


def test_workers_are_bounded_and_every_call_runs() -> None:
    calls = 3 * offload._MAX_WORKERS
    gate = threading.Barrier(offload._MAX_WORKERS, timeout=10)

    def work(i: int) -> int:
        if i < offload._MAX_WORKERS:
            gate.wait()  # the first ones run at the same time: one worker each
        return i

    async def main() -> list[int]:
        return list(await asyncio.gather(*(offload.in_thread(work, i) for i in range(calls))))

    assert asyncio.run(main()) == list(range(calls))
    workers = [t for t in threading.enumerate() if t.name.startswith("sagaguard-io-")]
    assert len(workers) <= offload._MAX_WORKERS


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_starts_its_own_workers() -> None:
    """The child has none of the parent's threads; with the parent's idle count it would queue its
    call for a worker that does not exist there, and wait for ever."""
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
