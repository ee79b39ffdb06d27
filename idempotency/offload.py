"""Blocking store calls made from async code, run in the event loop's default executor.

:func:`in_thread` is ``asyncio.to_thread`` and :func:`submit` the same call started at once as a
future (``loop.run_in_executor`` with the caller's context), for callers that must act on the
outcome even when the awaiting task is cancelled (the guard shields it to give back a claim made for
a cancelled call). What ``to_thread`` promises holds for both: the call runs in a copy of the
caller's contextvars (spans and scopes are those of the awaiting task), its exception is raised in
the awaiting task, and cancelling the awaiting task does not stop the call (a thread cannot be
interrupted). The loop's default executor is bounded (``min(32, cpu + 4)`` threads) and
``asyncio.run`` waits for the calls still running when it closes the loop, so a record being
written is never cut off.

One addition: a call that raises ``StopIteration`` arrives as a ``RuntimeError`` (an asyncio
future refuses ``StopIteration``, and the awaiting task would wait for ever).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["in_thread", "submit"]

T = TypeVar("T")


def _no_stop_iteration(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except StopIteration as exc:
        raise RuntimeError("the call raised StopIteration") from exc


def submit(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Start ``fn(*args)`` in the running loop's default executor; the returned future gets its
    outcome. Must be called from a coroutine or callback running on an event loop."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    call = functools.partial(context.run, _no_stop_iteration, fn, *args)
    return loop.run_in_executor(None, call)


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``await asyncio.to_thread(fn, *args)`` (see the module's docstring)."""
    return await asyncio.to_thread(_no_stop_iteration, fn, *args)
