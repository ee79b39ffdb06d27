"""The audit log in the process's memory (the ``memory://`` ledger, tests)."""

from __future__ import annotations

import dataclasses
import threading

from sagaguard.idempotency.audit.records import AuditEntry, AuditFilter, TargetKind
from sagaguard.idempotency.errors import ConfigurationError

__all__ = ["MemoryAudit"]


class MemoryAudit:
    """An :class:`~sagaguard.idempotency.audit.records.AuditLog` in a list; nothing survives the process."""

    def __init__(self) -> None:
        self._entries: list[AuditEntry] = []
        self._lock = threading.Lock()
        self._claimed: set[str] = set()

    def _append(self, entry: AuditEntry) -> AuditEntry:
        stored = dataclasses.replace(entry, id=str(len(self._entries) + 1))
        self._entries.append(stored)
        return stored

    def record(self, entry: AuditEntry) -> AuditEntry:
        """Append ``entry``; its id is its position, counted from 1.

        Raises:
            ConfigurationError: a bulk action's entry (:meth:`claim` records those).
        """
        if entry.kind is TargetKind.BULK:
            raise ConfigurationError("a bulk action's entry is recorded by claim()")
        with self._lock:
            return self._append(entry)

    def claim(self, entry: AuditEntry) -> AuditEntry | None:
        """Append the bulk action's ``entry`` unless its action id is taken (None then); the log's
        lock makes the check and the append one step for every thread of the process.

        Raises:
            ConfigurationError: ``entry`` is not a bulk action's.
        """
        if entry.kind is not TargetKind.BULK:
            raise ConfigurationError("only a bulk action's entry is claimed")
        with self._lock:
            if entry.target in self._claimed:
                return None
            self._claimed.add(entry.target)
            return self._append(entry)

    def list(self, where: AuditFilter | None = None, *, limit: int = 100) -> list[AuditEntry]:
        """At most ``limit`` entries matching ``where``, newest first."""
        where = where or AuditFilter()
        with self._lock:
            entries = list(self._entries)
        found = [e for e in reversed(entries) if where.matches(e)]
        return found[:limit]

    def close(self) -> None:
        """Nothing to release."""
