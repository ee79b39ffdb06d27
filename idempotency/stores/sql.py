"""The SQL store: one SQLModel table serving SQLite (the embedded default) and PostgreSQL.

``claim`` is one ``INSERT .. ON CONFLICT (key) DO UPDATE .. WHERE .. RETURNING`` statement (on SQLite
tried after a plain ``INSERT .. ON CONFLICT DO NOTHING``, which settles a new key alone) and every
write after it one fenced ``UPDATE`` (or ``DELETE``), so a new guarded call costs two commits and a
replay one claim. Each of these statements is its own transaction (autocommit): on Postgres one
round trip, on SQLite one commit.

Times come from the database's own clock, read inside the statement that uses them (no extra round
trip), unless a clock is injected: its value is then bound as a parameter. SQLite runs in this
process, so its clock is this host's: there ``time.time()`` is bound (the same instant as SQLite's
``julianday('now')``, to the microsecond rather than the millisecond, and without an expression in
every statement).

SQLite runs in WAL mode with ``synchronous=FULL`` and a 30 s busy timeout. A write of more than one
statement starts with ``BEGIN IMMEDIATE``: a transaction that starts as a reader and later writes
can fail with "database is locked" at once, whatever the timeout, so writers take the lock first. A
single writing statement in autocommit needs no such care: it takes the write lock as it starts,
waiting under the busy timeout, and reads nothing before.

The table is created when missing, with two partial indexes (see ``_indexes``). A table made by an
earlier version gets the columns added since (``holder``) when the store opens with ``create`` set:
one ``ALTER TABLE .. ADD COLUMN`` of a nullable column, idempotent and safe to race.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import re
import threading
import time
import types
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Final, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import registry
from sqlalchemy.pool import QueuePool, StaticPool
from sqlalchemy.sql.compiler import SQLCompiler
from sqlmodel import Field, SQLModel

from idempotency import holder as _holder
from idempotency.errors import ConfigurationError, LostOwnership, StoreError, StoreUnavailable
from idempotency.keys import EffectIdentity
from idempotency.offload import in_thread
from idempotency.records import ClaimOutcome, ClaimResult, Disposition, Record, State
from idempotency.store import WriteCancelled, first_token
from idempotency.stores import pq_async
from idempotency.stores.shelf import Held, Shelf
from idempotency.stores.urls import check_url

__all__ = [
    "DEFAULT_TABLE",
    "METADATA",
    "SCHEMA_VERSION",
    "EffectFields",
    "EffectRow",
    "SqlStore",
    "effect_model",
    "make_engine",
]

T = TypeVar("T")

SCHEMA_VERSION: Final = 2
"""Version of the effects table layout."""

DEFAULT_TABLE: Final = "sagaguard_effects"

_BUSY_TIMEOUT_MS = 30_000
_CONNECT_TIMEOUT_S = 5
_CLAIM_ATTEMPTS = 5
_HELD_MAX = 4096
"""Claimed records a store remembers for ``complete_held``; past this many (claims never completed
nor failed, e.g. by code driving the store itself) it forgets them all and starts afresh."""
_BUSY_PRAGMA = f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}"
_SLOW_WRITE = 0.002  # seconds: while this store's writes take longer than this on average ...
_WRITE_WEIGHT = 0.125  # ... (a moving average, each write weighing this much), none is made on the loop
_RLOCK = type(threading.RLock())


class _Wait:
    """The answer of a write that would have had to wait (see ``SqlStore._write_now``)."""


_WAIT: Final = _Wait()


def _statement_name(sql: str) -> str:
    """A prepared statement's name that only this text has (stores of other tables or clocks share
    connections of one engine, and psycopg's own names start with ``_pg3_``)."""
    return "sagaguard_" + hashlib.sha256(sql.encode()).hexdigest()[:24]


