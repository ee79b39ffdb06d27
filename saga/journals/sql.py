"""The SQL journal: SQLModel tables serving SQLite (the embedded default) and PostgreSQL.

``{prefix}sagas`` holds one row per saga instance, ``{prefix}saga_steps`` one row per started step,
``{prefix}saga_signals`` one row per delivered signal (see :mod:`sagaguard.saga.journals.sql_schema`). Each
primitive is one transaction; :meth:`SqlJournal.commit` (the atomic phase) is one fenced
``UPDATE .. RETURNING`` of the saga row and an upsert per step row, committed together, so a
phase is written entirely or not at all: on Postgres one statement (the upserts in a data-modifying
``WITH`` fed by the update's ``RETURNING``, so a refused fence writes no step row) in autocommit, one
round trip; on SQLite one ``BEGIN IMMEDIATE`` transaction. Those calls a saga makes on every step
(:meth:`~SqlJournal.start`, :meth:`~SqlJournal.commit`) run their SQL text on the driver itself
(:mod:`sagaguard.idempotency.backends.sql_driver`: psycopg's prepared statements, sqlite3); the rest goes
through SQLAlchemy Core.
:meth:`SqlJournal.claim` is one conditional
``UPDATE .. RETURNING``: of two workers racing for a saga, the second finds it no longer due. The
engine comes from :func:`sagaguard.idempotency.stores.sql.make_engine`: SQLite in WAL mode with
``BEGIN IMMEDIATE`` writers (so writes are serialised), Postgres through psycopg 3, where parking a
saga and delivering a signal both lock the saga row first, so neither misses the other.

Times are the database's own, read inside the statement, unless a clock is injected. SQLite runs in
this process, so its clock is this host's: there ``time.time()`` is bound as a parameter (the same
instant as ``julianday('now')``, to the microsecond, without a clock expression in each statement).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import fields
from typing import Any, Final, cast

import sqlalchemy as sa

from sagaguard.idempotency.backends.sql_driver import SqlDriver, Statement
from sagaguard.idempotency.backends.sql_engine import make_engine
from sagaguard.idempotency.errors import ConfigurationError, StoreError, StoreUnavailable
from sagaguard.idempotency.migrations.runner import ensure_schema, shown_url, upgrade_schema
from sagaguard.saga import lease as _lease
from sagaguard.saga.checks import check_saga_id
from sagaguard.saga.decisions import cancel_outcome
from sagaguard.saga.errors import JournalError, JournalUnavailable, LostSagaLease, SagaNotFound
from sagaguard.saga.journals.sql_schema import (
    DEFAULT_PREFIX,
    SAGA_COLUMNS,
    SCHEMA_VERSION,
    Statements,
    journal_models,
)
from sagaguard.saga.migrations import TABLE_SET as JOURNAL
from sagaguard.saga.records import (
    LIVE_STATES,
    RESUMABLE_STATES,
    CancelOutcome,
    Phase,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    SignalOutcome,
    StartOutcome,
    StartResult,
    StepKind,
    StepRecord,
    StepState,
)

__all__ = ["DEFAULT_PREFIX", "SCHEMA_VERSION", "SqlJournal", "journal_models"]

_DIALECTS = ("postgresql", "sqlite")


def _unavailable(text: str) -> JournalUnavailable:
    return JournalUnavailable(f"SQL journal unavailable: {text}")


def _error(text: str) -> JournalError:
    return JournalError(f"SQL journal error: {text}")


_SAGA_STATES: Final = {state.value: state for state in SagaState}
if [f.name for f in fields(SagaRecord)] != SAGA_COLUMNS.split(", "):  # _saga reads rows in field order
    raise AssertionError("SAGA_COLUMNS no longer lists SagaRecord's fields in order")


def _saga(row: Sequence[Any]) -> SagaRecord:
    """A row in ``SAGA_COLUMNS`` order (the order of SagaRecord's fields, checked at import) as a
    record: positional, with the few conversions the drivers need (SQLite's 0/1 to bool)."""
    return SagaRecord(
        row[0], row[1], int(row[2]), row[3], row[4], _SAGA_STATES[row[5]], int(row[6]),
        float(row[7]), float(row[8]), float(row[9]), row[10], float(row[11]), int(row[12]),
        row[13], float(row[14]), bool(row[15]), row[16],
    )  # fmt: skip


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
        trace=row[14],
        resolution=row[15],
    )


def _step_values(step: StepRecord, suffix: str, **extra: Any) -> dict[str, Any]:
    """A step row's bound values, each name ending in ``suffix`` (a phase binds several rows)."""
    values = {
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
        "trace": step.trace,
        "resolution": step.resolution,
    }
    if suffix:
        values = {f"{name}{suffix}": value for name, value in values.items()}
    values.update(extra)
    return values


class SqlJournal:
    """A :class:`~sagaguard.saga.journal.SagaJournal` on SQLite or PostgreSQL. Thread-safe.

    Args:
        url_or_engine: ``sqlite:///path.db``, ``sqlite://`` (private, in memory),
            ``postgresql://user@host/db``, or an engine (then not disposed by :meth:`close`).
        clock: seconds since the epoch; inject one to test lease expiry without sleeping.
        table_prefix: the tables are ``{prefix}sagas``, ``{prefix}saga_steps`` and
            ``{prefix}saga_signals``.
        create: None (the default): create the tables when missing (a new database), at this
            code's schema revision, and refuse tables at an older or newer revision, naming
            ``sagaguard db upgrade`` (nothing is altered at open); True: also upgrade tables when
            older; False: write no DDL and refuse tables missing, older or newer.

    Raises:
        SchemaVersionMismatch: the tables are newer than this code, older (unless ``create`` is
            True) or missing (``create`` False): the message names ``sagaguard db upgrade --store URL``.
        ConfigurationError: bad URL or prefix.
        JournalUnavailable: the database cannot be reached.
        JournalError: the database failed while creating or upgrading the tables.
    """

    def __init__(
        self,
        url_or_engine: str | sa.Engine,
        *,
        clock: Callable[[], float] | None = None,
        table_prefix: str = DEFAULT_PREFIX,
        create: bool | None = None,
    ) -> None:
        models = journal_models(table_prefix)
        self._tables = [cast(sa.Table, getattr(model, "__table__")) for model in models]  # noqa: B009
        self._owned = isinstance(url_or_engine, str)
        engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
        dialect = engine.dialect.name
        if dialect not in _DIALECTS:
            raise ConfigurationError(f"SqlJournal serves SQLite and PostgreSQL, not {dialect}")
        self._engine = engine
        self._postgres = dialect == "postgresql"
        # What "now" is bound from: the injected clock, else on SQLite (in-process) the host's.
        self._clock = clock if clock is not None or self._postgres else time.time
        self._driver = SqlDriver(engine, unavailable=_unavailable, error=_error, keep=self._owned)
        quote = engine.dialect.identifier_preparer.quote
        sagas, steps, signals = (quote(t.name) for t in self._tables)
        self._sql = Statements(sagas, steps, signals, dialect, injected_clock=self._clock is not None)
        hot = dict(self._sql.text)
        if self._postgres:
            hot["start_with_step"] = self._sql.start_with_step()
        self._hot = {name: Statement(text, engine.dialect) for name, text in hot.items()}
        self._phases: dict[tuple[str, int], Statement] = {}
        self._prefix = table_prefix
        url = url_or_engine if isinstance(url_or_engine, str) else shown_url(engine)
        try:
            with self._journal_errors():
                ensure_schema(engine, JOURNAL, table_prefix, create=create, url=url)
        except BaseException:
            self.close()
            raise

    @staticmethod
    @contextlib.contextmanager
    def _journal_errors() -> Iterator[None]:
        """The migrations' store errors as the journal's."""
        try:
            yield
        except StoreUnavailable as exc:
            raise JournalUnavailable(f"SQL journal unavailable: {exc}") from exc
        except StoreError as exc:
            raise JournalError(f"SQL journal error: {exc}") from exc

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sa.Connection]:
        driver = self._driver
        with driver.lock, driver.translated(), self._engine.connect() as conn, conn.begin():
            yield conn

    def _params(self, **params: Any) -> dict[str, Any]:
        if self._clock is not None:
            params["now"] = float(self._clock())
        return params

    def _lock_row(self, conn: sa.Connection, saga_id: str) -> Sequence[Any] | None:
        """Postgres: lock the saga row for the transaction (SQLite writers are serialised anyway)."""
        if not self._postgres:
            return None
        return conn.execute(self._sql.lock_saga, {"saga_id": saga_id}).first()

    def create_tables(self) -> None:
        """Create the tables and their indexes if missing, or upgrade them to this code's schema
        revision (see :func:`~sagaguard.idempotency.migrations.upgrade_schema`). Safe to race.

        Raises:
            SchemaVersionMismatch: the tables are newer than this code.
            JournalUnavailable: the database cannot be reached.
            JournalError: the database failed.
        """
        with self._journal_errors():
            upgrade_schema(self._engine, JOURNAL, self._prefix)

    def now(self) -> float:
        """See :meth:`SagaJournal.now`."""
        if self._clock is not None:
            return float(self._clock())
        with self._connect() as conn:
            return float(conn.execute(self._sql.now).scalar_one())

    def _snapshot(self, conn: sa.Connection, saga: SagaRecord) -> SagaSnapshot:
        key = {"saga_id": saga.saga_id}
        steps = tuple(_step(row) for row in conn.execute(self._sql.get_steps, key))
        signals = {str(row[0]): str(row[1]) for row in conn.execute(self._sql.get_signals, key)}
        return SagaSnapshot(saga, steps, signals)

    def start(
        self,
        saga_id: str,
        *,
        name: str,
        version: int,
        input: str,
        fingerprint: str,
        lease: float,
        timeout: float = 0.0,
        first: StepRecord | None = None,
        holder: str | None = None,
    ) -> StartResult:
        """See :meth:`SagaJournal.start`. One upsert (on Postgres one statement with ``first``'s
        upsert; on SQLite that upsert follows in the same transaction); a saga it took over or
        found is then read. A live saga found held by a dead holder is then taken over
        (:mod:`sagaguard.saga.lease`).

        A saga the upsert created has no step rows but ``first`` and no signals (a saga row is
        never deleted, and a signal needs an existing saga), so nothing is read back for it.
        """
        check_saga_id(saga_id)
        params = self._params(
            saga_id=saga_id,
            name=name,
            version=version,
            input=input,
            fingerprint=fingerprint,
            lease=float(lease),
            timeout=float(timeout),
            holder=_lease.current(holder),
        )
        result = self._start(saga_id, params, first)
        return _lease.after_start(
            self, result, name=name, version=version, fingerprint=fingerprint, lease=lease, holder=holder
        )

    def _start(self, saga_id: str, params: dict[str, Any], first: StepRecord | None) -> StartResult:
        run, hot = self._driver.run, self._hot
        statement = hot["start"]
        if first is not None and self._postgres:
            statement = hot["start_with_step"]
            params.update(_step_values(first, "0"))
        with self._driver.block(immediate=True) as cursor:
            rows = run(cursor, statement, params)
            if rows:
                saga = _saga(rows[0])
                if saga.token == 1:
                    if first is None:
                        return StartResult(StartOutcome.CREATED, SagaSnapshot(saga, (), {}))
                    if not self._postgres:
                        stamp = saga.updated_at
                        values = _step_values(first, "", saga_id=saga_id, stamp=stamp)
                        self._driver.execute(cursor, hot["upsert_step"], values)
                    row = first.evolve(started_at=saga.updated_at, updated_at=saga.updated_at)
                    return StartResult(StartOutcome.CREATED, SagaSnapshot(saga, (row,), {}))
                outcome = StartOutcome.TOOK_OVER
            else:
                saga = _saga(run(cursor, hot["get_saga"], {"saga_id": saga_id})[0])
                outcome = StartOutcome.EXISTING
            key = {"saga_id": saga_id}
            steps = tuple(_step(row) for row in run(cursor, hot["get_steps"], key))
            signals = {str(row[0]): str(row[1]) for row in run(cursor, hot["get_signals"], key)}
        return StartResult(outcome, SagaSnapshot(saga, steps, signals))

    def claim(self, saga_id: str, *, lease: float, holder: str | None = None) -> SagaSnapshot | None:
        """See :meth:`SagaJournal.claim`. One conditional UPDATE, then the steps and signals; when
        the saga is not due, a read and (its holder dead) :meth:`take_over`."""
        check_saga_id(saga_id)
        params = self._params(saga_id=saga_id, lease=float(lease), holder=_lease.current(holder))
        with self._connect() as conn:
            row = conn.execute(self._sql.claim, params).first()
            if row is not None:
                return self._snapshot(conn, _saga(row))
        return _lease.after_claim(self, saga_id, lease=lease, holder=holder)

    def take_over(
        self, saga_id: str, token: int, *, lease: float, holder: str | None = None
    ) -> SagaSnapshot | None:
        """See :meth:`SagaJournal.take_over`. One UPDATE fenced on the token, then the steps and signals."""
        check_saga_id(saga_id)
        params = self._params(saga_id=saga_id, token=token, lease=float(lease), holder=_lease.current(holder))
        with self._connect() as conn:
            row = conn.execute(self._sql.take_over, params).first()
            return None if row is None else self._snapshot(conn, _saga(row))

    def due(self, *, limit: int = 100) -> list[SagaRecord]:
        """See :meth:`SagaJournal.due`. Served by the ``(state, lease_until)`` index; then the live
        sagas held on this host, whose holders are probed."""
        if limit <= 0:
            return []
        host = _lease.host_prefix()
        with self._connect() as conn:
            found = [_saga(row) for row in conn.execute(self._sql.due, self._params(limit=limit))]
            if len(found) >= limit or host is None:
                return found
            held = [_saga(r) for r in conn.execute(self._sql.held_here, self._params(host=host, n=len(host)))]
        return (found + _lease.dead_held(held))[:limit]

    def load(self, saga_id: str) -> SagaSnapshot | None:
        """See :meth:`SagaJournal.load`."""
        check_saga_id(saga_id)  # on Postgres "X\x00a" would find "X"
        with self._connect() as conn:
            row = conn.execute(self._sql.get_saga, {"saga_id": saga_id}).first()
            return None if row is None else self._snapshot(conn, _saga(row))

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        """See :meth:`SagaJournal.commit`.

        Postgres: one statement in autocommit (the fenced UPDATE with the step upserts as a
        data-modifying CTE fed by its ``RETURNING``). SQLite: one ``BEGIN IMMEDIATE`` transaction
        of the fenced UPDATE and the step upserts. Parking (``state=WAITING``) is one transaction
        through SQLAlchemy that locks the saga row first (Postgres), so it never misses a signal.
        """
        check_saga_id(saga_id)
        if phase.state is SagaState.WAITING:
            return self._park(saga_id, token, phase)
        params = self._params(saga_id=saga_id, token=token, lease=float(phase.lease))
        update = "touch"
        if phase.state is not None:
            update = "finish" if phase.unless_cancelled else "move"
            params["state"] = phase.state.value
            params["error"] = phase.error
        run, steps = self._driver.run, phase.steps
        if self._postgres:
            for i, step in enumerate(steps):
                params.update(_step_values(step, str(i)))
            statement = self._phase(update, len(steps))
        else:
            statement = self._hot[update]

        def work(cursor: Any) -> SagaRecord:
            rows = run(cursor, statement, params)
            if not rows:
                found = run(cursor, self._hot["get_saga"], {"saga_id": saga_id})
                raise _lost(saga_id, token, _saga(found[0]) if found else None)
            saga = _saga(rows[0])
            if steps and not self._postgres:
                stamp = saga.updated_at
                values = [_step_values(step, "", saga_id=saga_id, stamp=stamp) for step in steps]
                cursor.executemany(self._hot["upsert_step"].sql, values)
            return saga

        with self._driver.block(immediate=True) as cursor:
            return work(cursor)

    def _phase(self, update: str, rows: int) -> Statement:
        """Postgres: the one-statement phase for ``rows`` step rows, compiled once."""
        key = (update, rows)
        found = self._phases.get(key)
        if found is None:
            found = self._phases[key] = Statement(self._sql.phase(update, rows), self._engine.dialect)
        return found

    def _park(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        """A WAITING phase: the saga row locked, then parked (due at once if its signal is in)."""
        params = self._params(
            saga_id=saga_id,
            token=token,
            lease=float(phase.lease),
            error=phase.error,
            waiting_for=phase.waiting_for,
            wait_until=float(phase.wait_until),
            wake_at=float(phase.wake_at),
            wake_on_cancel=bool(phase.wake_on_cancel),
        )
        with self._connect() as conn:
            self._lock_row(conn, saga_id)
            row = conn.execute(self._sql.park, params).first()
            if row is None:
                found = conn.execute(self._sql.get_saga, {"saga_id": saga_id}).first()
                raise _lost(saga_id, token, None if found is None else _saga(found))
            saga = _saga(row)
            self._write_steps(conn, saga, phase.steps)
            return saga

    def _write_steps(self, conn: sa.Connection, saga: SagaRecord, steps: Sequence[StepRecord]) -> None:
        for step in steps:
            values = _step_values(step, "", saga_id=saga.saga_id, stamp=saga.updated_at)
            conn.execute(self._sql.upsert_step, values)

    def reopen(
        self, saga_id: str, token: int, state: SagaState, steps: Sequence[StepRecord], error: str | None
    ) -> SagaRecord | None:
        """See :meth:`SagaJournal.reopen`. One fenced UPDATE and one upsert per step row."""
        check_saga_id(saga_id)
        params = self._params(saga_id=saga_id, token=token, state=SagaState(state).value, error=error)
        with self._connect() as conn:
            row = conn.execute(self._sql.reopen, params).first()
            if row is None:
                return None
            saga = _saga(row)
            self._write_steps(conn, saga, steps)
            return saga

    def signal(self, saga_id: str, name: str, payload: str) -> SignalOutcome:
        """See :meth:`SagaJournal.signal`. Locks the saga row (Postgres), inserts, wakes."""
        check_saga_id(saga_id)
        with self._connect() as conn:
            self._lock_row(conn, saga_id)
            found = conn.execute(self._sql.get_saga, {"saga_id": saga_id}).first()
            if found is None:
                raise SagaNotFound(saga_id)
            saga = _saga(found)
            if saga.state not in RESUMABLE_STATES:
                return SignalOutcome.TOO_LATE
            added = conn.execute(
                self._sql.add_signal, self._params(saga_id=saga_id, name=name, payload=payload)
            ).first()
            if added is None:
                return SignalOutcome.DUPLICATE
            conn.execute(self._sql.wake, self._params(saga_id=saga_id, name=name))
            return SignalOutcome.DELIVERED

    def cancel(self, saga_id: str, cause: str) -> CancelOutcome:
        """See :meth:`SagaJournal.cancel`. Locks the saga row (Postgres), reads it and its steps,
        decides (:func:`~sagaguard.saga.decisions.cancel_outcome`) and records a REQUESTED one, in
        one transaction."""
        check_saga_id(saga_id)
        with self._connect() as conn:
            # Under the row lock (or SQLite's one writer) a phase commit of the saga's runner, its
            # pivot's row among them, is either read below or comes after and sees the cancel: a
            # plain conditional UPDATE could not read the steps table as of the lock (Postgres
            # re-checks only the updated row after waiting for it).
            self._lock_row(conn, saga_id)
            found = conn.execute(self._sql.get_saga, {"saga_id": saga_id}).first()
            if found is None:
                raise SagaNotFound(saga_id)
            outcome = cancel_outcome(self._snapshot(conn, _saga(found)))
            if outcome is CancelOutcome.REQUESTED:
                conn.execute(self._sql.cancel, self._params(saga_id=saga_id, cause=cause))
            return outcome

    def list(
        self,
        *,
        states: Collection[SagaState] | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[SagaRecord]:
        """See :meth:`SagaJournal.list`. Ordered by saga id (the primary key index)."""
        t = self._tables[0].c
        query = sa.select(*(t[name] for name in SAGA_COLUMNS.split(", ")))
        if states is not None:
            query = query.where(t.state.in_([SagaState(s).value for s in states]))
        if after is not None:
            query = query.where(t.saga_id > after)
        query = query.order_by(t.saga_id).limit(max(0, limit))
        with self._connect() as conn:
            return [_saga(row) for row in conn.execute(query)]

    def close(self) -> None:
        """Give back the connections the journal's threads kept, and dispose the engine the journal
        made (a given engine is left alone: no connection of it is held between calls)."""
        self._driver.close()
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
