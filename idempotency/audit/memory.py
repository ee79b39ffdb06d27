"""The audit log in the process's memory (the ``memory://`` ledger, tests)."""

from __future__ import annotations

import dataclasses
import threading

from sagaguard.idempotency.audit.records import AuditEntry, AuditFilter

__all__ = ["MemoryAudit"]


class MemoryAudit:
    """An :class:`~sagaguard.idempotency.audit.records.AuditLog` in a list; nothing survives the process."""

    def __init__(self) -> None:
        self._entries: list[AuditEntry] = []
        self._lock = threading.Lock()

    def record(self, entry: AuditEntry) -> AuditEntry:
        """Append ``entry``; its id is its position, counted from 1."""
        with self._lock:
            stored = dataclasses.replace(entry, id=str(len(self._entries) + 1))
            self._entries.append(stored)
        return stored

    def list(self, where: AuditFilter | None = None, *, limit: int = 100) -> list[AuditEntry]:
        """At most ``limit`` entries matching ``where``, newest first."""
        where = where or AuditFilter()
        with self._lock:
            entries = list(self._entries)
        found = [e for e in reversed(entries) if where.matches(e)]
        return found[:limit]

    def close(self) -> None:
        """Nothing to release."""
