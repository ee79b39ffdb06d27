"""Where a table set stands, and bringing it to this code's revision (Alembic).

Opening a store, journal or outbox costs one query when its tables are at this code's revision:
the version table's row is read with SQLAlchemy, and Alembic is imported only when the answer is
anything else. A new database is created at this code's layout and stamped with the head
revision (Alembic's recipe for building a database from scratch); a database that is behind is
upgraded by ``alembic.command.upgrade`` through this package's ``env.py``, on the caller's
connection and transaction. On Postgres an advisory lock held for that transaction serialises
concurrent upgraders, and Postgres's transactional DDL makes each upgrade all or nothing; on
SQLite the writer lock (``BEGIN IMMEDIATE``) does both.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from sagaguard.idempotency.backends.sql_engine import retry_locked
from sagaguard.idempotency.errors import SchemaVersionMismatch, StoreError, StoreUnavailable
from sagaguard.idempotency.migrations.tableset import TableSet

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

__all__ = [
    "LOCK_ID",
    "SchemaState",
    "SchemaStatus",
    "alembic_config",
    "ensure_schema",
    "schema_status",
    "upgrade_schema",
]

T = TypeVar("T")

LOCK_ID = 0x5A6A_6D67
"""The Postgres advisory lock every schema change of sagaguard's takes for its transaction."""
_HERE = Path(__file__).parent
NAME_ATTRIBUTE = "sagaguard_name"
"""The key of ``Config.attributes`` that holds the configured table name or prefix."""


class SchemaState(enum.StrEnum):
    """Where a table set's tables stand against this code."""

    EMPTY = "empty"
    """No table and no recorded revision: ``db upgrade`` (or ``create=True``) creates them."""
    BEHIND = "behind"
    """An older revision is recorded, or the tables were made before versioned schemas."""
    UP_TO_DATE = "up to date"
    """The recorded revision is this code's."""
    AHEAD = "ahead"
    """The recorded revision is unknown here: a newer sagaguard wrote it."""


@dataclass(frozen=True)
class SchemaStatus:
    """One table set's standing in one database."""

    table_set: str
    """The table set's name (``effects``)."""
    name: str
    """Its configured table name or prefix."""
    version_table: str
    """The Alembic version table that records its revision."""
    current: str | None
    """The recorded revision; None when none is recorded."""
    head: str
    """This code's revision."""
    state: SchemaState
    unversioned: bool = False
    """Its tables exist without a recorded revision (made by a sagaguard before versioned schemas)."""

    def as_json(self) -> dict[str, Any]:
        """The status as a JSON object."""
        return {
            "table_set": self.table_set,
            "name": self.name,
            "version_table": self.version_table,
            "current": self.current,
            "head": self.head,
            "state": self.state.value,
            "unversioned": self.unversioned,
        }


def alembic_config(table_set: TableSet, value: str, connection: sa.Connection | None = None) -> Config:
    """An Alembic configuration for ``table_set`` under the configured ``value``: this package's
    ``env.py``, the set's revision folder, its version table; no ``alembic.ini``.

    Args:
        table_set: the table set.
        value: its configured table name or prefix.
        connection: the connection (and transaction) the migrations run on.
    """
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(_HERE))
    config.set_main_option("version_locations", str(table_set.versions))
    config.set_main_option("path_separator", "os")
    config.attributes.update(
        {NAME_ATTRIBUTE: value, "version_table": table_set.version_table_for(value), "connection": connection}
    )
    return config


_scripts: dict[str, ScriptDirectory] = {}


def _script(table_set: TableSet) -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    found = _scripts.get(table_set.name)
    if found is None:
        found = _scripts[table_set.name] = ScriptDirectory.from_config(
            alembic_config(table_set, table_set.default)
        )
    return found


def _translated(action: Callable[[], T]) -> T:
    try:
        return action()
    except sa_exc.SQLAlchemyError as exc:
        orig = getattr(exc, "orig", None) or exc
        text = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.TimeoutError):
            raise StoreUnavailable(f"database unavailable: {text}") from exc
        raise StoreError(f"database error: {text}") from exc


def _recorded(conn: sa.Connection, version_table: str) -> tuple[str, ...]:
    from alembic.migration import MigrationContext

    context = MigrationContext.configure(conn, opts={"version_table": version_table})
    return tuple(context.get_current_heads())


def _status(conn: sa.Connection, table_set: TableSet, value: str) -> SchemaStatus:
    version_table = table_set.version_table_for(value)
    heads = _recorded(conn, version_table)
    current = ", ".join(heads) or None
    unversioned = False
    if heads == (table_set.head,):
        state = SchemaState.UP_TO_DATE
    elif not heads:
        present = set(sa.inspect(conn).get_table_names())
        unversioned = any(table.name in present for table in table_set.tables(value))
        state = SchemaState.BEHIND if unversioned else SchemaState.EMPTY
    else:
        known = {script.revision for script in _script(table_set).walk_revisions()}
        state = SchemaState.BEHIND if set(heads) <= known else SchemaState.AHEAD
    return SchemaStatus(table_set.name, value, version_table, current, table_set.head, state, unversioned)


def _value(table_set: TableSet, names: Mapping[str, str]) -> str:
    return names.get(table_set.name, table_set.default)


def schema_status(
    engine: sa.Engine, table_sets: Iterable[TableSet], names: Mapping[str, str] | None = None
) -> list[SchemaStatus]:
    """Where each of ``table_sets`` stands in the database of ``engine``. Writes nothing.

    Args:
        engine: the database.
        table_sets: the table sets to look at.
        names: configured table names or prefixes by table set name (default: each set's default).

    Raises:
        ConfigurationError: a configured name is not valid.
        StoreUnavailable: the database cannot be reached.
        StoreError: the database failed.
    """

    def read() -> list[SchemaStatus]:
        with engine.connect() as conn:
            return [_status(conn, ts, _value(ts, names or {})) for ts in table_sets]

    return _translated(read)


