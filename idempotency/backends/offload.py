"""Blocking store calls made from async code, run in worker threads with a lean hand-off.

``asyncio.to_thread`` hands a call to the loop's default executor through a
``concurrent.futures.Future`` chained to an asyncio future, a work item, the executor's locks and a
callback that copies the outcome back. :func:`in_thread` does the same job with one
``SimpleQueue.put``, one asyncio future and one ``call_soon_threadsafe``. It is kept because
``asyncio.to_thread`` (and anyio's ``to_thread.run_sync``) in its place cost the guard's async calls
more CPU per call, and with ``asyncio.to_thread`` guarded calls per second fell by 6 to 19% at 64 and
256 tasks on SQLite and Postgres.

What is kept from ``to_thread``: the call runs in the caller's context (a copy of its contextvars,
so spans and scopes are those of the awaiting task), its exception is raised in the awaiting task,
and cancelling the awaiting task does not stop the call (a thread cannot be interrupted): its
outcome is dropped. Callers that must act on that outcome (the guard gives back a claim made for a
cancelled call) shield the future that :func:`submit` returns.

The workers are daemon threads shared by the process, started on demand up to
``min(32, cpu + 4)`` (the default executor's bound) and kept; each waits on the queue, so an idle
worker costs nothing. After ``fork`` the child starts with none (the parent's threads do not exist
there) and a fresh queue, so a call queued in the parent is never run twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["in_thread", "submit"]

T = TypeVar("T")

_MAX_WORKERS = min(32, (os.cpu_count() or 1) + 4)

_Job = tuple[
    asyncio.AbstractEventLoop, "asyncio.Future[Any]", contextvars.Context, Callable[..., Any], tuple[Any, ...]
]


class _Workers:
    """The process's worker threads and the queue that feeds them."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No workers and an empty queue (also in a forked child: the parent's threads are gone)."""
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        # A token from each worker that finished a job (and waits for the next): a submit that
        # takes one knows an idle worker will pick its job up; one that finds none starts another
        # worker (up to the bound), whose first job is the one that started it. A queue of
        # tokens, not a Semaphore: both ends are then C calls, with no Python lock around them.
        self.idle: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.started = 0
        self.lock = threading.Lock()

    def put(self, job: _Job) -> None:
        self.jobs.put(job)
        try:
            self.idle.get_nowait()
        except queue.Empty:
            with self.lock:
                if self.started < _MAX_WORKERS:
                    self.started += 1
                    name = f"sagaguard-io-{self.started}"
                    threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        jobs, idle = self.jobs, self.idle
        while True:
            _run(jobs.get(), idle)


def _run(job: _Job, idle: queue.SimpleQueue[None]) -> None:
    """Run one job and hand its outcome to the job's loop. The hand-off comes last, after the idle
    token: the woken loop thread needs the GIL, which the worker then gives up at once by waiting
    for its next job."""
    loop, future, context, fn, args = job
    outcome: Callable[[asyncio.Future[Any], Any], None]
    try:
        outcome, value = _succeeded, context.run(fn, *args)
    except BaseException as exc:  # raised in the awaiting task, not here
        outcome, value = _failed, exc
    idle.put(None)
    _deliver(loop, future, outcome, value)


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], how: Any, value: Any) -> None:
    # RuntimeError: the loop was closed while the call ran, and nobody is waiting for the outcome.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(how, future, value)


def _succeeded(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():  # cancelled meanwhile: the outcome is dropped, as to_thread drops it
        future.set_result(value)


def _failed(future: asyncio.Future[Any], exc: BaseException) -> None:
    if isinstance(exc, StopIteration):
        # A future refuses it (it would end a generator), and the caller would wait for ever.
        wrapped = RuntimeError("the call raised StopIteration")
        wrapped.__cause__ = exc
        exc = wrapped
    if not future.done():
        future.set_exception(exc)


_workers = _Workers()


os.register_at_fork(after_in_child=_workers.reset)


def submit(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Start ``fn(*args)`` in a worker thread; the returned future (of the running loop) gets its
    outcome. Must be called from a coroutine or callback running on an event loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    _workers.put((loop, future, contextvars.copy_context(), fn, args))
    return future


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``await asyncio.to_thread(fn, *args)``, with a cheaper hand-off (see the module's docstring)."""
    return await submit(fn, *args)
