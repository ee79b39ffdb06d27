"""Undo functions by name: the registry an agent's code fills at import.

::

    undos = UndoRegistry()

    @undos.register
    def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
        hotel.cancel(result["booking_id"] if result else arguments["reference"])

What an undo needs it gets from here, the same way in the agent's process and in the worker:
its dependencies (:meth:`UndoRegistry.provide`, read with :func:`dependency`), the call it undoes
(:func:`undoing`) and the provider key that call's effects were sent under (:func:`provider_key`).

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

from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.saga.agent.call import ToolCall
from sagaguard.saga.errors import DefinitionError

__all__ = ["Undo", "UndoRegistry", "dependency", "provider_key", "undoing"]

Undo = Callable[[Any, Any], object]
"""``undo(arguments, result)``: the tool call's recorded arguments and its recorded result (None
when the call's outcome is unknown: a crash landed between its effect and its record; the call's
identity is then :func:`undoing`'s). It must be idempotent: it runs at least once (through the
guard, under its own key)."""

_undoing: contextvars.ContextVar[tuple[ToolCall, UndoRegistry | None, str, str]] = contextvars.ContextVar(
    "sagaguard_undoing"
)
"""The call being undone here, the registry its undo came from, and the undoing guard's namespace."""


def undoing() -> ToolCall:
    """The tool call the running undo undoes: its tool, effect name and key (``call.key`` is also
    the scope the tool's body ran in, so ``StripeEffects.undo_charges(undoing().key)`` finds a
    charge made there whose result was never recorded).

    Raises:
        LookupError: no undo is running here.
    """
    return _current()[0]


def _current() -> tuple[ToolCall, UndoRegistry | None, str, str]:
    found = _undoing.get(None)
    if found is None:
        raise LookupError("undoing() is called outside an undo")
    return found


def provider_key(effect: str, ordinal: int = 0) -> str:
    """The provider key (the ``Idempotency-Key`` a connector sent) of the guarded effect ``effect``
    made by the undone call's body: its ``ordinal``-th call of that name in the call's scope
    (:func:`undoing`'s ``key``), under the namespace of the guard running the undo (use the same
    namespace for the agent and the worker), in that guard's ledger (its ledger id enters the key:
    :meth:`~sagaguard.idempotency.guard.Guard.provider_key`). An undo whose call's answer was lost finds the
    effect by it, e.g. ``hotel.cancel_by_key(provider_key("booking.hotel"))``.

    Raises:
        LookupError: no undo is running here.
    """
    call, _, namespace, ledger = _current()
    return EffectIdentity.of(namespace, call.key, effect, ordinal, ledger).provider_key


def dependency(name: str, kind: type[D]) -> D:
    """The dependency ``name`` of the running undo's registry (see :meth:`UndoRegistry.provide`):
    what the undo needs (a payments client, a settings object) without plumbing, the same way in
    the agent's process and in the worker.

    Raises:
        LookupError: no undo is running here, or nothing is provided under ``name``.
        TypeError: the value is not a ``kind``.
    """
    _, registry, _, _ = _current()
    if registry is None:
        raise LookupError(f"dependency {name!r}: the running undo has no registry")
    return registry.dependency(name, kind)


@contextlib.contextmanager
def undoing_call(
    call: ToolCall, registry: UndoRegistry | None = None, namespace: str = "default", ledger: str = ""
) -> Iterator[None]:
    """Make ``call`` what :func:`undoing` returns while the block runs (the compensation's driver),
    with the registry :func:`dependency` reads and the namespace and ledger id (the guard's
    :attr:`~sagaguard.idempotency.guard.Guard.ledger_id`) :func:`provider_key` keys in."""
    reset = _undoing.set((call, registry, namespace, ledger))
    try:
        yield
    finally:
        _undoing.reset(reset)


F = TypeVar("F", bound=Undo)
D = TypeVar("D")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,99}")


class UndoRegistry:
    """Undo functions by name. Thread-safe."""

    def __init__(self) -> None:
        self._undos: dict[str, Undo] = {}
        self._factories: dict[str, Callable[[], object]] = {}
        self._values: dict[str, object] = {}
        self._lock = threading.Lock()

    def provide(self, name: str, factory: Callable[[], object]) -> None:
        """Declare the dependency ``name`` of the undos: ``factory()`` builds it, at most once per
        process, on its first use (:func:`dependency`). Declared where the undos are (the module
        the agent and the worker both import), it serves both: the worker builds its own client
        from its settings, with no ``configure()`` handing it over.

        Raises:
            DefinitionError: a malformed name, or a factory that is not callable.
        """
        if not _NAME.fullmatch(name) or not callable(factory):
            raise DefinitionError(f"dependency {name!r} needs a name (letters, digits, _ . -) and a factory")
        with self._lock:
            self._factories[name] = factory

    def use(self, name: str, value: object) -> None:
        """Give the dependency ``name`` in this process (the agent's ready client, a test's fake):
        it wins over the factory of :meth:`provide`.

        Raises:
            DefinitionError: a malformed name.
        """
        if not _NAME.fullmatch(name):
            raise DefinitionError(f"dependency name {name!r} must be a letter or _ then letters, digits, _.-")
        with self._lock:
            self._values[name] = value

    def dependency(self, name: str, kind: type[D]) -> D:
        """The dependency ``name``: the value given by :meth:`use`, else the one its factory built
        (built now on first use; a factory that raises is tried again next time).

        Raises:
            LookupError: nothing is provided under ``name``.
            TypeError: the value is not a ``kind``.
        """
        with self._lock:
            if name in self._values:
                value = self._values[name]
            else:
                factory = self._factories.get(name)
                if factory is None:
                    raise LookupError(f"no dependency {name!r}: declare it with undos.provide(name, factory)")
                # Built under the lock: two undos starting at once build one client, not two.
                value = self._values[name] = factory()
        if not isinstance(value, kind):
            raise TypeError(f"dependency {name!r} is a {type(value).__name__}, not a {kind.__name__}")
        return value

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
