"""The SQL journal: two SQLModel tables serving SQLite (the embedded default) and PostgreSQL.

``{prefix}sagas`` holds one row per saga instance, ``{prefix}saga_steps`` one row per started step.
Each primitive is one transaction; :meth:`SqlJournal.commit` (the atomic phase) is one fenced
``UPDATE .. RETURNING`` of the saga row followed by an upsert per step row, committed together, so a
phase is written entirely or not at all. The engine comes from :func:`idempotency.stores.sql.make_engine`:
SQLite in WAL mode with ``BEGIN IMMEDIATE`` writers, Postgres through psycopg 3.

Times are the database's own, read inside the statement, unless a clock is injected.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import threading
import types
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Final, cast

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import registry
from sqlalchemy.pool import StaticPool
from sqlmodel import Field, SQLModel

from idempotency.errors import ConfigurationError
from idempotency.stores.sql import make_engine
from saga.errors import JournalError, JournalUnavailable, LostSagaLease
from saga.records import (
    LIVE_STATES,
    Phase,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    StartOutcome,
    StartResult,
    StepKind,
    StepRecord,
    StepState,
)

__all__ = ["DEFAULT_PREFIX", "SCHEMA_VERSION", "SqlJournal", "journal_models"]

SCHEMA_VERSION: Final = 1
DEFAULT_PREFIX: Final = "sagaguard_"

_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")
_DB_NOW = {
    "postgresql": "CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}
_SAGA_COLUMNS = (
    "saga_id, name, version, fingerprint, input, state, token, lease_until, created_at, updated_at, error"
)
_STEP_COLUMNS = (
    "saga_id, idx, name, kind, state, compensation, result, error, not_applied, compensation_error, "
    "attempts, compensation_attempts, started_at, updated_at"
)
_LIVE = "('running', 'compensating')"


class _JournalModel(SQLModel, registry=registry()):
    """Base of the journal's tables: their own registry keeps them out of ``SQLModel.metadata``."""


class SagaFields(_JournalModel):
    """The columns of the sagas table (:class:`~saga.records.SagaRecord`)."""

    saga_id: str = Field(primary_key=True, max_length=255)
    name: str = Field(sa_type=sa.Text)
    version: int
    fingerprint: str = Field(max_length=80)
    input: str = Field(sa_type=sa.Text)
    state: str = Field(max_length=24, index=True)
    token: int = Field(sa_type=sa.BigInteger)
    lease_until: float = Field(sa_type=sa.Double)
    created_at: float = Field(sa_type=sa.Double)
    updated_at: float = Field(sa_type=sa.Double)
    error: str | None = Field(default=None, sa_type=sa.Text)


class StepFields(_JournalModel):
    """The columns of the steps table (:class:`~saga.records.StepRecord`)."""

    saga_id: str = Field(primary_key=True, max_length=255)
    idx: int = Field(primary_key=True)
    name: str = Field(sa_type=sa.Text)
    kind: str = Field(max_length=24)
    state: str = Field(max_length=24)
    compensation: str | None = Field(default=None, sa_type=sa.Text)
    result: str | None = Field(default=None, sa_type=sa.Text)
    error: str | None = Field(default=None, sa_type=sa.Text)
    not_applied: bool = False
    compensation_error: str | None = Field(default=None, sa_type=sa.Text)
    attempts: int = 0
    compensation_attempts: int = 0
    started_at: float = Field(sa_type=sa.Double)
    updated_at: float = Field(sa_type=sa.Double)


_models: dict[str, tuple[type[SagaFields], type[StepFields]]] = {}
_models_lock = threading.Lock()


def _model(base: type[Any], table: str) -> Any:
    return types.new_class(
        f"{base.__name__}_{table}", (base,), {"table": True}, lambda ns: ns.update(__tablename__=table)
    )


