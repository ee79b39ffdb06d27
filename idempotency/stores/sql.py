"""The SQL store: one SQLModel table serving SQLite (the embedded default) and PostgreSQL.

A new guarded call costs two statements, each its own transaction (autocommit): the claim's insert
and the record (:mod:`~sagaguard.idempotency.stores.sql_statements` writes them out), run on the driver
itself (:mod:`~sagaguard.idempotency.backends.sql_driver`); on Postgres one round trip each, on SQLite
one commit each. A replay costs the insert, which finds the record in the way, then the full claim
(on Postgres one more round trip; on SQLite in one ``BEGIN IMMEDIATE`` transaction). Reading,
listing, purging and the schema go through SQLAlchemy Core over the SQLModel table
(:mod:`~sagaguard.idempotency.stores.sql_schema`); the engine is SQLAlchemy's, set up by
:func:`~sagaguard.idempotency.backends.sql_engine.make_engine`.

The table belongs to the ``effects`` table set (:mod:`sagaguard.idempotency.migrations`): its schema
revision is recorded in ``{table}_version``. With ``create`` set (the default) a store creates a
missing table at this code's revision, stamped, and upgrades an older one; without it, a table that
is missing, older or newer makes the store refuse to open with a
:class:`~sagaguard.idempotency.errors.SchemaVersionMismatch` naming ``sagaguard db upgrade``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Final, TypeVar

import sqlalchemy as sa

from sagaguard.idempotency import holder as _holder
from sagaguard.idempotency.backends.sql_driver import SqlDriver, Statement
from sagaguard.idempotency.backends.sql_engine import make_engine
from sagaguard.idempotency.checks import storable_text
from sagaguard.idempotency.errors import ConfigurationError, LostOwnership, StoreError, StoreUnavailable
from sagaguard.idempotency.keys import EffectIdentity, check_ledger_id
from sagaguard.idempotency.migrations.effects import TABLE_SET as EFFECTS
from sagaguard.idempotency.migrations.runner import ensure_schema, shown_url, upgrade_schema
from sagaguard.idempotency.records import ClaimOutcome, ClaimResult, Disposition, Record, State
from sagaguard.idempotency.store import first_token
from sagaguard.idempotency.stores.sql_ledger import read_or_insert
from sagaguard.idempotency.stores.sql_schema import (
    COLUMNS,
    DEFAULT_TABLE,
    METADATA,
    RARE,
    RARE_STATES,
    SCHEMA_VERSION,
    EffectFields,
    EffectRow,
    effect_model,
)
from sagaguard.idempotency.stores.sql_statements import DB_NOW, effect_statements

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

_CLAIM_ATTEMPTS = 5
_HELD_MAX = 4096
"""Claimed records a store remembers for ``complete_held``; past this many (claims never completed
nor failed, e.g. by code driving the store itself) it forgets them all and starts afresh."""
_STATES: Final = {state.value: state for state in State}
_FINISHED: Final = ("succeeded", "failed")


def _record(row: Sequence[Any]) -> Record:
    """A row in ``COLUMNS`` order (the order of Record's fields) as a Record."""
    return Record(
        row[0], row[1], row[2], row[3], int(row[4]), row[5], _STATES[row[6]], int(row[7]),
        float(row[8]), int(row[9]), float(row[10]), float(row[11]),
        None if row[12] is None else float(row[12]), row[13], row[14], row[15], row[16],
    )  # fmt: skip


def _unavailable(text: str) -> StoreUnavailable:
    return StoreUnavailable(f"SQL store unavailable: {text}")


def _error(text: str) -> StoreError:
    return StoreError(f"SQL store error: {text}")


class SqlStore:
    """An :class:`~sagaguard.idempotency.store.IdempotencyStore` on SQLite or PostgreSQL. Thread-safe.

    Every write a guarded call makes is one statement in autocommit: on Postgres one round trip,
    no BEGIN/COMMIT; on SQLite one commit. The guard's async calls run these blocking writes in a
    worker thread (``offload_async``), so an event loop never waits for a commit or a lock.

    Args:
        url_or_engine: a ``sqlite:///path.db``, ``sqlite://`` (private, in memory) or
            ``postgresql://user@host/db`` URL, or an engine to use as it is (build one with
            :func:`make_engine` to get its settings; the store then does not dispose it).
        clock: seconds since the epoch; inject one to test lease expiry without sleeping.
            By default every time is the database's own, read inside the statement that uses it.
        table_name: the effects table; several stores may share one database under other names.
        create: None (the default): create the table (and its indexes) when missing (a new
            database), at this code's schema revision, and refuse a table at an older or newer
            revision, naming ``sagaguard db upgrade`` (nothing is altered at open); True: also
            upgrade a table when older; False: write no DDL and refuse a table missing, older or
            newer. Either way, a store at this code's revision costs one query to open. With
            False a database that cannot be reached at open is checked by the first call that
            reaches it instead (that call raises what the open would have).
        ledger_id: the ledger id to derive provider keys with, in place of the one kept in the
            database (see :meth:`ledger_id`): for a copy of a ledger that must not send its
            original's keys, or a restored one that must keep them (docs/concepts.md).

    Raises:
        SchemaVersionMismatch: the table is newer than this code, older (unless ``create`` is
            True) or missing (``create`` False): the message names ``sagaguard db upgrade --store URL``.
        ConfigurationError: bad URL or table name.
        StoreUnavailable: ``create`` is not False and the database cannot be reached.
    """

    offload_async = True
    """Whether the guard runs this store's calls in a worker thread for async effects."""

    def __init__(
        self,
        url_or_engine: str | sa.Engine,
        *,
        clock: Callable[[], float] | None = None,
        table_name: str = DEFAULT_TABLE,
        create: bool | None = None,
        ledger_id: str | None = None,
    ) -> None:
        self._ledger = None if ledger_id is None else check_ledger_id(ledger_id)
        model: Any = effect_model(table_name)
        self._table: sa.Table = model.__table__
        owned = isinstance(url_or_engine, str)
        engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
        if (dialect := engine.dialect.name) not in DB_NOW:
            raise ConfigurationError(f"SqlStore serves SQLite and Postgres, not {dialect}")
        self._engine = engine
        self._owned = owned
        self._postgres = dialect == "postgresql"
        # What "now" is bound from: the injected clock, else on SQLite (in-process) the host's.
        self._now: Callable[[], float] | None = clock
        if clock is None and not self._postgres:
            self._now = time.time
        # Threads keep connections only in a pool of its own: a pool shared with the caller (a
        # given engine) is never short of the connections the store's threads would keep.
        self._driver = SqlDriver(engine, unavailable=_unavailable, error=_error, keep=owned)
        # The records this store's claims handed out and that are still live, by key: complete()
        # rebuilds the finished record from one of these instead of reading every column back.
        self._held: dict[str, Record] = {}
        quoted = engine.dialect.identifier_preparer.quote(table_name)
        statements = effect_statements(quoted, dialect, bound_now=self._now is not None)
        self._sql = {name: Statement(text, engine.dialect) for name, text in statements.items()}
        self._url = url_or_engine if isinstance(url_or_engine, str) else shown_url(engine)
        self._unchecked = False
        try:
            ensure_schema(engine, EFFECTS, table_name, create=create, url=self._url)
        except StoreUnavailable:
            if create is not False:
                self.close()
                raise
            # Without create a store opens while its database is away, as it always has: the
            # revision is then checked by the first call that reaches it.
            self._unchecked = True
        except BaseException:
            self.close()
            raise
        if not self._unchecked and self._ledger is None:
            try:
                self.ledger_id()  # read once at open, as the revision is
            except BaseException:
                self.close()
                raise

    def ledger_id(self) -> str:
        """This ledger's id (see :meth:`IdempotencyStore.ledger_id
        <sagaguard.idempotency.store.IdempotencyStore.ledger_id>`): the one given, else the one kept
        in the ``{table_name}_ledger`` table, read once (at open, or by the first call that reaches
        a database that was away then).

        Raises:
            StoreUnavailable: the database cannot be reached.
            StoreError: the database failed.
            ConfigurationError: the kept id is malformed (written by hand).
        """
        if self._ledger is None:
            with self._core() as conn:
                self._ledger = read_or_insert(conn, self._table.name)
        return self._ledger

    # -- plumbing ----------------------------------------------------------------------------

    def _verify(self) -> None:
        """Check the table's revision if the database was away when the store opened."""
        if self._unchecked:
            ensure_schema(self._engine, EFFECTS, self._table.name, create=False, url=self._url)
            self._unchecked = False

    def _run(self, cursor: Any, name: str, params: dict[str, Any]) -> list[Any]:
        """Statement ``name`` with ``params`` (and ``:now``, when the store binds the time)."""
        if self._now is not None:
            params["now"] = float(self._now())
        return self._driver.run(cursor, self._sql[name], params)

    def _write(self, name: str, params: dict[str, Any]) -> list[Any]:
        """Statement ``name`` as a block of its own: one statement, one transaction."""
        self._verify()
        with self._driver.block() as cursor:
            return self._run(cursor, name, params)

    @contextlib.contextmanager
    def _core(self) -> Iterator[sa.Connection]:
        """A SQLAlchemy Core connection in a transaction, the driver's errors made ours."""
        self._verify()
        driver = self._driver
        with driver.lock, driver.translated(), self._engine.begin() as conn:
            yield conn

    def _fenced(self, name: str, key: str, token: int, **params: Any) -> Any:
        rows = self._write(name, {"key": key, "token": token, **params})
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

    # -- the schema --------------------------------------------------------------------------

    def create_tables(self) -> None:
        """Create the effects table and its indexes if missing, or upgrade it to this code's schema
        revision (see :func:`~sagaguard.idempotency.migrations.upgrade_schema`). Safe to race.

        Raises:
            SchemaVersionMismatch: the table is newer than this code.
            StoreUnavailable: the database cannot be reached.
        """
        upgrade_schema(self._engine, EFFECTS, self._table.name)

    # -- the contract ------------------------------------------------------------------------

    def now(self) -> float:
        """The store's clock: the injected one, or the database's time (one query)."""
        if self._now is not None:
            return float(self._now())
        return float(self._write("now", {})[0][0])

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        """See :meth:`IdempotencyStore.claim`.

        A plain insert (``ON CONFLICT DO NOTHING``, its own transaction) comes first and settles a
        new key alone: one statement, one commit (on Postgres one round trip). Only when a record
        is in the way does the claim follow: one upsert whose ``DO UPDATE`` fires only for a record
        that may be replaced (finished and expired) or taken over (lease run out, same
        fingerprint). An inserted row gets the random starting token of
        :func:`~sagaguard.idempotency.store.first_token`, bound as a parameter, and ``DO UPDATE``
        sets the old token + 1. On SQLite the upsert and, if it returns nothing, the read of that
        record are one ``BEGIN IMMEDIATE`` transaction. On Postgres the upsert's statement itself
        returns that record (a replay is two round trips, and takes no row lock); it returns
        nothing only when it lost a race with a concurrent claim, and the record is then read at
        once.
        """
        params = {
            "key": identity.key,
            "namespace": identity.namespace,
            "scope": identity.scope,
            "name": identity.name,
            "ordinal": identity.ordinal,
            "fingerprint": fingerprint,
            "lease": float(lease),
            "first_token": first_token(),  # used only if no row is in the way
            "holder": _holder.current(),
            "result_type": identity.result_type,
        }
        self._verify()
        for _ in range(_CLAIM_ATTEMPTS):
            with self._driver.block() as cursor:
                rows = self._claim_rows(cursor, identity, params)
            claimed = self._claimed(rows)
            if claimed is not None:
                return claimed
            # That record was deleted before we could read it: claim again.
        raise StoreError(f"claim of effect key {identity.key[:16]}... kept racing with deletes")

    def _claim_rows(self, cursor: Any, identity: EffectIdentity, params: dict[str, Any]) -> list[Any]:
        """The claim's rows: ``won``, then the record's columns."""
        inserted = self._insert(cursor, params)
        if inserted is not None:  # nothing was in the way: the row is the one just inserted
            now, lease_until = inserted
            return [(True, identity.key, identity.namespace, identity.scope, identity.name,
                     identity.ordinal, params["fingerprint"], State.IN_PROGRESS.value,
                     params["first_token"], lease_until, 1, now, now,
                     None, None, None, params["holder"], params["result_type"])]  # fmt: skip
        if not self._postgres:
            cursor.execute("BEGIN IMMEDIATE")  # the upsert and the read, as one
        rows = self._run(cursor, "claim", params)
        if not rows:  # read the record in the way (SQLite: in the same transaction)
            rows = [(False, *row) for row in self._run(cursor, "get", {"key": identity.key})]
        return rows

    def _insert(self, cursor: Any, params: dict[str, Any]) -> tuple[float, float] | None:
        """The claim's first statement, its own transaction: the plain insert of a new record
        (``ON CONFLICT DO NOTHING``). Its ``created_at`` and ``lease_until`` when it inserted it,
        None when a record is in the way (nothing written, no row locked)."""
        if self._now is None:  # Postgres's clock: the statement returns the times it read
            rows = self._driver.run(cursor, self._sql["insert"], params)
            return (float(rows[0][0]), float(rows[0][1])) if rows else None
        now = float(self._now())  # the store binds the time: the inserted row is known here
        fresh = {**params, "now": now, "lease_until": now + params["lease"]}
        if self._driver.execute(cursor, self._sql["insert"], fresh) == 1:
            return now, fresh["lease_until"]
        return None

    def _claimed(self, rows: list[Any]) -> ClaimResult | None:
        """The outcome of a claim's rows; None when there are none (the record in the way was
        deleted before it could be read)."""
        if not rows:
            return None
        won, *columns = rows[0]
        rec = _record(columns)
        if not won:
            return ClaimResult(ClaimOutcome.EXISTING, rec)
        self._hold(rec)
        if rec.state is State.IN_PROGRESS:
            return ClaimResult(ClaimOutcome.CLAIMED, rec)
        return ClaimResult(ClaimOutcome.TOOK_OVER, rec)

    def _hold(self, rec: Record) -> None:
        held = self._held  # ours now, until complete() or fail()
        if len(held) >= _HELD_MAX:
            held.clear()
        held[rec.key] = rec

    def get(self, key: str) -> Record | None:
        """See :meth:`IdempotencyStore.get`."""
        storable_text("key", key, empty_ok=True)  # a lone surrogate would reach the driver
        rows = self._write("get", {"key": key})
        return _record(rows[0]) if rows else None

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        """See :meth:`IdempotencyStore.complete`. One fenced UPDATE.

        When this store's own claim handed out ``token`` for ``key``, the finished record is built
        from that claim's record and the times the UPDATE returns (``complete_held``).
        """
        held = self._held.pop(key, None)
        values: dict[str, Any] = {"result": result, "retention": float(retention)}
        if held is None or held.token != token:
            return _record(self._fenced("complete", key, token, **values))
        row = self._fenced("complete_held", key, token, **values)
        lease_until, updated_at, expires_at = (float(v) for v in row)
        return Record(
            key, held.namespace, held.scope, held.name, held.ordinal, held.fingerprint,
            State.SUCCEEDED, token, lease_until, held.attempts, held.created_at,
            updated_at, expires_at, result, None, held.holder, held.result_type,
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
        values = {"key": key, "token": token, "lease": float(lease), "holder": _holder.current()}
        rows = self._write("take_over", values)
        if not rows:
            return None
        rec = _record(rows[0])
        self._hold(rec)  # ours now, as after a claim
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
        with self._core() as conn:
            return [_record(row) for row in conn.execute(self._listing(states, namespace, limit, after))]

    def _listing(
        self, states: Collection[State] | None, namespace: str | None, limit: int, after: str | None
    ) -> sa.Select[Any]:
        """The query of :meth:`list`: in doubt or failed records are a range scan of the partial
        index on ``state``; any other state, a walk of the primary key in order (a success, the
        hot path, writes no entry into that index)."""
        t = self._table.c
        query = sa.select(*(t[name] for name in COLUMNS.split(", ")))
        if states is not None:
            wanted = {State(s).value for s in states}
            query = query.where(t.state.in_(sorted(wanted)))
            if wanted <= RARE_STATES:  # the partial index's condition, word for word (SQLite)
                query = query.where(sa.text(RARE))
        if namespace is not None:
            query = query.where(t.namespace == namespace)
        if after is not None:
            query = query.where(t.key > after)
        return query.order_by(t.key).limit(max(0, limit))

    def _purging(self, limit: int) -> sa.Delete:
        """The retention sweep's DELETE: a range scan of the partial index on ``expires_at``. The
        condition is repeated outside the subquery: a row re-claimed in between (Postgres re-checks
        a row that changed under it) is then left alone."""
        t = self._table.c
        now: Any = (
            sa.literal_column(DB_NOW[self._engine.dialect.name])
            if self._now is None
            else sa.literal(float(self._now()), sa.Double)
        )
        purgeable = sa.and_(t.state.in_(_FINISHED), t.expires_at <= now)
        doomed = sa.select(t.key).where(purgeable).limit(max(0, limit))
        return sa.delete(self._table).where(t.key.in_(doomed), purgeable)

    def purge(self, *, limit: int = 1000) -> int:
        """See :meth:`IdempotencyStore.purge`. One DELETE of at most ``limit`` rows."""
        with self._core() as conn:
            return int(conn.execute(self._purging(limit)).rowcount)

    def close(self) -> None:
        """Give back the connections the store's threads kept (Postgres), and release those of an
        engine the store made (a given engine is left alone)."""
        self._held.clear()
        self._driver.close()
        if self._owned:
            self._engine.dispose()

    def __repr__(self) -> str:
        url = self._engine.url.render_as_string(hide_password=True)
        return f"SqlStore({url!r}, table={self._table.name!r})"
