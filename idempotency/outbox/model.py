"""The outbox table, its schema version, and creating or migrating it.

One row per message. The first five columns are Debezium's outbox columns (``id``,
``aggregatetype``, ``aggregateid``, ``type``, ``payload``), so Debezium's outbox event router can
read the table as it is; the rest is the relay's bookkeeping::

    status        pending -> delivered            (then purged after the retention)
                  pending -> dead                 (max attempts, or a permanent error)
                  dead -> pending (replay) | discarded (discard; purged like delivered rows)

A claim leaves ``status`` alone: it sets ``worker_id``, ``lease_until``, ``attempts``, and moves
``available_at`` to the end of the lease. A pending row with a ``worker_id`` is *in flight*. So
``available_at`` is when anyone may claim the row next (the end of its backoff, or of its lease),
and one predicate, ``status = 'pending' AND available_at <= now``, finds every claimable row, an
abandoned claim included. A claim changes no indexed column, so on Postgres it is a HOT update
(the table leaves room on its pages for it: ``fillfactor`` 40, since a batch claims whole pages
of rows at once), which writes no index entry.
Times are seconds since the epoch on the database's clock (or an injected clock). Ids are UUIDv7:
they sort by creation time, and within one process strictly.

The tables are never created behind the caller's back: call :func:`create_tables` (or run
``sagaguard db upgrade``). Each outbox table belongs to the ``outbox`` table set
(:mod:`sagaguard.idempotency.migrations`): its Alembic revision is recorded in ``{table}_version``,
and :func:`check_schema` refuses a table that is missing or at another revision.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
import types
import uuid
from typing import Any, Final, cast

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import registry
from sqlalchemy.sql.expression import FunctionElement
from sqlmodel import Field, SQLModel

from sagaguard.idempotency.errors import ConfigurationError

__all__ = [
    "DEFAULT_TABLE",
    "METADATA",
    "SCHEMA_TABLE",
    "SCHEMA_VERSION",
    "MessageStatus",
    "OutboxFields",
    "OutboxRow",
    "adopt_outbox_table",
    "check_schema",
    "create_outbox_table",
    "create_tables",
    "db_epoch",
    "migrate",
    "outbox_model",
    "outbox_tables",
    "schema_version",
    "uuid7",
]

SCHEMA_VERSION: Final = 2
"""Version of the outbox table layout (recorded as the Alembic revision ``outbox_0001``). A layout
that changes it ships an Alembic revision in :mod:`sagaguard.idempotency.migrations.outbox`.

1: the first layout. 2: adds ``dedup_key`` and its partial unique index (enqueue once per key)."""

DEFAULT_TABLE: Final = "sagaguard_outbox"
SCHEMA_TABLE: Final = "sagaguard_schema"
"""Where releases before versioned schemas recorded each outbox table's layout version (``name``,
``version``); read by nobody now, left in place (an older relay still running reads it)."""

_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")
_FILLFACTOR = 40  # room on each page for the claims' new row versions (HOT updates)


class MessageStatus:
    """The values of the ``status`` column."""

    PENDING: Final = "pending"
    IN_FLIGHT: Final = "in_flight"
    """Not a stored value: what a pending row with a ``worker_id`` (claimed) is called."""
    DELIVERED: Final = "delivered"
    DEAD: Final = "dead"
    DISCARDED: Final = "discarded"


class db_epoch(FunctionElement[float]):
    """The database's time in seconds since the epoch, as a double (a SQL expression).

    Used as the default of the time columns, so a message enqueued through an ORM session gets the
    database's time, the clock the relay's claims compare against.
    """

    type = sa.Double()
    inherit_cache = True


@compiles(db_epoch, "postgresql")
def _pg_epoch(element: db_epoch, compiler: Any, **kw: Any) -> str:
    return "CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)"


@compiles(db_epoch, "sqlite")
def _sqlite_epoch(element: db_epoch, compiler: Any, **kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


@compiles(db_epoch)
def _default_epoch(element: db_epoch, compiler: Any, **kw: Any) -> str:
    raise sa_exc.CompileError("the sagaguard outbox serves SQLite and Postgres only")


_uuid_lock = threading.Lock()
_uuid_last: dict[bool, list[int]] = {False: [0, 0], True: [0, 0]}
"""[milliseconds, counter] of the last id made in this process, on the machine's clock (False)
and on injected clocks (True), so a test's frozen clock does not jump to the real time."""