def journal_models(prefix: str = DEFAULT_PREFIX) -> tuple[type[SagaFields], type[StepFields]]:
    """The SQLModel table classes ``{prefix}sagas`` and ``{prefix}saga_steps`` (built once, cached).

    Raises:
        ConfigurationError: the prefix is not a plain identifier of at most 40 characters.
    """
    if not _PREFIX.fullmatch(prefix):
        raise ConfigurationError(
            f"table prefix {prefix!r} must be a letter or _ then up to 39 of [A-Za-z0-9_]"
        )
    with _models_lock:
        found = _models.get(prefix)
        if found is None:
            found = (_model(SagaFields, f"{prefix}sagas"), _model(StepFields, f"{prefix}saga_steps"))
            _models[prefix] = found
        return found


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """Re-raise driver errors as ours; the message is the driver's own, never the parameters."""
    try:
        yield
    except (sa_exc.SQLAlchemyError, sqlite3.Error, OSError) as exc:
        orig = getattr(exc, "orig", None) or exc
        text = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        transient = isinstance(
            exc,
            sa_exc.OperationalError
            | sa_exc.InterfaceError
            | sa_exc.TimeoutError
            | sqlite3.OperationalError
            | OSError,
        ) or (isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated)
        if transient:
            raise JournalUnavailable(f"SQL journal unavailable: {text}") from exc
        raise JournalError(f"SQL journal error: {text}") from exc


def _saga(row: Sequence[Any]) -> SagaRecord:
    return SagaRecord(
        saga_id=row[0],
        name=row[1],
        version=int(row[2]),
        fingerprint=row[3],
        input=row[4],
        state=SagaState(row[5]),
        token=int(row[6]),
        lease_until=float(row[7]),
        created_at=float(row[8]),
        updated_at=float(row[9]),
        error=row[10],
    )


def _step(row: Sequence[Any]) -> StepRecord:
    return StepRecord(
        index=int(row[1]),
        name=row[2],
        kind=StepKind(row[3]),
        state=StepState(row[4]),
        compensation=row[5],
        result=row[6],
        error=row[7],
        not_applied=bool(row[8]),
        compensation_error=row[9],
        attempts=int(row[10]),
        compensation_attempts=int(row[11]),
        started_at=float(row[12]),
        updated_at=float(row[13]),
    )


