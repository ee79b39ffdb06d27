"""The audit table: its SQLModel class, in the metadata that holds sagaguard's other tables.

One row per operator action (:class:`~sagaguard.idempotency.audit.records.AuditEntry`), with an
index on ``(target, at)`` for a saga's timeline, one on ``at`` for the newest-first listing, and a
partial unique index on ``target`` over the bulk actions' entries: a bulk action id is claimed by
one INSERT, so two consoles racing on one id cannot both act (the database decides).

The table is named after the effect store's table (:func:`audit_table_for`): the default
``sagaguard_effects`` keeps its audit in ``sagaguard_audit``, a store under ``shop_effects`` in
``shop_audit``, so two stores in one database keep separate audit trails. Its schema revision is
the ``audit`` table set's (:mod:`sagaguard.idempotency.migrations.audit`).
"""

from __future__ import annotations

import re
import threading
import types
from typing import Any, Final, cast

import sqlalchemy as sa
from sqlmodel import Field

from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.stores.sql_schema import DEFAULT_TABLE as EFFECTS_TABLE
from sagaguard.idempotency.stores.sql_schema import METADATA, _SagaguardModel

__all__ = [
    "AUDIT_TABLE",
    "BULK_KIND",
    "DEFAULT_TABLE",
    "METADATA",
    "SCHEMA_VERSION",
    "AuditFields",
    "adopt_audit_table",
    "audit_model",
    "audit_table_for",
    "audit_tables",
    "create_audit_table",
]

SCHEMA_VERSION: Final = 1
"""Version of the audit table layout (the Alembic revision that records it: ``audit_0001``)."""

DEFAULT_TABLE: Final = "sagaguard_audit"
"""The audit table's name beside the default effects table."""
AUDIT_TABLE: Final = DEFAULT_TABLE
"""The default audit table's name (an alias of :data:`DEFAULT_TABLE`)."""
BULK_KIND: Final = "bulk"
"""The ``kind`` of a bulk action's entry, whose ``target`` (the action id) is unique."""

# 53 leaves room for the longest index name, ix_<table>_target, in Postgres's 63.
_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,52}")


class AuditFields(_SagaguardModel):
    """The columns of an audit table: args is the JSON text of the entry's arguments."""

    id: int | None = Field(
        default=None, primary_key=True, sa_type=sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    )
    at: float = Field(sa_type=sa.Double)
    actor: str = Field(sa_type=sa.Text)
    action: str = Field(max_length=64)
    kind: str = Field(max_length=16)
    target: str = Field(sa_type=sa.Text)
    args: str = Field(sa_type=sa.Text)
    outcome: str = Field(max_length=16)
    error: str | None = Field(default=None, sa_type=sa.Text)
    message: str | None = Field(default=None, sa_type=sa.Text)
    source: str = Field(max_length=16)


def _bulk_index(table_name: str) -> sa.Index:
    bulk = sa.text(f"kind = '{BULK_KIND}'")
    return sa.Index(f"ux_{table_name}_bulk", "target", unique=True, sqlite_where=bulk, postgresql_where=bulk)


def _indexes(table_name: str) -> tuple[sa.Index, ...]:
    return (
        sa.Index(f"ix_{table_name}_target", "target", "at"),
        sa.Index(f"ix_{table_name}_at", "at"),
        _bulk_index(table_name),
    )


_models: dict[str, type[AuditFields]] = {}
_models_lock = threading.Lock()


def _check(table_name: str) -> str:
    if not isinstance(table_name, str) or not _TABLE_NAME.fullmatch(table_name):
        raise ConfigurationError(
            f"audit table name {table_name!r} must be a letter or _ then up to 52 letters, digits or _"
        )
    return table_name


def audit_model(table_name: str = DEFAULT_TABLE) -> type[AuditFields]:
    """The SQLModel table class for the audit table named ``table_name`` (built once, cached).

    Raises:
        ConfigurationError: the name is not a plain identifier of at most 53 characters.
    """
    _check(table_name)
    with _models_lock:
        if table_name not in _models:
            namespace = {"__tablename__": table_name, "__table_args__": _indexes(table_name)}
            name, bases = f"AuditRow_{table_name}", (AuditFields,)
            model = types.new_class(name, bases, {"table": True}, lambda ns: ns.update(namespace))
            _models[table_name] = cast(type[AuditFields], model)
        return _models[table_name]


def audit_table_for(effects_table: str = EFFECTS_TABLE) -> str:
    """The audit table of the effect store whose table is ``effects_table``: a trailing
    ``effects`` becomes ``audit`` (``sagaguard_effects`` -> ``sagaguard_audit``), any other name
    gets ``_audit`` appended (``fx`` -> ``fx_audit``).

    Raises:
        ConfigurationError: the audit table's name would not be a valid one (over 53 characters).
    """
    if not isinstance(effects_table, str) or not effects_table:
        raise ConfigurationError(f"effects table name {effects_table!r} must be a non-empty string")
    stem = effects_table[: -len("effects")] if effects_table.endswith("_effects") else effects_table + "_"
    return _check(stem + "audit")


def audit_tables(table_name: str) -> list[sa.Table]:
    """The audit table named ``table_name``, as the ``audit`` table set's one table.

    Raises:
        ConfigurationError: the name is not a plain identifier of at most 53 characters.
    """
    model: Any = audit_model(table_name)
    return [model.__table__]


def create_audit_table(conn: sa.Connection, table_name: str) -> None:
    """Create the audit table named ``table_name`` and its indexes where missing."""
    METADATA.create_all(conn, tables=audit_tables(table_name))


def adopt_audit_table(conn: sa.Connection, table_name: str) -> None:
    """Bring an audit table made before versioned schemas (created at open, without the unique
    index on bulk action ids) to layout 1; create it where missing."""
    (table,) = audit_tables(table_name)
    if not sa.inspect(conn).has_table(table_name):
        create_audit_table(conn, table_name)
        return
    present = {index["name"] for index in sa.inspect(conn).get_indexes(table_name)}
    for index in table.indexes:
        if index.name not in present:
            index.create(conn)
