"""The saga definitions a process knows, by name and version.

Recovery and signals find a stored instance's definition here, by the name and version its journal
records, so an instance finishes on the version that started it while new instances start on the
latest one::

    registry = SagaRegistry(trip_v1, trip_v2)
    runner = SagaRunner(journal, guard, registry=registry)
    runner.run(registry.latest("trip"), "order-43", order)   # new instances: v2
    recover(journal, guard, registry)                        # an old v1 instance finishes on v1
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from sagaguard.saga.definition import Saga
from sagaguard.saga.errors import DefinitionError, UnknownSaga

__all__ = ["SagaRegistry", "as_registry"]


class SagaRegistry:
    """Saga definitions by ``(name, version)``. Thread-safe; registering freezes a definition.

    Args:
        sagas: definitions to register at once.

    Raises:
        DefinitionError: two different definitions share a name and version.
        StepOrderError: a definition is incomplete (see :meth:`Saga.freeze`).
    """

    def __init__(self, *sagas: Saga[Any]) -> None:
        self._sagas: dict[tuple[str, int], Saga[Any]] = {}
        self._lock = threading.Lock()
        for saga in sagas:
            self.register(saga)

    def register(self, saga: Saga[Any]) -> Saga[Any]:
        """Add ``saga`` (frozen here) and return it. Registering the same object again is a no-op.

        Raises:
            DefinitionError: another definition is registered under the same name and version.
        """
        saga.freeze()
        key = (saga.name, saga.version)
        with self._lock:
            found = self._sagas.get(key)
            if found is not None and found is not saga:
                raise DefinitionError(
                    f"saga {saga.name!r} version {saga.version} is already registered: changed steps "
                    "need a new version"
                )
            self._sagas[key] = saga
        return saga

    def get(self, name: str, version: int) -> Saga[Any]:
        """The definition of ``name`` at ``version``.

        Raises:
            UnknownSaga: none is registered.
        """
        with self._lock:
            found = self._sagas.get((name, version))
        if found is None:
            raise UnknownSaga(name, version)
        return found

    def latest(self, name: str) -> Saga[Any]:
        """The highest registered version of ``name`` (the one new instances should start on).

        Raises:
            UnknownSaga: no version of ``name`` is registered.
        """
        versions = self.versions(name)
        if not versions:
            raise UnknownSaga(name, 0)
        return self.get(name, versions[-1])

    def versions(self, name: str) -> list[int]:
        """The registered versions of ``name``, ascending."""
        with self._lock:
            return sorted(v for n, v in self._sagas if n == name)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._sagas

    def __iter__(self) -> Iterator[Saga[Any]]:
        with self._lock:
            return iter([self._sagas[k] for k in sorted(self._sagas)])

    def __len__(self) -> int:
        with self._lock:
            return len(self._sagas)

    def __repr__(self) -> str:
        with self._lock:
            return f"SagaRegistry({sorted(self._sagas)!r})"


def as_registry(sagas: SagaRegistry | Saga[Any] | Iterable[Saga[Any]]) -> SagaRegistry:
    """A registry from a registry (returned as is), one definition or several."""
    if isinstance(sagas, SagaRegistry):
        return sagas
    if isinstance(sagas, Saga):
        return SagaRegistry(sagas)
    return SagaRegistry(*sagas)