class SqlJournal:
    """A :class:`~saga.journal.SagaJournal` on SQLite or PostgreSQL. Thread-safe.

    Args:
        url_or_engine: ``sqlite:///path.db``, ``sqlite://`` (private, in memory),
            ``postgresql://user@host/db``, or an engine (then not disposed by :meth:`close`).
        clock: seconds since the epoch; inject one to test lease expiry without sleeping.
        table_prefix: the tables are ``{prefix}sagas`` and ``{prefix}saga_steps``.
        create: create the tables when missing.

    Raises:
        ConfigurationError: bad URL or prefix.
        JournalUnavailable: ``create`` is set and the database cannot be reached.
    """

    def __init__(
        self,
        url_or_engine: str | sa.Engine,
        *,
        clock: Callable[[], float] | None = None,
        table_prefix: str = DEFAULT_PREFIX,
        create: bool = True,
    ) -> None:
        saga_model, step_model = journal_models(table_prefix)
        self._tables = [
            cast(sa.Table, saga_model.__table__),  # type: ignore[attr-defined]
            cast(sa.Table, step_model.__table__),  # type: ignore[attr-defined]
        ]
        self._owned = isinstance(url_or_engine, str)
        engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
        dialect = engine.dialect.name
        if dialect not in _DB_NOW:
            raise ConfigurationError(f"SqlJournal serves SQLite and PostgreSQL, not {dialect}")
        self._engine = engine
        self._clock = clock
        self._postgres = dialect == "postgresql"
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if isinstance(engine.pool, StaticPool) else contextlib.nullcontext()
        )
        quote = engine.dialect.identifier_preparer.quote
        self._build(quote(f"{table_prefix}sagas"), quote(f"{table_prefix}saga_steps"), dialect)
        if create:
            self.create_tables()

    def _build(self, sagas: str, steps: str, dialect: str) -> None:
        now = "CAST(:now AS DOUBLE PRECISION)" if self._clock else _DB_NOW[dialect]
        self._now_sql = sa.text(f"SELECT {now}")
        self._start_sql = sa.text(f"""
            INSERT INTO {sagas} AS s ({_SAGA_COLUMNS})
            SELECT :saga_id, :name, :version, :fingerprint, :input, 'running', 1,
                   c.now + CAST(:lease AS DOUBLE PRECISION), c.now, c.now, NULL
            FROM (SELECT {now} AS now) AS c WHERE true
            ON CONFLICT (saga_id) DO UPDATE SET
                token = s.token + 1, lease_until = excluded.lease_until, updated_at = excluded.updated_at
            WHERE s.state IN {_LIVE} AND s.lease_until <= excluded.created_at
              AND s.name = excluded.name AND s.version = excluded.version
              AND s.fingerprint = excluded.fingerprint
            RETURNING {_SAGA_COLUMNS}""")
        self._get_saga_sql = sa.text(f"SELECT {_SAGA_COLUMNS} FROM {sagas} WHERE saga_id = :saga_id")
        self._get_steps_sql = sa.text(
            f"SELECT {_STEP_COLUMNS} FROM {steps} WHERE saga_id = :saga_id ORDER BY idx"
        )
        fence = f"saga_id = :saga_id AND token = :token AND state IN {_LIVE}"
        lease = "CASE WHEN :lease > 0 THEN c.now + CAST(:lease AS DOUBLE PRECISION) ELSE 0 END"
        clock_row = f"(SELECT {now} AS now) AS c"
        self._touch_sql = sa.text(
            f"UPDATE {sagas} SET lease_until = {lease}, updated_at = c.now FROM {clock_row} "
            f"WHERE {fence} RETURNING {_SAGA_COLUMNS}"
        )
        self._move_sql = sa.text(
            f"UPDATE {sagas} SET state = :state, error = :error, lease_until = {lease}, "
            f"updated_at = c.now FROM {clock_row} WHERE {fence} RETURNING {_SAGA_COLUMNS}"
        )
        kept = ("saga_id", "idx", "started_at")
        updates = ", ".join(f"{c} = excluded.{c}" for c in _STEP_COLUMNS.split(", ") if c not in kept)
        self._upsert_step_sql = sa.text(
            f"INSERT INTO {steps} ({_STEP_COLUMNS}) VALUES (:saga_id, :idx, :name, :kind, :state, "
            ":compensation, :result, :error, :not_applied, :compensation_error, :attempts, "
            ":compensation_attempts, :stamp, :stamp) "
            f"ON CONFLICT (saga_id, idx) DO UPDATE SET {updates}"
        )

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sa.Connection]:
        with self._lock, _translated(), self._engine.connect() as conn, conn.begin():
            yield conn

    def _params(self, **params: Any) -> dict[str, Any]:
        if self._clock is not None:
            params["now"] = float(self._clock())
        return params

    def create_tables(self) -> None:
        """Create both tables and their indexes if missing.

        Raises:
            JournalUnavailable: the database cannot be reached.
        """
        with self._connect() as conn:
            if self._postgres:  # two processes creating at once would collide
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": 0x5A6A_5A67})
            _JournalModel.metadata.create_all(conn, tables=self._tables)

    def now(self) -> float:
        """See :meth:`SagaJournal.now`."""
        if self._clock is not None:
            return float(self._clock())
        with self._connect() as conn:
            return float(conn.execute(self._now_sql).scalar_one())

    def _snapshot(self, conn: sa.Connection, saga: SagaRecord) -> SagaSnapshot:
        rows = conn.execute(self._get_steps_sql, {"saga_id": saga.saga_id})
        return SagaSnapshot(saga, tuple(_step(row) for row in rows))

    def start(
        self,
        saga_id: str,
        *,
        name: str,
        version: int,
        input: str,
        fingerprint: str,
        lease: float,
    ) -> StartResult:
        """See :meth:`SagaJournal.start`. One upsert (created or taken over), else one read."""
        params = self._params(
            saga_id=saga_id, name=name, version=version, input=input, fingerprint=fingerprint, lease=lease
        )
        with self._connect() as conn:
            row = conn.execute(self._start_sql, params).first()
            if row is not None:
                saga = _saga(row)
                outcome = StartOutcome.CREATED if saga.token == 1 else StartOutcome.TOOK_OVER
            else:
                saga = _saga(conn.execute(self._get_saga_sql, {"saga_id": saga_id}).one())
                outcome = StartOutcome.EXISTING
            return StartResult(outcome, self._snapshot(conn, saga))

    def load(self, saga_id: str) -> SagaSnapshot | None:
        """See :meth:`SagaJournal.load`."""
        with self._connect() as conn:
            row = conn.execute(self._get_saga_sql, {"saga_id": saga_id}).first()
            return None if row is None else self._snapshot(conn, _saga(row))

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        """See :meth:`SagaJournal.commit`. A fenced UPDATE and one upsert per step, one transaction."""
        params = self._params(saga_id=saga_id, token=token, lease=float(phase.lease))
        with self._connect() as conn:
            if phase.state is None:
                row = conn.execute(self._touch_sql, params).first()
            else:
                params.update(state=phase.state.value, error=phase.error)
                row = conn.execute(self._move_sql, params).first()
            if row is None:
                found = conn.execute(self._get_saga_sql, {"saga_id": saga_id}).first()
                raise _lost(saga_id, token, None if found is None else _saga(found))
            saga = _saga(row)
            for step in phase.steps:
                conn.execute(
                    self._upsert_step_sql,
                    {
                        "saga_id": saga_id,
                        "idx": step.index,
                        "name": step.name,
                        "kind": step.kind.value,
                        "state": step.state.value,
                        "compensation": step.compensation,
                        "result": step.result,
                        "error": step.error,
                        "not_applied": step.not_applied,
                        "compensation_error": step.compensation_error,
                        "attempts": step.attempts,
                        "compensation_attempts": step.compensation_attempts,
                        "stamp": saga.updated_at,
                    },
                )
            return saga

    def list(
        self,
        *,
        states: Collection[SagaState] | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[SagaRecord]:
        """See :meth:`SagaJournal.list`. Ordered by saga id (the primary key index)."""
        t = self._tables[0].c
        query = sa.select(*(t[name] for name in _SAGA_COLUMNS.split(", ")))
        if states is not None:
            query = query.where(t.state.in_([SagaState(s).value for s in states]))
        if after is not None:
            query = query.where(t.saga_id > after)
        query = query.order_by(t.saga_id).limit(max(0, limit))
        with self._connect() as conn:
            return [_saga(row) for row in conn.execute(query)]

    def close(self) -> None:
        """Dispose the engine the journal made (a given engine is left alone)."""
        if self._owned:
            self._engine.dispose()

    def __repr__(self) -> str:
        url = self._engine.url.render_as_string(hide_password=True)
        return f"SqlJournal({url!r}, tables={[t.name for t in self._tables]!r})"


def _lost(saga_id: str, token: int, found: SagaRecord | None) -> LostSagaLease:
    if found is None:
        return LostSagaLease(saga_id, token, "saga is unknown")
    if found.token != token:
        return LostSagaLease(saga_id, token, f"token is now {found.token}")
    if found.state not in LIVE_STATES:
        return LostSagaLease(saga_id, token, f"saga is already {found.state}")
    return LostSagaLease(saga_id, token)