def uuid7_floor(seconds: float) -> uuid.UUID:
    """The smallest UUIDv7 of the millisecond ``seconds`` (since the epoch) falls in: every id made
    before that millisecond sorts below it."""
    ms = max(0, int(seconds * 1000)) & 0xFFFF_FFFF_FFFF
    return uuid.UUID(int=ms << 80 | 0x7 << 76 | 0b10 << 62)


def uuid7(at: float | None = None) -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, a 12-bit counter, 62 random bits.

    Ids made by one process are strictly increasing, also within one millisecond (the counter,
    started at a random value below 2048, is method 1 of RFC 9562 section 6.2) and also when the
    wall clock steps back (the last millisecond is reused). Ids of different processes sort by
    their millisecond.

    Args:
        at: the time in seconds since the epoch (an injected clock); default: now.
    """
    ms = (time.time_ns() // 1_000_000) if at is None else int(at * 1000)
    with _uuid_lock:
        state = _uuid_last[at is not None]
        last_ms, counter = state
        if ms > last_ms:
            counter = secrets.randbits(11)
        else:
            ms, counter = last_ms, counter + 1
            if counter > 0xFFF:  # 4096 ids in one millisecond: borrow the next one
                ms, counter = ms + 1, secrets.randbits(11)
        state[0], state[1] = ms, counter
    value = (ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62
    return uuid.UUID(int=value | int.from_bytes(os.urandom(8)) >> 2)


class _OutboxModel(SQLModel, registry=registry()):
    """Base of the outbox tables: a registry of its own keeps them out of ``SQLModel.metadata``,
    so an application's ``create_all``/``drop_all`` neither creates nor drops them by accident."""


METADATA: Final = _OutboxModel.metadata
"""The metadata holding the outbox tables (add it to Alembic's ``target_metadata`` list)."""


def _now_default() -> dict[str, Any]:
    return {"default": db_epoch()}


class OutboxFields(_OutboxModel):
    """The columns of an outbox table (see the module docstring)."""

    id: uuid.UUID = Field(primary_key=True, sa_type=sa.Uuid)
    aggregatetype: str = Field(sa_type=sa.Text)
    aggregateid: str = Field(sa_type=sa.Text)
    type: str = Field(sa_type=sa.Text)
    payload: str = Field(sa_type=sa.Text)
    """JSON text."""
    headers: str | None = Field(default=None, sa_type=sa.Text)
    """A JSON object of string headers, or NULL."""
    traceparent: str | None = Field(default=None, sa_type=sa.Text)
    """W3C trace context of the ``create`` span, linked by the relay's ``send`` span."""
    tracestate: str | None = Field(default=None, sa_type=sa.Text)
    provider_key: str = Field(sa_type=sa.Text)
    """The idempotency key handed to the handler for providers that deduplicate."""
    dedup_key: str | None = Field(default=None, sa_type=sa.Text)
    """Enqueue once per key: a second enqueue under it finds this row instead (unique where not
    NULL). A deferred effect's is its effect key. Never updated, so claims stay HOT updates."""
    status: str = Field(default=MessageStatus.PENDING, max_length=16)
    attempts: int = Field(default=0)
    """Claims so far: a relay that dies holding the message has used an attempt."""
    max_attempts: int = Field(default=10)
    available_at: float = Field(sa_type=sa.Double, sa_column_kwargs=_now_default())
    lease_until: float | None = Field(default=None, sa_type=sa.Double)
    worker_id: str | None = Field(default=None, sa_type=sa.Text)
    last_error: str | None = Field(default=None, sa_type=sa.Text)
    created_at: float = Field(sa_type=sa.Double, sa_column_kwargs=_now_default())
    updated_at: float = Field(sa_type=sa.Double, sa_column_kwargs=_now_default())
    delivered_at: float | None = Field(default=None, sa_type=sa.Double)
    """When the message was delivered, dead-lettered or discarded (the retention counts from it)."""


_LIVE = "status = 'pending'"
_KEYED = "dedup_key IS NOT NULL"
_BLOCKING = "status IN ('pending', 'dead')"


