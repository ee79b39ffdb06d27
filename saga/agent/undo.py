"""Undo functions by name: the registry an agent's code fills at import.

::

    undos = UndoRegistry()

    @undos.register
    def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
        hotel.cancel(result["booking_id"] if result else arguments["reference"])

The journal records an undo by its name only, never by a type or module taken from stored data, so
a worker in a fresh process finds it here (its code imports the same module) and nothing the
journal says can make it import or call anything else.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sagaguard.saga.agent.call import ToolCall
from sagaguard.saga.errors import DefinitionError

__all__ = ["Undo", "UndoRegistry", "undoing"]

Undo = Callable[[Any, Any], object]
"""``undo(arguments, result)``: the tool call's recorded arguments and its recorded result (None
when the call's outcome is unknown: a crash landed between its effect and its record; the call's
identity is then :func:`undoing`'s). It must be idempotent: it runs at least once (through the
guard, under its own key)."""

_undoing: contextvars.ContextVar[ToolCall] = contextvars.ContextVar("sagaguard_undoing")


def undoing() -> ToolCall:
    """The tool call the running undo undoes: its tool, effect name and key (``call.key`` is also
    the scope the tool's body ran in, so ``StripeEffects.undo_charges(undoing().key)`` finds a
    charge made there whose result was never recorded).

    Raises:
        LookupError: no undo is running here.
    """
    call = _undoing.get(None)
    if call is None:
        raise LookupError("undoing() is called outside an undo")
    return call


@contextlib.contextmanager
def undoing_call(call: ToolCall) -> Iterator[None]:
    """Make ``call`` what :func:`undoing` returns while the block runs (the compensation's driver)."""
    reset = _undoing.set(call)
    try:
        yield
    finally:
        _undoing.reset(reset)

F = TypeVar("F", bound=Undo)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,99}")


class UndoRegistry:
    """Undo functions by name. Thread-safe."""

    def __init__(self) -> None:
        self._undos: dict[str, Undo] = {}
        self._lock = threading.Lock()

    def register(self, fn: F, /) -> F:
        """Decorator: register ``fn`` under its ``__name__``. Returns ``fn`` unchanged."""
        return self.add(getattr(fn, "__name__", ""), fn)

    def named(self, name: str) -> Callable[[F], F]:
        """Decorator: register the function under ``name``."""
        return lambda fn: self.add(name, fn)

    def add(self, name: str, fn: F) -> F:
        """Register ``fn`` under ``name`` and return it. Registering the same function again is a
        no-op.

        Raises:
            DefinitionError: a malformed name, ``fn`` not callable, or the name taken by another.
        """
        if not _NAME.fullmatch(name):
            raise DefinitionError(f"undo name {name!r} must be a letter or _ then letters, digits, _ . -")
        if not callable(fn):
            raise DefinitionError(f"undo {name!r} must be callable as undo(arguments, result)")
        with self._lock:
            found = self._undos.get(name)
            if found is not None and found is not fn:
                raise DefinitionError(f"undo {name!r} is already registered to another function")
            self._undos[name] = fn
        return fn

    def get(self, name: str) -> Undo | None:
        """The undo registered as ``name``, or None."""
        with self._lock:
            return self._undos.get(name)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._undos

    def __repr__(self) -> str:
        with self._lock:
            return f"UndoRegistry({sorted(self._undos)!r})"
