"""The effects table: its SQLModel class, its columns and its two partial indexes.

One row per effect key (:class:`~sagaguard.idempotency.records.Record`). Both indexes are partial, so the two
writes of a guarded call that succeeds (a claim in progress with no expiry, then its success) write
no entry into either: only the index on ``expires_at`` for the retention sweep, and the index on
``(state, key)`` for the rare states an operator lists (in doubt, failed). A table made by an earlier
version gets the columns added since (:data:`ADDED_COLUMNS`) by the ``effects`` table set's first
migration (:mod:`sagaguard.idempotency.migrations.effects`).
"""

from __future__ import annotations

import re
import threading
import types
from typing import Any, Final, cast

import sqlalchemy as sa
from sqlalchemy.orm import registry
from sqlmodel import Field, SQLModel

from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.records import State

__all__ = [
    "ADDED_COLUMNS",
    "COLUMNS",
    "add_missing_columns",
    "create_effects_table",
    "create_records_table",
    "effects_tables",
    "DEFAULT_TABLE",
    "METADATA",
    "RARE",
    "RARE_STATES",
    "SCHEMA_VERSION",
    "EffectFields",
    "EffectRow",
    "effect_model",
]

SCHEMA_VERSION: Final = 4
"""Version of the effects table set's layout (the Alembic revision that records it:
``effects_0003``, which added the ``result_type`` column)."""

DEFAULT_TABLE: Final = "sagaguard_effects"
"""The effects table's name unless told otherwise."""

_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")  # 48 leaves room for index names (63)

COLUMNS: Final = (
    "key, namespace, scope, name, ordinal, fingerprint, state, token, lease_until, attempts, "
    "created_at, updated_at, expires_at, result, error, holder, result_type"
)
"""Every column, in the order of :class:`~sagaguard.idempotency.records.Record`'s fields."""


class _SagaguardModel(SQLModel, registry=registry()):
    """Base of sagaguard's tables: a registry of their own keeps them out of ``SQLModel.metadata``,
    so an application's ``create_all``/``drop_all`` neither creates nor drops them by accident."""


METADATA: Final = _SagaguardModel.metadata
"""The metadata holding sagaguard's tables (give it to Alembic's ``target_metadata``)."""


class EffectFields(_SagaguardModel):
    """The columns of an effects table: :class:`~sagaguard.idempotency.records.Record`, one row per key."""

    key: str = Field(primary_key=True, max_length=80)
    namespace: str = Field(sa_type=sa.Text)
    scope: str = Field(sa_type=sa.Text)
    name: str = Field(sa_type=sa.Text)
    ordinal: int
    fingerprint: str = Field(max_length=80)
    state: str = Field(max_length=16)
    token: int = Field(sa_type=sa.BigInteger)
    lease_until: float = Field(sa_type=sa.Double)
    attempts: int
    created_at: float = Field(sa_type=sa.Double)
    updated_at: float = Field(sa_type=sa.Double)
    expires_at: float | None = Field(default=None, sa_type=sa.Double)  # purge: see _indexes
    result: str | None = Field(default=None, sa_type=sa.Text)
    error: str | None = Field(default=None, sa_type=sa.Text)
    holder: str | None = Field(default=None, sa_type=sa.Text)  # added in schema version 2
    result_type: str | None = Field(default=None, sa_type=sa.Text)  # added in schema version 4


ADDED_COLUMNS: Final = ("holder", "result_type")
"""Nullable text columns added since the first layout (``holder`` by ``effects_0001``,
``result_type`` by ``effects_0003``)."""

RARE_STATES: Final = frozenset({State.IN_DOUBT.value, State.FAILED.value})
"""The states an operator lists and a guarded call that succeeds never writes: the one index on
``state`` holds only these."""
RARE: Final = "state IN (" + ", ".join(f"'{state}'" for state in sorted(RARE_STATES)) + ")"
"""The partial index's condition (SQLite uses the index only for a query that repeats it)."""
_EXPIRING = "expires_at IS NOT NULL"


def _indexes(table_name: str) -> tuple[sa.Index, ...]:
    # Both partial: a new claim (in progress, no expiry) and its success (succeeded) then write
    # one index entry between them instead of four; each entry is a page in the commit's WAL.
    rare, expiring = sa.text(RARE), sa.text(_EXPIRING)
    return (
        # The retention sweep's range scan ("expires_at <= now" implies IS NOT NULL to both
        # planners).
        sa.Index(f"ix_{table_name}_expiring", "expires_at", sqlite_where=expiring, postgresql_where=expiring),
        # (state, key): listing the records in doubt (or failed) a page at a time, in key order, is
        # a range scan.
        sa.Index(f"ix_{table_name}_rare", "state", "key", sqlite_where=rare, postgresql_where=rare),
    )


class EffectRow(EffectFields, table=True):
    """The default effects table, ``sagaguard_effects``."""

    __tablename__ = DEFAULT_TABLE
    __table_args__ = _indexes(DEFAULT_TABLE)


_models: dict[str, type[EffectFields]] = {DEFAULT_TABLE: EffectRow}
_models_lock = threading.Lock()


def effect_model(table_name: str = DEFAULT_TABLE) -> type[EffectFields]:
    """The SQLModel table class for the effects table named ``table_name`` (built once, cached).

    Raises:
        ConfigurationError: the name is not a plain identifier of at most 48 characters.
    """
    if not _TABLE_NAME.fullmatch(table_name):
        raise ConfigurationError(
            f"table name {table_name!r} must be a letter or _ then up to 47 letters, digits or _"
        )
    with _models_lock:
        if table_name not in _models:
            namespace = {"__tablename__": table_name, "__table_args__": _indexes(table_name)}
            name, bases = f"EffectRow_{table_name}", (EffectFields,)
            model = types.new_class(name, bases, {"table": True}, lambda ns: ns.update(namespace))
            _models[table_name] = cast(type[EffectFields], model)
        return _models[table_name]


def effects_tables(table_name: str) -> list[sa.Table]:
    """The ``effects`` table set's tables: the effects table named ``table_name`` and its ledger
    table (:mod:`~sagaguard.idempotency.stores.sql_ledger`).

    Raises:
        ConfigurationError: the name is not a plain identifier of at most 48 characters.
    """
    from sagaguard.idempotency.stores.sql_ledger import ledger_table

    model: Any = effect_model(table_name)
    return [model.__table__, ledger_table(table_name)]


def create_records_table(conn: sa.Connection, table_name: str) -> None:
    """Create the effects table named ``table_name`` and its indexes where missing (layout 2)."""
    model: Any = effect_model(table_name)
    METADATA.create_all(conn, tables=[model.__table__])


def create_effects_table(conn: sa.Connection, table_name: str) -> None:
    """Create the effects table set's tables for a new database, at this code's layout: the effects
    table, its indexes and its ledger table holding a fresh ledger id."""
    from sagaguard.idempotency.keys import new_ledger_id
    from sagaguard.idempotency.stores.sql_ledger import store_ledger_id

    METADATA.create_all(conn, tables=effects_tables(table_name))
    store_ledger_id(conn, table_name, new_ledger_id())


def add_missing_columns(conn: sa.Connection, table_name: str, names: tuple[str, ...]) -> None:
    """Add each nullable text column of ``names`` that the table ``table_name`` lacks (a table made
    by an earlier layout)."""
    present = {column["name"] for column in sa.inspect(conn).get_columns(table_name)}
    quoted = conn.dialect.identifier_preparer.quote(table_name)
    for name in names:
        if name not in present:
            conn.exec_driver_sql(f"ALTER TABLE {quoted} ADD COLUMN {name} TEXT")