def _indexes(table: str) -> tuple[sa.Index, ...]:
    live, blocking = sa.text(_LIVE), sa.text(_BLOCKING)
    dead = sa.text("status = 'dead'")
    return (
        # Claims walk the claimable rows in id order.
        sa.Index(f"ix_{table}_live", "id", postgresql_where=live, sqlite_where=live),
        # "Is an older message of this aggregate still pending (or dead)?": one probe.
        sa.Index(
            f"ix_{table}_aggregate",
            "aggregatetype",
            "aggregateid",
            "id",
            postgresql_where=blocking,
            sqlite_where=blocking,
        ),
        sa.Index(f"ix_{table}_dead", "id", postgresql_where=dead, sqlite_where=dead),
        # Enqueue once per dedup key (``ON CONFLICT DO NOTHING``); rows without one cost no entry.
        sa.Index(
            f"ux_{table}_dedup",
            "dedup_key",
            unique=True,
            postgresql_where=sa.text(_KEYED),
            sqlite_where=sa.text(_KEYED),
        ),
        # No index on delivered rows: every ack would pay for one. Purge walks the primary key,
        # which is creation order, up to the id of the retention cutoff.
    )


class OutboxRow(OutboxFields, table=True):
    """The default outbox table, ``sagaguard_outbox``."""

    __tablename__ = DEFAULT_TABLE
    __table_args__ = _indexes(DEFAULT_TABLE)


_models: dict[str, type[OutboxFields]] = {DEFAULT_TABLE: OutboxRow}
_models_lock = threading.Lock()


def check_table_name(table_name: str) -> str:
    """Return ``table_name`` if it is a plain identifier of at most 48 characters.

    Raises:
        ConfigurationError: it is not.
    """
    if not isinstance(table_name, str) or not _TABLE_NAME.fullmatch(table_name):
        raise ConfigurationError(
            f"table name {table_name!r} must be a letter or _ then up to 47 letters, digits or _"
        )
    return table_name


def outbox_model(table_name: str = DEFAULT_TABLE) -> type[OutboxFields]:
    """The SQLModel table class of the outbox table named ``table_name`` (built once, cached).

    Raises:
        ConfigurationError: the name is not a plain identifier of at most 48 characters.
    """
    check_table_name(table_name)
    with _models_lock:
        if table_name not in _models:
            namespace = {"__tablename__": table_name, "__table_args__": _indexes(table_name)}
            name, bases = f"OutboxRow_{table_name}", (OutboxFields,)
            model = types.new_class(name, bases, {"table": True}, lambda ns: ns.update(namespace))
            _models[table_name] = cast(type[OutboxFields], model)
        return _models[table_name]


def outbox_table(table_name: str = DEFAULT_TABLE) -> sa.Table:
    """The :class:`sqlalchemy.Table` of the outbox table named ``table_name``."""
    model: Any = outbox_model(table_name)
    return cast(sa.Table, model.__table__)


def _notify_ddl(table: str, quoted: str) -> list[str]:
    """Postgres: a statement-level trigger that wakes listening relays when rows are inserted.

    NOTIFY is delivered at commit and a transaction's identical notifications are folded into one,
    so a transaction that enqueues a thousand messages sends one wake-up.
    """
    function = f"{table}_notify"
    return [
        f"""CREATE OR REPLACE FUNCTION "{function}"() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_notify('{table}', ''); RETURN NULL; END $$""",
        f'DROP TRIGGER IF EXISTS "{function}" ON {quoted}',
        f'CREATE TRIGGER "{function}" AFTER INSERT ON {quoted} '
        f'FOR EACH STATEMENT EXECUTE FUNCTION "{function}"()',
    ]


def schema_version(engine: sa.Engine, table_name: str = DEFAULT_TABLE) -> int | None:
    """The layout version of the outbox table ``table_name``: :data:`SCHEMA_VERSION` when it is at
    this code's revision, None when it does not exist, 0 otherwise (unversioned, older or newer:
    ``sagaguard db status`` says which).

    Raises:
        StoreUnavailable, StoreError: the database cannot be reached or failed.
    """
    from sagaguard.idempotency.migrations.outbox import TABLE_SET
    from sagaguard.idempotency.migrations.runner import SchemaState, schema_status

    check_table_name(table_name)
    status = schema_status(engine, [TABLE_SET], {TABLE_SET.name: table_name})[0]
    if status.state is SchemaState.UP_TO_DATE:
        return SCHEMA_VERSION
    return None if status.state is SchemaState.EMPTY else 0


