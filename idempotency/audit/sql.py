"""The audit log in the ledger's SQL database (SQLite or PostgreSQL), beside the effects table.

The table is the ``audit`` table set's (:mod:`sagaguard.idempotency.migrations.audit`): opened with
``create`` it is created (or upgraded) and stamped at this code's revision, as the stores do;
without it, a missing, older or newer table is refused with the command that fixes it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from sagaguard.idempotency.audit.records import AuditEntry, AuditFilter, Outcome, TargetKind
from sagaguard.idempotency.audit.sql_schema import DEFAULT_TABLE, audit_tables
from sagaguard.idempotency.backends.sql_engine import make_engine
from sagaguard.idempotency.errors import ConfigurationError, StoreError, StoreUnavailable
from sagaguard.idempotency.migrations.audit import TABLE_SET as AUDIT
from sagaguard.idempotency.migrations.runner import ensure_schema, shown_url

__all__ = ["SqlAudit"]


class SqlAudit:
    """An :class:`~sagaguard.idempotency.audit.records.AuditLog` in the audit table (``sagaguard_audit``).

    Args:
        url_or_engine: the ledger's ``sqlite:///`` or ``postgresql://`` URL, or an engine (then left
            open by :meth:`close`).
        table_name: the audit table; a store under another effects table keeps its audit in
            :func:`~sagaguard.idempotency.audit.sql_schema.audit_table_for` of that name.
        create: as the stores': None (the default): create the table when missing (a new
            database), at this code's schema revision, and refuse a table at an older or newer
            revision, naming ``sagaguard db upgrade`` (nothing is altered at open); True: also
            upgrade a table when older; False: write no DDL and refuse a table missing, older or
            newer.

    Raises:
        ConfigurationError: a malformed URL or table name.
        SchemaVersionMismatch: the table is newer than this code, older (unless ``create`` is
            True) or missing (``create`` False); the message names ``sagaguard db upgrade``.
        StoreUnavailable: the database cannot be reached.
    """

    def __init__(
        self, url_or_engine: str | sa.Engine, *, table_name: str = DEFAULT_TABLE, create: bool | None = None
    ) -> None:
        (self._table,) = audit_tables(table_name)
        self._owned = isinstance(url_or_engine, str)
        self._engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
        url = url_or_engine if isinstance(url_or_engine, str) else shown_url(self._engine)
        try:
            ensure_schema(self._engine, AUDIT, table_name, create=create, url=url)
        except BaseException:
            self.close()
            raise

    @contextmanager
    def _begin(self) -> Iterator[sa.Connection]:
        try:
            with self._engine.begin() as conn:
                yield conn
        except sa.exc.OperationalError as exc:
            raise StoreUnavailable(f"SQL audit log unavailable: {exc.orig or exc}") from exc
        except sa.exc.SQLAlchemyError as exc:
            raise StoreError(f"SQL audit log failed: {exc}") from exc

    def _values(self, entry: AuditEntry) -> dict[str, Any]:
        values: dict[str, Any] = entry.to_json()
        del values["id"]
        values["args"] = json.dumps(values["args"], separators=(",", ":"), ensure_ascii=False)
        return values

    def record(self, entry: AuditEntry) -> AuditEntry:
        """Append ``entry`` (one INSERT, its own transaction); returns it with its row id.

        Raises:
            ConfigurationError: a bulk entry (:meth:`claim` records those).
        """
        if entry.kind is TargetKind.BULK:
            raise ConfigurationError("a bulk action's entry is recorded by claim()")
        table = self._table
        with self._begin() as conn:
            row_id = conn.execute(
                sa.insert(table).values(**self._values(entry)).returning(table.c.id)
            ).scalar_one()
        return AuditEntry.from_json({**entry.to_json(), "id": str(row_id)})

    def claim(self, entry: AuditEntry) -> AuditEntry | None:
        """Record the bulk action's ``entry`` unless its action id (``target``) is recorded already:
        one INSERT against the table's unique index on bulk action ids, so of several processes
        claiming one id at once exactly one gets the entry back; the others get None.

        Raises:
            ConfigurationError: ``entry`` is not a bulk action's.
        """
        if entry.kind is not TargetKind.BULK:
            raise ConfigurationError("only a bulk action's entry is claimed")
        table = self._table
        try:
            with self._engine.begin() as conn:
                row_id = conn.execute(
                    sa.insert(table).values(**self._values(entry)).returning(table.c.id)
                ).scalar_one()
        except sa.exc.IntegrityError:
            return None  # the unique index: another claimer recorded this action id first
        except sa.exc.OperationalError as exc:
            raise StoreUnavailable(f"SQL audit log unavailable: {exc.orig or exc}") from exc
        except sa.exc.SQLAlchemyError as exc:
            raise StoreError(f"SQL audit log failed: {exc}") from exc
        return AuditEntry.from_json({**entry.to_json(), "id": str(row_id)})

    def list(self, where: AuditFilter | None = None, *, limit: int = 100) -> list[AuditEntry]:
        """At most ``limit`` entries matching ``where``, newest first."""
        where = where or AuditFilter()
        c = self._table.c
        query = sa.select(self._table).order_by(c.at.desc(), c.id.desc()).limit(limit)
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