_DDL_LOCK_ID = 0x5A6A_6775  # any constant: serialises concurrent CREATE TABLE on Postgres
_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")  # 48 leaves room for index names (63)
_COLUMNS = (
    "key, namespace, scope, name, ordinal, fingerprint, state, token, lease_until, attempts, "
    "created_at, updated_at, expires_at, result, error, holder"
)
_LIVE = "('in_progress', 'in_doubt')"
_FINISHED = "('succeeded', 'failed')"
_DB_NOW = {  # the database's time in seconds since the epoch, as a double
    "postgresql": "CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}


class _SagaguardModel(SQLModel, registry=registry()):
    """Base of sagaguard's tables: a registry of their own keeps them out of ``SQLModel.metadata``,
    so an application's ``create_all``/``drop_all`` neither creates nor drops them by accident."""


METADATA: Final = _SagaguardModel.metadata
"""The metadata holding sagaguard's tables (give it to Alembic's ``target_metadata``)."""


class EffectFields(_SagaguardModel):
    """The columns of an effects table: :class:`~idempotency.records.Record`, one row per key."""

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


_ADDED_COLUMNS: Final = ("holder",)
"""Nullable text columns added since the first layout: :meth:`SqlStore.create_tables` adds each one
missing from a table made by an earlier version."""

_RARE_STATES: Final = frozenset({State.IN_DOUBT.value, State.FAILED.value})
"""The states an operator lists and a guarded call that succeeds never writes: the one index on
``state`` holds only these."""
_RARE: Final = "(" + ", ".join(f"'{state}'" for state in sorted(_RARE_STATES)) + ")"
_EXPIRING = "expires_at IS NOT NULL"


def _indexes(table_name: str) -> tuple[sa.Index, ...]:
    # Both partial: a new claim (in progress, no expiry) and its success (succeeded) then write
    # one index entry between them instead of four. Each entry is a page in the commit's WAL
    # flush: on SQLite with synchronous=FULL, 40 us of a 290 us claim and record (measured).
    rare, expiring = sa.text(f"state IN {_RARE}"), sa.text(_EXPIRING)
    return (
        # The retention sweep's range scan ("expires_at <= now" implies IS NOT NULL to both
        # planners).
        sa.Index(
            f"ix_{table_name}_expiring", "expires_at", sqlite_where=expiring, postgresql_where=expiring
        ),
        # (state, key): listing the records in doubt (or failed) a page at a time, in key order, is
        # a range scan. SQLite uses a partial index only when the query repeats its condition
        # word for word: see SqlStore.list.
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


def _sqlite_on_connect(memory: bool) -> Callable[[Any, Any], None]:
    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control from the sqlite3 module: BEGIN IMMEDIATE is ours to emit.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            # busy_timeout first: switching to WAL needs a lock other connections may hold.
            cursor.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            if not memory:
                _retry_locked(lambda: cursor.execute("PRAGMA journal_mode = WAL"))
            cursor.execute("PRAGMA synchronous = FULL")
        finally:
            cursor.close()

    return on_connect


_LOCKED_RETRIES = 50


def _retry_locked(step: Callable[[], object]) -> None:
    """Run ``step``, again while SQLite answers "database is locked" (bounded, with backoff).

    Why: some of SQLite's locks are not waited for by the busy timeout. Several processes opening
    one WAL database at the same instant can get SQLITE_BUSY at once from the first read of the
    WAL index (another connection is running its recovery) or from switching the journal mode.
    """
    for attempt in range(_LOCKED_RETRIES):
        try:
            step()
            return
        except Exception as exc:  # sqlite3.OperationalError, or SQLAlchemy's wrapper of it
            if "database is locked" not in str(exc) or attempt == _LOCKED_RETRIES - 1:
                raise
            time.sleep(min(0.01 * (attempt + 1), 0.2))


def _sqlite_on_begin(conn: sa.Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str | sa.URL) -> sa.Engine:
    """An engine configured the way :class:`SqlStore` needs it.

    ``postgresql://`` and ``postgres://`` are rewritten to psycopg 3 (``postgresql+psycopg://``),
    with a 5 s connect timeout. SQLite files get WAL, ``synchronous=FULL``, a 30 s busy timeout and
    ``BEGIN IMMEDIATE`` for writes, on a thread-safe pool; ``sqlite://`` is a private in-memory
    database on one shared connection. No pre-ping: it would cost a round trip on every call.

    Raises:
        ConfigurationError: the URL is not a string or URL, is malformed, names another database, or
            is a Postgres URL with no host or no database (checked as :func:`open_store` checks it).
    """
    if not isinstance(url, sa.URL):
        check_url(url)
    try:
        parsed = sa.make_url(url)
        backend = parsed.get_backend_name()
        if backend in ("postgresql", "postgres"):
            if parsed.drivername in ("postgresql", "postgres"):
                parsed = parsed.set(drivername="postgresql+psycopg")
            connect_args: dict[str, Any] = {"connect_timeout": _CONNECT_TIMEOUT_S}
            return sa.create_engine(parsed, connect_args=connect_args, hide_parameters=True)
        if backend != "sqlite":
            raise ConfigurationError(f"SqlStore serves sqlite:// and postgresql://, not {backend}")
        memory = parsed.database in (None, "", ":memory:")
        engine = sa.create_engine(
            parsed,
            poolclass=StaticPool if memory else QueuePool,
            connect_args={"check_same_thread": False, "timeout": _BUSY_TIMEOUT_MS / 1000},
            hide_parameters=True,
        )
    except (sa_exc.ArgumentError, ImportError) as exc:  # malformed, or a driver not installed
        raise ConfigurationError(f"cannot use store URL: {exc}") from exc
    event.listen(engine, "connect", _sqlite_on_connect(memory))
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _picker(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """A function from parameters by name to their values in ``names`` order, as a tuple."""
    if len(names) > 1:
        # itemgetter builds the tuple in C: of ten values in 0.2 µs, a generator in 0.8 (measured).
        return operator.itemgetter(*names)
    return lambda params: tuple(params[name] for name in names)  # one value, or none


class _Statement:
    """SQL compiled once for the engine's driver (its paramstyle), to run on a raw DBAPI cursor.

    A call through SQLAlchemy's ``Connection`` costs more than a commit on a fast disk, so the hot
    path hands precompiled SQL and the bound values straight to the driver.
    """

    __slots__ = ("_pick", "params", "sql")

    def __init__(self, clause: sa.ClauseElement, dialect: sa.Dialect) -> None:
        kwargs = {"render_postcompile": True}  # expand IN (...) lists into plain parameters
        compiled = cast(SQLCompiler, clause.compile(dialect=dialect, compile_kwargs=kwargs))
        self.sql = compiled.string
        self.params = compiled.params  # the values bound in a Core clause
        order = compiled.positiontup  # set for positional (qmark) drivers
        self._pick = None if order is None else _picker(tuple(order))

    def args(self, params: dict[str, Any]) -> Any:
        """The values in the form the driver wants: by name, or in order."""
        return params if self._pick is None else self._pick(params)


_STATES: Final = {state.value: state for state in State}


def _record(row: Sequence[Any]) -> Record:
    """A row in ``_COLUMNS`` order (the order of Record's fields) as a Record."""
    return Record.from_fields(
        row[0], row[1], row[2], row[3], int(row[4]), row[5], _STATES[row[6]], int(row[7]),
        float(row[8]), int(row[9]), float(row[10]), float(row[11]),
        None if row[12] is None else float(row[12]), row[13], row[14], row[15],
    )  # fmt: skip


class SqlStore:
    """An :class:`~idempotency.store.IdempotencyStore` on SQLite or PostgreSQL. Thread-safe.

    Every write a guarded call makes is one statement in autocommit: on Postgres one round trip,
    no BEGIN/COMMIT; on SQLite one commit (other writes take ``BEGIN IMMEDIATE``). For async
    callers it is also a :class:`~idempotency.store.AsyncWrites`: on SQLite a claim or a record that
    can start at once is written on the event loop (:meth:`claim_now`, :meth:`complete_now`); on
    Postgres both are awaited there, on libpq's non-blocking interface.

    Args:
        url_or_engine: a ``sqlite:///path.db``, ``sqlite://`` (private, in memory) or
            ``postgresql://user@host/db`` URL, or an engine to use as it is (build one with
            :func:`make_engine` to get the settings above; the store then does not dispose it).
        clock: seconds since the epoch; inject one to test lease expiry without sleeping.
            By default every time is the database's own, read inside the statement that uses it.
        table_name: the effects table; several stores may share one database under other names.
        create: create the table (and its indexes) when missing.

    Raises:
        ConfigurationError: bad URL or table name.
        StoreUnavailable: ``create`` is set and the database cannot be reached.
    """

    offload_async = True
    """Whether the guard runs this store's calls in a worker thread for async effects."""

    def __init__(
        self,
        url_or_engine: str | sa.Engine,
        *,
        clock: Callable[[], float] | None = None,
        table_name: str = DEFAULT_TABLE,
        create: bool = True,
    ) -> None:
        model: Any = effect_model(table_name)
        self._table: sa.Table = model.__table__
        owned = isinstance(url_or_engine, str)
        engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
        if (dialect := engine.dialect.name) not in _DB_NOW:
            raise ConfigurationError(f"SqlStore serves SQLite and Postgres, not {dialect}")
        self._engine = engine
        self._owned = owned
        self._clock = clock
        # What "now" is bound from: the injected clock, else on SQLite (in-process) the host's.
        self._now: Callable[[], float] | None = clock
        if clock is None and engine.dialect.name == "sqlite":
            self._now = time.time
        self._postgres = engine.dialect.name == "postgresql"
        dbapi = engine.dialect.loaded_dbapi  # PEP 249 says which of its errors are transient
        self._dbapi_error: type[Exception] = dbapi.Error
        self._transient = (
            sa_exc.OperationalError,  # e.g. connecting failed (SQLAlchemy wraps that)
            sa_exc.InterfaceError,
            sa_exc.DisconnectionError,
            sa_exc.TimeoutError,  # the pool had no connection to give in time
            dbapi.OperationalError,  # e.g. server gone, SQLite "database is locked"
            dbapi.InterfaceError,
        )
        # One shared connection (in-memory SQLite) must not interleave two threads' transactions.
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if isinstance(engine.pool, StaticPool) else contextlib.nullcontext()
        )
        self._shelf = Shelf(engine)
        # The records this store's claims handed out and that are still live, by key: complete()
        # rebuilds the finished record from one of these instead of reading every column back.
        self._held: dict[str, Record] = {}
        self._write_time = 0.0  # the moving average of SQLite writes, in seconds: see _write_now
        self._build_statements(engine.dialect.identifier_preparer.quote(table_name))
        if create:
            self.create_tables()

    def _build_statements(self, table: str) -> None:
        # Only identifiers are formatted in; every value is a bound parameter.
        dialect = self._engine.dialect
        now = _DB_NOW[dialect.name] if self._now is None else "CAST(:now AS DOUBLE PRECISION)"
        clock_row = f"(SELECT {now} AS now) AS c"
        fresh = f"e.state IN {_FINISHED}"  # in DO UPDATE: replacing an expired finished record

        def claimable(row: str, at: str, fingerprint: str) -> str:
            return (
                f"(({row}.state IN {_FINISHED} AND {row}.expires_at <= {at}) OR "
                f"({row}.state IN {_LIVE} AND {row}.lease_until <= {at} "
                f"AND {row}.fingerprint = {fingerprint}))"
            )

        def pick(column: str) -> str:
            return f"{column} = CASE WHEN {fresh} THEN excluded.{column} ELSE e.{column} END"

        def upsert(source: str, guard: str, at: str = "c.now") -> str:
            # The proposed row carries "now" (created_at) and "now + lease" (lease_until), so DO
            # UPDATE reads the clock from `excluded`: one reading per statement. SQLite needs a
            # WHERE to parse INSERT .. SELECT followed by ON CONFLICT. A new row starts at the
            # random :first_token (a deleted record left no token to count on from); DO UPDATE
            # (replacing an expired finished record, or taking over) counts on from the old one.
            return f"""
            INSERT INTO {table} AS e (key, namespace, scope, name, ordinal, fingerprint, state,
                                      token, lease_until, attempts, created_at, updated_at, holder)
            SELECT :key, :namespace, :scope, :name, :ordinal, :fingerprint, 'in_progress',
                   CAST(:first_token AS BIGINT), {at} + CAST(:lease AS DOUBLE PRECISION), 1,
                   {at}, {at}, :holder
            {source} WHERE {guard}
            ON CONFLICT (key) DO UPDATE SET
                {pick("namespace")}, {pick("scope")}, {pick("name")}, {pick("ordinal")},
                {pick("fingerprint")}, {pick("created_at")},
                state = CASE WHEN {fresh} THEN 'in_progress' ELSE 'in_doubt' END,
                token = e.token + 1,
                attempts = CASE WHEN {fresh} THEN 1 ELSE e.attempts + 1 END,
                lease_until = excluded.lease_until,
                updated_at = excluded.updated_at,
                expires_at = CASE WHEN {fresh} THEN NULL ELSE e.expires_at END,
                result = CASE WHEN {fresh} THEN NULL ELSE e.result END,
                error = CASE WHEN {fresh} THEN NULL ELSE e.error END,
                holder = excluded.holder
            WHERE {claimable("e", "excluded.created_at", "excluded.fingerprint")}
            RETURNING true AS won, {_COLUMNS}"""

        if self._postgres:
            # The upsert runs only when this statement's snapshot shows no record that blocks
            # it; otherwise that record is returned as it is. A replay therefore takes no row
            # lock and writes nothing (an upsert whose DO UPDATE declines still locks the row,
            # and the lock would make its commit wait for a WAL flush).
            x_columns = ", ".join(f"x.{column}" for column in _COLUMNS.split(", "))
            claim = f"""
            WITH c AS (SELECT {now} AS now),
            cur AS (SELECT {x_columns},
                           COALESCE({claimable("x", "c.now", ":fingerprint")}, false) AS open
                    FROM {table} AS x, c WHERE x.key = :key),
            won AS ({upsert("FROM c", "NOT EXISTS (SELECT 1 FROM cur WHERE NOT cur.open)")})
            SELECT * FROM won
            UNION ALL SELECT false, {_COLUMNS} FROM cur WHERE NOT cur.open"""
        elif self._now is None:
            claim = upsert(f"FROM {clock_row}", "true")
        else:  # a bound "now" needs no clock row to select from
            claim = upsert("", "true", at=now)
        fence = f"key = :key AND token = :token AND state IN {_LIVE}"

        source = "" if self._now is not None else f" FROM {clock_row}"

        def update(assignments: str, returning: str | None = _COLUMNS) -> str:
            # A bound "now" needs no clock row to join: the assignments then name it directly.
            if not source:
                assignments = assignments.replace("c.now", now)
            tail = "" if returning is None else f" RETURNING {returning}"
            return f"UPDATE {table} SET {assignments}{source} WHERE {fence}{tail}"

        purgeable = f"state IN {_FINISHED} AND expires_at <= {now}"
        sql = {
            "claim": claim,
            # SQLite's first try at a claim: a plain insert that any record in the way declines
            # (the upsert then decides). A new key, the common case, then costs no upsert and no
            # RETURNING: 11 us less of a 230 us claim and record (measured, synchronous=FULL).
            "insert": f"""
            INSERT INTO {table} (key, namespace, scope, name, ordinal, fingerprint, state, token,
                                 lease_until, attempts, created_at, updated_at, holder)
            VALUES (:key, :namespace, :scope, :name, :ordinal, :fingerprint, 'in_progress',
                    :first_token, :lease_until, 1, :now, :now, :holder)
            ON CONFLICT (key) DO NOTHING""",
            "get": f"SELECT {_COLUMNS} FROM {table} WHERE key = :key",
            "complete": update(
                "state = 'succeeded', result = :result, error = NULL, "
                "expires_at = c.now + CAST(:retention AS DOUBLE PRECISION), updated_at = c.now"
            ),
            # The same write for the holder of the claim: while its token holds, only the lease
            # can have changed since (heartbeats), so only it and the new times come back; on
            # SQLite, where this process binds the time, only the lease.
            "complete_held": update(
                "state = 'succeeded', result = :result, error = NULL, "
                "expires_at = c.now + CAST(:retention AS DOUBLE PRECISION), updated_at = c.now",
                returning="lease_until" if self._now is not None else "lease_until, updated_at, expires_at",
            ),
            "permanent": update(
                "state = 'failed', error = :error, "
                "expires_at = c.now + CAST(:retention AS DOUBLE PRECISION), updated_at = c.now"
            ),
            "ambiguous": update(
                "state = 'in_doubt', error = :error, lease_until = 0, updated_at = c.now"
            ),
            "retryable": f"DELETE FROM {table} WHERE {fence} RETURNING key",
            # Compare-and-set on the token the caller saw with a dead holder: the fence is the
            # same as every write's, and the lease is not looked at (see take_over).
            "take_over": update(
                "state = 'in_doubt', token = token + 1, attempts = attempts + 1, "
                "lease_until = c.now + CAST(:lease AS DOUBLE PRECISION), updated_at = c.now, "
                "holder = :holder"
            ),
            "heartbeat": update(
                "lease_until = c.now + CAST(:lease AS DOUBLE PRECISION), updated_at = c.now",
                returning="lease_until",
            ),
            # The condition is repeated outside the subquery: a row re-claimed in between
            # (Postgres re-checks a row that changed under it) is then left alone.
            "purge": f"DELETE FROM {table} WHERE key IN "
            f"(SELECT key FROM {table} WHERE {purgeable} LIMIT :limit) AND {purgeable}",
            "now": f"SELECT {_DB_NOW[dialect.name]}",
        }
        self._sql = {name: _Statement(sa.text(text), dialect) for name, text in sql.items()}
        self._get = self._sql["get"]
        # The claim and the record on Postgres, for libpq by name: sync (_hot) and async (_awrite).
        self._pq = {
            name: pq_async.Statement(_statement_name(self._sql[name].sql), self._sql[name].sql)
            for name in (("claim", "complete", "complete_held") if self._postgres else ())
        }

    # -- plumbing ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        """Re-raise driver errors as ours (:meth:`_ours`)."""
        try:
            yield
        except (sa_exc.SQLAlchemyError, self._dbapi_error) as exc:
            raise self._ours(exc) from exc

    def _ours(self, exc: BaseException) -> StoreError:
        """Our error for a driver's, with the driver's message (never SQLAlchemy's, which may
        quote parameters); the caller raises it ``from exc``."""
        orig = getattr(exc, "orig", None) or exc
        text = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        if isinstance(exc, self._transient) or getattr(exc, "connection_invalidated", False):
            return StoreUnavailable(f"SQL store unavailable: {text}")
        return StoreError(f"SQL store error: {text}")

    @contextlib.contextmanager
    def _cursor(self, *, write: bool = False) -> Iterator[Any]:
        """A DBAPI cursor on a shelved connection; a write block is one transaction."""
        with self._lock, self._translated():
            shelf = self._shelf
            held = shelf.take()
            cursor = held.cursor
            try:
                if write and not self._postgres:
                    cursor.execute("BEGIN IMMEDIATE")  # wait for the write lock up front
                yield cursor
                if not self._postgres:
                    held.conn.commit()
            except BaseException as exc:
                self._drop(held, exc)
                raise
            shelf.give(held)

    def _write(self, work: Callable[[Any], T]) -> T:
        """``work(cursor)`` on a shelved connection, for the writes every guarded call makes: what
        ``with self._cursor(write=True) as cursor: return work(cursor)`` does, as plain calls (a
        context manager costs a few µs on a hot path), and without ``BEGIN IMMEDIATE`` first.

        So ``work`` starts with a writing statement, in autocommit: one statement is its own
        transaction; one that goes on takes ``BEGIN IMMEDIATE`` itself (the claim's upsert after
        its plain insert found a record). On SQLite that saves 25 µs of a 620 µs guarded call
        (measured interleaved, synchronous=FULL, on a VM whose flush takes 175 µs): ``BEGIN
        IMMEDIATE``, ``INSERT``, ``COMMIT`` as three statements cost more than the one."""
        with self._lock:
            started = time.perf_counter()
            shelf = self._shelf
            try:
                held = shelf.take()
            except (sa_exc.SQLAlchemyError, self._dbapi_error) as exc:
                raise self._ours(exc) from exc
            return self._transact(held, work, started)

    def _transact(self, held: Held, work: Callable[[Any], T], started: float) -> T:
        """``work(cursor)`` on ``held`` and, on SQLite, the commit of the transaction it is in, if
        any; then the connection goes back on the shelf, or is dropped after a failure."""
        try:
            found = work(held.cursor)
            if not self._postgres:
                held.conn.commit()
        except pq_async.Broken as exc:  # a hot write's libpq failed: the server may be gone
            self._shelf.discard(held, exc, disconnect=True)
            raise StoreUnavailable(f"SQL store unavailable: {exc}") from exc
        except BaseException as exc:
            self._drop(held, exc)
            if isinstance(exc, (sa_exc.SQLAlchemyError, self._dbapi_error)):
                raise self._ours(exc) from exc
            raise
        self._shelf.give(held)
        self._write_time += (time.perf_counter() - started - self._write_time) * _WRITE_WEIGHT
        return found

    def _write_now(self, work: Callable[[Any], T]) -> T | _Wait:
        """:meth:`_write` on SQLite if nothing has to be waited for first, else :data:`_WAIT`.

        For a call from the event loop (the guard's async calls), which must never block on a
        lock: only with an idle shelved connection (no pool checkout, which may wait for one),
        the store's lock of a shared in-memory connection free, and the write lock taken at
        once (``BEGIN IMMEDIATE`` under a zero busy timeout: another writer makes it answer
        "locked" at once, and nothing was written). What remains is the commit's own write to
        the file; while this store's writes (from threads too) take over :data:`_SLOW_WRITE` on
        average (a slow or busy disk, writers queueing for the lock), every one goes to a thread.
        One slow fsync among fast ones does not: it moves the average by an eighth of itself.
        """
        if self._write_time > _SLOW_WRITE:
            return _WAIT
        lock = self._lock
        if isinstance(lock, _RLOCK) and not lock.acquire(blocking=False):
            return _WAIT
        try:
            held = self._shelf.take_idle()
            if held is None:
                return _WAIT
            cursor = held.cursor
            started = time.perf_counter()
            try:
                began = self._begin_now(cursor)
            except BaseException as exc:
                # Its busy timeout may still be zero: it must never serve a write that waits.
                self._shelf.discard(held, exc, disconnect=False)
                if isinstance(exc, self._dbapi_error):
                    raise self._ours(exc) from exc
                raise
            if not began:
                self._shelf.give(held)
                return _WAIT
            return self._transact(held, work, started)
        finally:
            if isinstance(lock, _RLOCK):
                lock.release()

    async def _awrite(self, name: str, params: dict[str, Any]) -> list[Any] | None:
        """Statement ``name`` on Postgres, awaited on the event loop on a shelved connection (see
        :mod:`~idempotency.stores.pq_async`); None, and nothing written, when no shelved connection
        is idle (a checkout from the pool may wait) or the engine's connections have prepared
        statements turned off (``prepare_threshold=None``, as behind PgBouncer before 1.21)."""
        shelf = self._shelf
        held = shelf.take_idle()
        if held is None:
            return None
        if held.conn.prepare_threshold is None:  # prepared statements turned off (PgBouncer)
            shelf.give(held)
            return None
        statement = self._pq[name]
        try:
            if self._now is not None:
                params["now"] = float(self._now())
            rows = await pq_async.execute(held.conn, statement, params)
        except WriteCancelled:
            shelf.give(held)  # its reply was read
            raise
        except pq_async.Broken as exc:
            shelf.discard(held, exc, disconnect=True)
            raise StoreUnavailable(f"SQL store unavailable: {exc}") from exc
        except self._dbapi_error as exc:  # the server's answer: the connection is fine
            shelf.give(held)
            raise self._ours(exc) from exc
        except BaseException as exc:  # cancelled before or twice after sending: a reply may be unread
            shelf.discard(held, exc, disconnect=False)
            raise
        shelf.give(held)
        return rows

    def _begin_now(self, cursor: Any) -> bool:
        """``BEGIN IMMEDIATE`` under a zero busy timeout, the usual one restored after: False (and no
        transaction) when another writer holds the lock."""
        cursor.execute("PRAGMA busy_timeout = 0")
        try:
            cursor.execute("BEGIN IMMEDIATE")
        except self._dbapi_error as exc:
            if "locked" not in str(exc):  # SQLITE_BUSY: another writer has the lock
                raise
            cursor.execute(_BUSY_PRAGMA)
            return False
        cursor.execute(_BUSY_PRAGMA)
        return True

    def _drop(self, held: Held, exc: BaseException) -> None:
        """After a failed block: roll back and shelve the connection, or throw it away if broken."""
        disconnect = isinstance(exc, self._dbapi_error) and self._engine.dialect.is_disconnect(
            exc,  # type: ignore[arg-type]  # the driver's own error, as the dialect expects
            held.conn,
            held.cursor,
        )
        self._shelf.settle(held, exc, disconnect=disconnect)

    def _run(
        self, cursor: Any, statement: _Statement, params: dict[str, Any], fetch: bool = True
    ) -> list[Any]:
        if self._now is not None:
            params["now"] = float(self._now())
        cursor.execute(statement.sql, statement.args(params))
        # Fetch to the end: SQLite completes a RETURNING statement only then.
        return list(cursor.fetchall()) if fetch else []

    def _hot(self, cursor: Any, name: str, params: dict[str, Any]) -> list[Any]:
        """Statement ``name`` (a claim or a record) on ``cursor``: on Postgres straight through libpq
        (:func:`~idempotency.stores.pq_async.execute_blocking`, prepared once per connection) unless
        the connection prepares nothing (``prepare_threshold=None``: PgBouncer before 1.21), else as
        every other statement."""
        if self._postgres:
            conn = cursor.connection
            if conn.prepare_threshold is not None:
                if self._now is not None:
                    params["now"] = float(self._now())
                return pq_async.execute_blocking(conn, self._pq[name], params)
        return self._run(cursor, self._sql[name], params)

    def _fenced(self, name: str, key: str, token: int, **params: Any) -> Any:
        statement, values = self._sql[name], {"key": key, "token": token, **params}
        rows = self._write(lambda cursor: self._run(cursor, statement, values))
        if not rows:
            raise self._lost(key, token)
        return rows[0]

    def _lost(self, key: str, token: int) -> LostOwnership:
        """The refusal of a fenced write, saying what the record looks like now (best effort)."""
        with contextlib.suppress(StoreError):
            rec = self.get(key)
            if rec is None:
                return LostOwnership(key, token, "record is gone")
            if rec.token != token:
                return LostOwnership(key, token, f"token is now {rec.token}")
            return LostOwnership(key, token, f"record is already {rec.state}")
        return LostOwnership(key, token)

    # -- the contract ------------------------------------------------------------------------

    def create_tables(self) -> None:
        """Create the effects table and its indexes if they are missing. Safe to race.

        Raises:
            StoreUnavailable: the database cannot be reached.
        """
        for attempt in range(2):
            try:
                if self._postgres:
                    self._create()
                else:  # several processes opening one new SQLite file at once
                    _retry_locked(self._create)
                return
            except StoreUnavailable:
                raise
            except StoreError:  # lost a creation race on an engine without BEGIN IMMEDIATE
                if attempt:
                    raise

    def _create(self) -> None:
        with self._lock, self._translated(), self._engine.begin() as conn:
            if self._postgres:  # two processes creating at once would collide
                lock = sa.text("SELECT pg_advisory_xact_lock(:id)")
                conn.execute(lock, {"id": _DDL_LOCK_ID})
            METADATA.create_all(conn, tables=[self._table])
            self._add_columns(conn)

    def _add_columns(self, conn: sa.Connection) -> None:
        """Add the columns of :data:`_ADDED_COLUMNS` a table made by an earlier version lacks.

        Idempotent: a column already there is left alone; on Postgres the DDL lock above
        serialises racing stores, on SQLite ``BEGIN IMMEDIATE`` does.
        """
        present = {column["name"] for column in sa.inspect(conn).get_columns(self._table.name)}
        table = self._engine.dialect.identifier_preparer.quote(self._table.name)
        for name in _ADDED_COLUMNS:
            if name not in present:
                conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {name} TEXT")

    def now(self) -> float:
        """The store's clock: the injected one, or the database's time (one query)."""
        if self._now is not None:
            return float(self._now())
        with self._cursor() as cursor:
            return float(self._run(cursor, self._sql["now"], {})[0][0])

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        """See :meth:`IdempotencyStore.claim`.

        One upsert whose ``DO UPDATE`` fires only for a record that may be replaced (finished
        and expired) or taken over (lease run out, same fingerprint); an inserted row gets the
        random starting token of :func:`~idempotency.store.first_token`, bound as a parameter,
        and ``DO UPDATE`` sets the old token + 1. On SQLite a plain insert (its own transaction)
        comes first and settles a new key; only when a record is in the way do the upsert and, if
        it returns nothing, the read of that record follow, in one ``BEGIN IMMEDIATE``
        transaction. On Postgres the statement itself returns that record; it returns nothing only
        when it lost a race with a concurrent claim, and the record is then read at once.
        """
        work = self._claim_work(identity, fingerprint, lease)
        for _ in range(_CLAIM_ATTEMPTS):
            claimed = self._claimed(self._write(work))
            if claimed is not None:
                return claimed
            # That record was deleted before we could read it: claim again.
        raise StoreError(f"claim of effect key {identity.key[:16]}... kept racing with deletes")

    async def aclaim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult | None:
        """See :class:`~idempotency.store.AsyncWrites`: on SQLite :meth:`claim_now`; on Postgres the
        claim's statement awaited on the event loop (:mod:`~idempotency.stores.pq_async`). None (and
        nothing written) when it would wait, or lost a race with a concurrent claim: the blocking
        :meth:`claim` then runs in a thread."""
        if not self._postgres:
            return self.claim_now(identity, fingerprint, lease)
        try:
            rows = await self._awrite("claim", self._claim_params(identity, fingerprint, lease))
        except WriteCancelled as cancelled:
            outcome = cancelled.outcome
            if not isinstance(outcome, BaseException):
                outcome = self._claimed(outcome)
            raise WriteCancelled(outcome) from None
        return None if rows is None else self._claimed(rows)

    def claim_now(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult | None:
        """:meth:`claim` on SQLite if it can start at once (see :meth:`_write_now`), else None (and
        nothing was written); always None on Postgres."""
        if self._postgres:
            return None
        rows = self._write_now(self._claim_work(identity, fingerprint, lease))
        return None if isinstance(rows, _Wait) else self._claimed(rows)

    def _claim_params(self, identity: EffectIdentity, fingerprint: str, lease: float) -> dict[str, Any]:
        return {
            "key": identity.key,
            "namespace": identity.namespace,
            "scope": identity.scope,
            "name": identity.name,
            "ordinal": identity.ordinal,
            "fingerprint": fingerprint,
            "lease": float(lease),
            "first_token": first_token(),  # used only if no row is in the way
            "holder": _holder.current(),
        }

    def _claim_work(
        self, identity: EffectIdentity, fingerprint: str, lease: float
    ) -> Callable[[Any], list[Any]]:
        params = self._claim_params(identity, fingerprint, lease)
        get, insert = self._get, self._sql["insert"]

        def work(cursor: Any) -> list[Any]:
            if not self._postgres:  # SQLite binds the time: the inserted row is known here
                now = float(self._now())  # type: ignore[misc]  # always set on SQLite
                fresh = {**params, "now": now, "lease_until": now + params["lease"]}
                cursor.execute(insert.sql, insert.args(fresh))
                if cursor.rowcount == 1:  # nothing was in the way
                    return [(True, identity.key, identity.namespace, identity.scope, identity.name,
                             identity.ordinal, fingerprint, State.IN_PROGRESS.value,
                             params["first_token"], fresh["lease_until"], 1, now, now,
                             None, None, None, params["holder"])]  # fmt: skip
                if not cursor.connection.in_transaction:  # else _write_now began it
                    cursor.execute("BEGIN IMMEDIATE")  # the upsert and the read, as one
            rows = self._hot(cursor, "claim", params)
            if not rows:  # read the record in the way (SQLite: in the same transaction)
                rows = [(False, *row) for row in self._run(cursor, get, {"key": identity.key})]
            return rows

        return work

    def _claimed(self, rows: list[Any]) -> ClaimResult | None:
        """The outcome of a claim's rows (``won``, then the record's columns); None when there are
        none (the record in the way was deleted before it could be read)."""
        if not rows:
            return None
        won, *columns = rows[0]
        rec = _record(columns)
        if not won:
            return ClaimResult.from_fields(ClaimOutcome.EXISTING, rec)
        held = self._held  # ours now, until complete() or fail()
        if len(held) >= _HELD_MAX:
            held.clear()
        held[rec.key] = rec
        if rec.state is State.IN_PROGRESS:
            return ClaimResult.from_fields(ClaimOutcome.CLAIMED, rec)
        return ClaimResult.from_fields(ClaimOutcome.TOOK_OVER, rec)

    def get(self, key: str) -> Record | None:
        """See :meth:`IdempotencyStore.get`."""
        with self._cursor() as cursor:
            rows = self._run(cursor, self._get, {"key": key})
        return _record(rows[0]) if rows else None

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        """See :meth:`IdempotencyStore.complete`. One fenced UPDATE.

        When this store's own claim handed out ``token`` for ``key``, the finished record is built
        from that claim's record and the fields the UPDATE returns (``complete_held``).
        """
        held = self._held.pop(key, None)
        work, values = self._complete_work(key, token, result, retention, held)
        return self._completed(key, token, self._write(work), values, held)

    async def acomplete(self, key: str, token: int, result: str, retention: float) -> Record | None:
        """See :class:`~idempotency.store.AsyncWrites`: :meth:`complete` as :meth:`aclaim` claims."""
        if not self._postgres:
            return self.complete_now(key, token, result, retention)
        held = self._held.pop(key, None)
        name, values = self._complete_statement(key, token, result, retention, held)
        try:
            found = await self._awrite(name, values)
        except WriteCancelled as cancelled:
            outcome = cancelled.outcome
            if not isinstance(outcome, BaseException):  # no row: fenced out (not looked up here)
                outcome = (
                    self._completed(key, token, outcome, values, held)
                    if outcome
                    else LostOwnership(key, token)
                )
            raise WriteCancelled(outcome) from None
        if found is None:
            if held is not None:
                self._held[key] = held  # for complete(), which runs next
            return None
        if not found:
            raise await in_thread(self._lost, key, token)
        return self._completed(key, token, found, values, held)

    def complete_now(self, key: str, token: int, result: str, retention: float) -> Record | None:
        """:meth:`complete` on SQLite if it can start at once (see :meth:`_write_now`), else None
        (and nothing was written); always None on Postgres."""
        if self._postgres:
            return None
        held = self._held.pop(key, None)
        work, values = self._complete_work(key, token, result, retention, held)
        found = self._write_now(work)
        if isinstance(found, _Wait):
            if held is not None:
                self._held[key] = held  # for complete(), which runs next
            return None
        return self._completed(key, token, found, values, held)

    def _complete_work(
        self, key: str, token: int, result: str, retention: float, held: Record | None
    ) -> tuple[Callable[[Any], list[Any]], dict[str, Any]]:
        """The fenced UPDATE that records success: ``complete_held`` when ``held`` is the record our
        claim handed out for this token (only the new times come back), else ``complete``."""
        name, values = self._complete_statement(key, token, result, retention, held)
        return (lambda cursor: self._hot(cursor, name, values)), values

    @staticmethod
    def _complete_statement(
        key: str, token: int, result: str, retention: float, held: Record | None
    ) -> tuple[str, dict[str, Any]]:
        values: dict[str, Any] = {"key": key, "token": token, "result": result, "retention": float(retention)}
        return ("complete_held" if held is not None and held.token == token else "complete"), values

    def _completed(
        self, key: str, token: int, found: list[Any], values: dict[str, Any], held: Record | None
    ) -> Record:
        if not found:
            raise self._lost(key, token)
        if held is None or held.token != token:
            return _record(found[0])
        if self._now is None:  # the database's clock: the UPDATE returns the times it wrote
            lease_until, updated_at, expires_at = (float(v) for v in found[0])
        else:  # the time is ours
            lease_until, updated_at = float(found[0][0]), float(values["now"])
            expires_at = updated_at + values["retention"]
        return Record.from_fields(
            key, held.namespace, held.scope, held.name, held.ordinal, held.fingerprint,
            State.SUCCEEDED, token, lease_until, held.attempts, held.created_at,
            updated_at, expires_at, values["result"], None, held.holder,
        )  # fmt: skip

    def fail(
        self, key: str, token: int, disposition: Disposition, error: str, retention: float
    ) -> Record | None:
        """See :meth:`IdempotencyStore.fail`. One fenced UPDATE, or DELETE when RETRYABLE."""
        self._held.pop(key, None)
        params: dict[str, Any] = {}
        if disposition is not Disposition.RETRYABLE:
            params["error"] = error
        if disposition is Disposition.PERMANENT:
            params["retention"] = float(retention)
        row = self._fenced(Disposition(disposition).value, key, token, **params)
        return None if disposition is Disposition.RETRYABLE else _record(row)

    def take_over(self, key: str, token: int, lease: float) -> Record | None:
        """See :meth:`IdempotencyStore.take_over`. One fenced UPDATE."""
        statement = self._sql["take_over"]
        values = {"key": key, "token": token, "lease": float(lease), "holder": _holder.current()}
        rows = self._write(lambda cursor: self._run(cursor, statement, values))
        if not rows:
            return None
        rec = _record(rows[0])
        self._held[key] = rec  # ours now, as after a claim
        return rec

    def heartbeat(self, key: str, token: int, lease: float) -> float:
        """See :meth:`IdempotencyStore.heartbeat`. One fenced UPDATE."""
        return float(self._fenced("heartbeat", key, token, lease=float(lease))[0])

    def list(
        self,
        *,
        states: Collection[State] | None = None,
        namespace: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[Record]:
        """See :meth:`IdempotencyStore.list`. Ordered by key (the primary key's index)."""
        statement = self._listing(states, namespace, limit, after)
        with self._cursor() as cursor:
            return [_record(row) for row in self._run(cursor, statement, dict(statement.params))]

    def _listing(
        self, states: Collection[State] | None, namespace: str | None, limit: int, after: str | None
    ) -> _Statement:
        """The query of :meth:`list`: in doubt or failed records are a range scan of the partial
        index on ``state``; any other state, a walk of the primary key in order (a success, the
        hot path, writes no entry into that index)."""
        t = self._table.c
        query = sa.select(*(t[name] for name in _COLUMNS.split(", ")))
        if states is not None:
            wanted = {State(s).value for s in states}
            query = query.where(t.state.in_(sorted(wanted)))
            if wanted <= _RARE_STATES:  # the partial index's condition, word for word (SQLite)
                query = query.where(sa.text(f"state IN {_RARE}"))
        if namespace is not None:
            query = query.where(t.namespace == namespace)
        if after is not None:
            query = query.where(t.key > after)
        return _Statement(query.order_by(t.key).limit(max(0, limit)), self._engine.dialect)

    def purge(self, *, limit: int = 1000) -> int:
        """See :meth:`IdempotencyStore.purge`. One DELETE of at most ``limit`` rows."""
        with self._cursor(write=True) as cursor:
            self._run(cursor, self._sql["purge"], {"limit": max(0, limit)}, fetch=False)
            return int(cursor.rowcount)

    def close(self) -> None:
        """Give the store's connections back to the pool, and release those of an engine the store
        made (a given engine is left alone)."""
        self._shelf.close()
        if self._owned:
            self._engine.dispose()

    def __repr__(self) -> str:
        url = self._engine.url.render_as_string(hide_password=True)
        return f"SqlStore({url!r}, table={self._table.name!r})"