def migrate(engine: sa.Engine, table_name: str = DEFAULT_TABLE) -> int:
    """Create the outbox table, its indexes (and its NOTIFY trigger on Postgres) if missing, or
    bring it to this code's revision (the ``outbox`` table set, as ``sagaguard db upgrade`` does).
    Safe to run again, and from several processes.

    Returns:
        The layout version now in place (:data:`SCHEMA_VERSION`).

    Raises:
        SchemaVersionMismatch: the table is at a revision newer than this code (downgrade refused).
        ConfigurationError: the database is neither SQLite nor Postgres, or the name is not valid.
        StoreUnavailable, StoreError: the database cannot be reached or failed.
    """
    from sagaguard.idempotency.migrations.outbox import TABLE_SET
    from sagaguard.idempotency.migrations.runner import upgrade_schema

    dialect = engine.dialect.name
    if dialect not in ("postgresql", "sqlite"):
        raise ConfigurationError(f"the outbox serves SQLite and Postgres, not {dialect}")
    upgrade_schema(engine, TABLE_SET, check_table_name(table_name))
    return SCHEMA_VERSION


def outbox_tables(table_name: str) -> list[sa.Table]:
    """The outbox table named ``table_name``, as the ``outbox`` table set's one table.

    Raises:
        ConfigurationError: the name is not a plain identifier of at most 48 characters.
    """
    return [outbox_table(table_name)]


def create_outbox_table(conn: sa.Connection, table_name: str) -> None:
    """Create the outbox table ``table_name`` at this code's layout where missing: its indexes and,
    on Postgres, its NOTIFY trigger and fillfactor."""
    METADATA.create_all(conn, tables=[outbox_table(table_name)])
    _postgres_extras(conn, table_name)


def _postgres_extras(conn: sa.Connection, table_name: str) -> None:
    if conn.dialect.name != "postgresql":
        return
    quoted = conn.dialect.identifier_preparer.quote(table_name)
    for statement in _notify_ddl(table_name, quoted):
        conn.exec_driver_sql(statement)
    conn.exec_driver_sql(f"ALTER TABLE {quoted} SET (fillfactor = {_FILLFACTOR})")


def adopt_outbox_table(conn: sa.Connection, table_name: str) -> None:
    """Bring an outbox table made before versioned schemas (layout 1 or 2) to layout 2: each step
    applied only where it is missing."""
    METADATA.create_all(conn, tables=[outbox_table(table_name)])
    quoted = conn.dialect.identifier_preparer.quote(table_name)
    # 1 -> 2: the dedup key. A nullable column without a default is a catalog change only (no
    # table rewrite); the partial index starts empty, since every older row has no key.
    columns = {column["name"] for column in sa.inspect(conn).get_columns(table_name)}
    if "dedup_key" not in columns:
        conn.exec_driver_sql(f"ALTER TABLE {quoted} ADD COLUMN dedup_key TEXT")
    index = conn.dialect.identifier_preparer.quote(f"ux_{table_name}_dedup")
    conn.exec_driver_sql(f"CREATE UNIQUE INDEX IF NOT EXISTS {index} ON {quoted} (dedup_key) WHERE {_KEYED}")
    _postgres_extras(conn, table_name)


create_tables = migrate
"""Alias of :func:`migrate`: creates what is missing and upgrades what is old."""


def check_schema(engine: sa.Engine, table_name: str = DEFAULT_TABLE) -> None:
    """Make sure the outbox table exists at this code's schema revision. Writes nothing.

    Raises:
        SchemaVersionMismatch: the table is missing, unversioned or at another revision (the
            message says what to run: ``sagaguard db upgrade --store URL``).
        StoreUnavailable, StoreError: the database cannot be reached or failed.
    """
    from sagaguard.idempotency.migrations.outbox import TABLE_SET
    from sagaguard.idempotency.migrations.runner import ensure_schema, shown_url

    check_table_name(table_name)
    ensure_schema(engine, TABLE_SET, table_name, create=False, url=shown_url(engine))
