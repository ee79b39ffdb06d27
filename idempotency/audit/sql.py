"""The audit log in the ledger's SQL database (SQLite or PostgreSQL), beside the effects table."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from sagaguard.idempotency.audit.records import AuditEntry, AuditFilter, Outcome, TargetKind
from sagaguard.idempotency.audit.sql_schema import METADATA, AuditRow
from sagaguard.idempotency.backends.sql_engine import make_engine, retry_locked
from sagaguard.idempotency.errors import StoreError, StoreUnavailable

__all__ = ["SqlAudit"]

_TABLE: sa.Table = AuditRow.__table__  # type: ignore[attr-defined]


class SqlAudit:
    """An :class:`~sagaguard.idempotency.audit.records.AuditLog` in the ``sagaguard_audit`` table.

    Args:
        url_or_engine: the ledger's ``sqlite:///`` or ``postgresql://`` URL, or an engine (then left
            open by :meth:`close`).
        create: create the table when it is missing (at open, as the stores do); without it, a
            missing table lists no entries.

    Raises:
        ConfigurationError: a malformed URL.
        StoreUnavailable: the database cannot be reached.
    """

    def __init__(self, url_or_engine: str | sa.Engine, *, create: bool = True) -> None:
        self._owned = isinstance(url_or_engine, str)
        self._engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
        self._created = create
        if create:
            if self._engine.dialect.name == "sqlite":
                retry_locked(self._create)
            else:
                self._create()

    def _create(self) -> None:
        with self._begin() as conn:
            METADATA.create_all(conn, tables=[_TABLE])

    @contextmanager
    def _begin(self) -> Iterator[sa.Connection]:
        try:
            with self._engine.begin() as conn:
                yield conn
        except sa.exc.OperationalError as exc:
            raise StoreUnavailable(f"SQL audit log unavailable: {exc.orig or exc}") from exc
        except sa.exc.SQLAlchemyError as exc:
            raise StoreError(f"SQL audit log failed: {exc}") from exc

    def record(self, entry: AuditEntry) -> AuditEntry:
        """Append ``entry`` (one INSERT, its own transaction); returns it with its row id."""
        values: dict[str, Any] = entry.to_json()
        del values["id"]
        values["args"] = json.dumps(values["args"], separators=(",", ":"), ensure_ascii=False)
        with self._begin() as conn:
            row_id = conn.execute(sa.insert(_TABLE).values(**values).returning(_TABLE.c.id)).scalar_one()
        return AuditEntry.from_json({**entry.to_json(), "id": str(row_id)})

    def list(self, where: AuditFilter | None = None, *, limit: int = 100) -> list[AuditEntry]:
        """At most ``limit`` entries matching ``where``, newest first."""
        where = where or AuditFilter()
        if not self._created:  # opened to read only: a ledger nobody acted on has no table yet
            with self._begin() as conn:
                if not sa.inspect(conn).has_table(_TABLE.name):
                    return []
            self._created = True
        c = _TABLE.c
        query = sa.select(_TABLE).order_by(c.at.desc(), c.id.desc()).limit(limit)
        if where.target is not None:
            query = query.where(c.target == where.target)
        if where.target_prefix:
            query = query.where(c.target.startswith(where.target_prefix, autoescape=True))
        if where.actor is not None:
            query = query.where(c.actor == where.actor)
        if where.action:
            if where.action.endswith("."):
                query = query.where(c.action.startswith(where.action, autoescape=True))
            else:
                query = query.where(c.action == where.action)
        if where.since is not None:
            query = query.where(c.at >= where.since)
        if where.until is not None:
            query = query.where(c.at < where.until)
        with self._begin() as conn:
            rows = conn.execute(query).mappings().all()
        return [
            AuditEntry(
                at=float(r["at"]),
                actor=r["actor"],
                action=r["action"],
                kind=TargetKind(r["kind"]),
                target=r["target"],
                args=json.loads(r["args"] or "{}"),
                outcome=Outcome(r["outcome"]),
                error=r["error"],
                message=r["message"],
                source=r["source"],
                id=str(r["id"]),
            )
            for r in rows
        ]

    def close(self) -> None:
        """Dispose of the engine the log made (a given engine is left alone)."""
        if self._owned:
            self._engine.dispose()