def upgrade_schema(engine: sa.Engine, table_set: TableSet, value: str | None = None) -> SchemaStatus:
    """Create ``table_set``'s tables, or migrate them, to this code's revision. Safe to run again
    and from several processes at once.

    Args:
        engine: the database (SQLite or Postgres); the role needs the right to create and alter
            tables.
        table_set: the table set.
        value: its configured table name or prefix (default: the set's default).

    Returns:
        Where the set stood before (``state`` ``up to date`` when there was nothing to do).

    Raises:
        SchemaVersionMismatch: the database records a revision newer than this code's.
        ConfigurationError: the configured name is not valid.
        StoreUnavailable: the database cannot be reached.
        StoreError: the database failed (the transaction is rolled back: nothing changed).
    """
    name = table_set.default if value is None else value
    table_set.tables(name)  # a bad name is a ConfigurationError before any I/O

    def run() -> SchemaStatus:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": LOCK_ID})
            before = _status(conn, table_set, name)
            if before.state is SchemaState.AHEAD:
                raise _mismatch(before, _shown(engine), table_set)
            if before.state is SchemaState.EMPTY:
                from alembic.migration import MigrationContext

                table_set.create(conn, name)
                context = MigrationContext.configure(conn, opts={"version_table": before.version_table})
                context.stamp(_script(table_set), table_set.head)
            elif before.state is SchemaState.BEHIND:
                from alembic import command

                command.upgrade(alembic_config(table_set, name, conn), table_set.head)
            return before

    if engine.dialect.name != "sqlite":
        return _translated(run)
    done: list[SchemaStatus] = []  # several processes opening one new SQLite file at once
    _translated(lambda: retry_locked(lambda: done.append(run())))
    return done[-1]


def ensure_schema(
    engine: sa.Engine, table_set: TableSet, value: str, *, create: bool | None, url: str
) -> None:
    """Make sure ``table_set``'s tables are at this code's revision as a store opens.

    At this code's revision it costs one query (the version table's row, read without Alembic).
    Otherwise, by ``create``:

    - None (the stores' default): tables that do not exist yet are created at this revision and
      stamped (a new database: the quickstart is one step); tables older or newer than the code
      are refused, never altered at open (upgrading is ``sagaguard db upgrade``, reviewed and run
      by a role that may change the schema);
    - True: missing tables are created and older ones upgraded (:func:`upgrade_schema`);
    - False: nothing is written; tables missing, older or newer are refused.

    Args:
        engine: the database.
        table_set: the table set.
        value: its configured table name or prefix.
        create: what may be written (above).
        url: the database's URL, for messages (its password is masked here).

    Raises:
        SchemaVersionMismatch: the tables are newer than this code, older (unless ``create`` is
            True) or missing (when ``create`` is False); the message names the command to run.
        ConfigurationError: the configured name is not valid.
        StoreUnavailable: the database cannot be reached.
        StoreError: the database failed.
    """
    version_table = table_set.version_table_for(value)
    quoted = engine.dialect.identifier_preparer.quote(version_table)
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql(f"SELECT version_num FROM {quoted}").all()
        if [row[0] for row in rows] == [table_set.head]:
            return
    except sa_exc.SQLAlchemyError:
        pass  # no version table yet, or the database is away: the full look says which
    if create:
        upgrade_schema(engine, table_set, value)
        return

    def look() -> SchemaStatus:
        with engine.connect() as conn:
            return _status(conn, table_set, value)

    status = _translated(look)
    if status.state is SchemaState.UP_TO_DATE:
        return
    if create is None and status.state is SchemaState.EMPTY:
        upgrade_schema(engine, table_set, value)  # creates at this revision, stamped; safe to race
        return
    raise _mismatch(status, url, table_set)


def shown_url(engine: sa.Engine) -> str:
    """``engine``'s URL with its password masked, as messages show it."""
    return _shown(engine)


def _shown(engine: sa.Engine) -> str:
    url = engine.url
    if url.drivername == "postgresql+psycopg":  # what make_engine made of a postgresql:// URL
        url = url.set(drivername="postgresql")
    return url.render_as_string(hide_password=True)


def _command(status: SchemaStatus, table_set_option: str | None, url: str, verb: str) -> str:
    named = f" {table_set_option} {status.name}" if table_set_option else ""
    return f"sagaguard db {verb} --store {url}{named}"


def _mismatch(status: SchemaStatus, url: str, table_set: TableSet) -> SchemaVersionMismatch:
    from sagaguard.idempotency.backends.urls import masked

    shown = masked(url)
    option = table_set.option() if status.name != table_set.default else None
    where = f"the {table_set.what} tables ({table_set.name} {status.name!r}) at {shown}"
    if status.state is SchemaState.AHEAD:
        command = None
        message = (
            f"{where} are at schema revision {status.current}, newer than this sagaguard's "
            f"{status.head}: upgrade sagaguard (`{_command(status, option, shown, 'status')}` shows "
            "where each table set stands)"
        )
    else:
        command = _command(status, option, shown, "upgrade")
        if status.state is SchemaState.EMPTY:
            problem = "do not exist"
        elif status.unversioned:
            problem = f"were made before versioned schemas (this sagaguard uses revision {status.head})"
        else:
            problem = f"are at schema revision {status.current}, this sagaguard uses {status.head}"
        message = f"{where} {problem}: run `{command}`"
    return SchemaVersionMismatch(
        message,
        table_set=status.table_set,
        name=status.name,
        current=status.current,
        head=status.head,
        state=status.state.value,
        command=command,
    )
