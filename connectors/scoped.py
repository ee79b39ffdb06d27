"""One "run inside a scope" decorator for every framework adapter.

Each adapter says how its framework's unit of work (a LangGraph task, a DBOS step, a Temporal
activity) becomes the current scope (a context manager); :func:`scoped_by` turns that into the
decorator, for sync and async functions alike, keeping the wrapped signature.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, Protocol, TypeVar, cast, overload

__all__ = ["ScopedDecorator", "scoped_by"]

P = ParamSpec("P")
R = TypeVar("R")


class ScopedDecorator(Protocol):
    """A decorator that runs a sync or async function inside a scope, keeping its signature."""

    @overload
    def __call__(self, fn: Callable[P, Coroutine[Any, Any, R]], /) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R]: ...


def scoped_by(enter: Callable[[], contextlib.AbstractContextManager[Any]]) -> ScopedDecorator:
    """The decorator that runs a function (sync or async) inside ``enter()``, entered anew on each
    call (each attempt of the unit gets a fresh scope).

    Args:
        enter: makes the unit's scope current (it reads the unit's identity when entered).
    """

    def decorate(fn: Callable[P, Any]) -> Callable[P, Any]:
        if inspect.iscoroutinefunction(fn):
            afn = cast(Callable[P, Coroutine[Any, Any, Any]], fn)

            @functools.wraps(fn)
            async def ascoped(*args: P.args, **kwargs: P.kwargs) -> Any:
                with enter():
                    return await afn(*args, **kwargs)

            return ascoped

        @functools.wraps(fn)
        def scoped(*args: P.args, **kwargs: P.kwargs) -> Any:
            with enter():
                return fn(*args, **kwargs)

        return scoped

    return cast(ScopedDecorator, decorate)
