"""The SQL journal's tables (SQLModel) and its statements, built once per table prefix and dialect.

``{prefix}sagas``: one row per saga instance; ``{prefix}saga_steps``: one row per started step;
``{prefix}saga_signals``: one row per delivered signal. The statements are plain text with named
parameters; "now" is the database's own clock read inside the statement, or the ``:now`` parameter
when a clock is injected.
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
from sagaguard.saga.lease import KEPT_WITHIN

__all__ = [
    "DEFAULT_PREFIX",
    "SAGA_COLUMNS",
    "SCHEMA_VERSION",
    "STEP_COLUMNS",
    "SagaFields",
    "SignalFields",
    "Statements",
    "StepFields",
    "create_journal_tables",
    "journal_models",
    "journal_tables",
]

SCHEMA_VERSION: Final = 5
"""2 added deadlines, recovery counts, waits, cancellation and the signals table; 3 added the
steps' ``trace`` and ``resolution`` columns; 4 the sagas' ``holder`` column (3 and 4 are added to
existing tables by the ``journal`` table set's first migration, ``journal_0001``; an older row's
holder reads as None, unknown); 5 dropped the sagas' index on ``state`` alone and, on Postgres,
gave the sagas and steps tables a fillfactor (``journal_0002``)."""
DEFAULT_PREFIX: Final = "sagaguard_"

_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")
_DB_NOW = {
    "postgresql": "CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}
SAGA_COLUMNS: Final = (
    "saga_id, name, version, fingerprint, input, state, token, lease_until, created_at, updated_at, "
    "error, deadline, recoveries, waiting_for, wait_until, cancel_requested, holder"
)
"""In the order of :class:`~sagaguard.saga.records.SagaRecord`'s fields."""
STEP_COLUMNS: Final = (
    "saga_id, idx, name, kind, state, compensation, result, error, not_applied, compensation_error, "
    "attempts, compensation_attempts, started_at, updated_at, trace, resolution"
)
_LIVE = "('running', 'compensating')"
_RESUMABLE = "('running', 'compensating', 'waiting')"


class _JournalModel(SQLModel, registry=registry()):
    """Base of the journal's tables: their own registry keeps them out of ``SQLModel.metadata``."""


class SagaFields(_JournalModel):
    """The columns of the sagas table (:class:`~sagaguard.saga.records.SagaRecord`)."""

    saga_id: str = Field(primary_key=True, max_length=255)
    name: str = Field(sa_type=sa.Text)
    version: int
    fingerprint: str = Field(max_length=80)
    input: str = Field(sa_type=sa.Text)
    state: str = Field(max_length=24)  # indexed first in the due index (journal_models)
    token: int = Field(sa_type=sa.BigInteger)
    lease_until: float = Field(sa_type=sa.Double)
    created_at: float = Field(sa_type=sa.Double)
    updated_at: float = Field(sa_type=sa.Double)
    error: str | None = Field(default=None, sa_type=sa.Text)
    deadline: float = Field(default=0.0, sa_type=sa.Double)
    recoveries: int = 0
    waiting_for: str | None = Field(default=None, sa_type=sa.Text)
    wait_until: float = Field(default=0.0, sa_type=sa.Double)
    cancel_requested: bool = False
    holder: str | None = Field(default=None, sa_type=sa.Text)


class StepFields(_JournalModel):
    """The columns of the steps table (:class:`~sagaguard.saga.records.StepRecord`)."""

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
    trace: str | None = Field(default=None, max_length=64)
    resolution: str | None = Field(default=None, sa_type=sa.Text)


class SignalFields(_JournalModel):
    """The columns of the signals table: one delivered signal of one saga."""

    saga_id: str = Field(primary_key=True, max_length=255)
    name: str = Field(primary_key=True, max_length=255)
    payload: str = Field(sa_type=sa.Text)
    created_at: float = Field(sa_type=sa.Double)


Models = tuple[type[SagaFields], type[StepFields], type[SignalFields]]
FILLFACTOR: Final = 70
"""Postgres: how full an insert leaves a page of the sagas and steps tables. A saga's row and its
steps' rows are updated a few times soon after they are written; the room left lets such an update
stay on the page as a heap-only tuple (no index entry) when it changes no indexed column."""
_ROOM: Final = {"postgresql_with": {"fillfactor": FILLFACTOR}}
_models: dict[str, Models] = {}
_models_lock = threading.Lock()


def _model(base: type[Any], table: str, args: tuple[Any, ...] = ()) -> Any:
    def body(ns: dict[str, Any]) -> None:
        ns.update(__tablename__=table, __table_args__=args)

    return types.new_class(f"{base.__name__}_{table}", (base,), {"table": True}, body)


def journal_models(prefix: str = DEFAULT_PREFIX) -> Models:
    """The SQLModel table classes ``{prefix}sagas``, ``{prefix}saga_steps`` and
    ``{prefix}saga_signals`` (built once per prefix, cached).

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
            sagas = f"{prefix}sagas"
            # The recovery sweep's query (resumable states whose lease_until has passed) and a
            # listing by state (the leading column) both use this one index.
            due = sa.Index(f"ix_{sagas}_due", "state", "lease_until")
            found = (
                _model(SagaFields, sagas, (due, _ROOM)),
                _model(StepFields, f"{prefix}saga_steps", (_ROOM,)),
                _model(SignalFields, f"{prefix}saga_signals"),
            )
            _models[prefix] = found
        return found


def metadata() -> sa.MetaData:
    """The metadata every journal table is registered in."""
    return _JournalModel.metadata


def journal_tables(prefix: str) -> list[sa.Table]:
    """The tables ``{prefix}sagas``, ``{prefix}saga_steps`` and ``{prefix}saga_signals``.

    Raises:
        ConfigurationError: the prefix is not a plain identifier of at most 40 characters.
    """
    return [cast(sa.Table, getattr(model, "__table__")) for model in journal_models(prefix)]  # noqa: B009


def create_journal_tables(conn: sa.Connection, prefix: str) -> None:
    """Create the journal's tables under ``prefix`` and their indexes where missing."""
    metadata().create_all(conn, tables=journal_tables(prefix))


class Statements:
    """Every statement of the journal, for one set of table names and one dialect.

    Args:
        sagas, steps, signals: the quoted table names.
        dialect: ``postgresql`` or ``sqlite``.
        injected_clock: "now" is the ``:now`` parameter instead of the database's clock.
    """

    def __init__(self, sagas: str, steps: str, signals: str, dialect: str, *, injected_clock: bool) -> None:
        now = "CAST(:now AS DOUBLE PRECISION)" if injected_clock else _DB_NOW[dialect]
        clock = f"(SELECT {now} AS now) AS c"
        seconds = "CAST(:lease AS DOUBLE PRECISION)"
        fence = f"saga_id = :saga_id AND token = :token AND state IN {_LIVE}"
        waking = "CASE WHEN state = 'waiting' THEN 0 ELSE 1 END"
        self.now = sa.text(f"SELECT {now}")
        self.start = sa.text(f"""
            INSERT INTO {sagas} AS s ({SAGA_COLUMNS})
            SELECT :saga_id, :name, :version, :fingerprint, :input, 'running', 1,
                   c.now + CAST(:lease AS DOUBLE PRECISION), c.now, c.now, NULL,
                   CASE WHEN CAST(:timeout AS DOUBLE PRECISION) > 0
                        THEN c.now + CAST(:timeout AS DOUBLE PRECISION) ELSE 0 END,
                   0, NULL, 0, false, :holder
            FROM {clock} WHERE true
            ON CONFLICT (saga_id) DO UPDATE SET
                token = s.token + 1, lease_until = excluded.lease_until, updated_at = excluded.updated_at,
                holder = excluded.holder,
                state = CASE WHEN s.state = 'waiting' THEN 'running' ELSE s.state END,
                recoveries = s.recoveries + CASE WHEN s.state = 'waiting' THEN 0 ELSE 1 END
            WHERE s.state IN {_RESUMABLE} AND s.lease_until <= excluded.created_at
              AND s.name = excluded.name AND s.version = excluded.version
              AND s.fingerprint = excluded.fingerprint
            RETURNING {SAGA_COLUMNS}""")
        self.claim = sa.text(
            f"UPDATE {sagas} SET token = token + 1, lease_until = c.now + CAST(:lease AS DOUBLE PRECISION), "
            f"updated_at = c.now, state = CASE WHEN state = 'waiting' THEN 'running' ELSE state END, "
            f"recoveries = recoveries + {waking}, holder = :holder FROM {clock} "
            f"WHERE saga_id = :saga_id AND state IN {_RESUMABLE} AND lease_until <= c.now "
            f"RETURNING {SAGA_COLUMNS}"
        )
        # A dead holder's live saga, fenced on the token it was read with (the lease not looked at).
        self.take_over = sa.text(
            f"UPDATE {sagas} SET token = token + 1, lease_until = c.now + {seconds}, updated_at = c.now, "
            f"recoveries = recoveries + 1, holder = :holder FROM {clock} WHERE {fence} "
            f"RETURNING {SAGA_COLUMNS}"
        )
        # Live sagas under a live lease held on this host (``:host`` is ``<host>|``, ``:n`` its
        # length): the due sweep probes each holder and takes over the dead ones' at once.
        self.held_here = sa.text(
            f"SELECT {SAGA_COLUMNS} FROM {sagas}, {clock} WHERE state IN {_LIVE} "
            "AND lease_until > c.now AND substr(holder, 1, CAST(:n AS INTEGER)) = :host "
            "ORDER BY lease_until, saga_id"
        )
        self.due = sa.text(
            f"SELECT {SAGA_COLUMNS} FROM {sagas}, {clock} WHERE state IN {_RESUMABLE} "
            "AND lease_until <= c.now ORDER BY lease_until, saga_id LIMIT :limit"
        )
        self.get_saga = sa.text(f"SELECT {SAGA_COLUMNS} FROM {sagas} WHERE saga_id = :saga_id")
        self.lock_saga = sa.text(
            f"SELECT state, waiting_for FROM {sagas} WHERE saga_id = :saga_id FOR UPDATE"
        )
        self.get_steps = sa.text(f"SELECT {STEP_COLUMNS} FROM {steps} WHERE saga_id = :saga_id ORDER BY idx")
        self.get_signals = sa.text(f"SELECT name, payload FROM {signals} WHERE saga_id = :saga_id")
        # A bound "now" needs no clock row to join: the hot updates then name it directly.
        at, source = (now, "") if injected_clock else ("c.now", f" FROM {clock}")
        # lease.renewed: a lease already ending in the last fifth of the one asked for is kept.
        ahead = f"lease_until > {at} + {seconds} * {1 - KEPT_WITHIN!r} AND lease_until <= {at} + {seconds}"
        lease = f"CASE WHEN {seconds} <= 0 THEN 0 WHEN {ahead} THEN lease_until ELSE {at} + {seconds} END"
        self.text: dict[str, str] = {
            # The atomic phase's fenced update of the saga row: a heartbeat, or a new state.
            "touch": f"UPDATE {sagas} SET lease_until = {lease}, updated_at = {at}{source} "
            f"WHERE {fence} RETURNING {SAGA_COLUMNS}",
            "move": f"UPDATE {sagas} SET state = :state, error = :error, lease_until = {lease}, "
            f"updated_at = {at}{source} WHERE {fence} RETURNING {SAGA_COLUMNS}",
            # A move to COMPLETED unless a cancellation is pending (Phase.unless_cancelled): with
            # one, the saga stays RUNNING with its error and a renewed lease; without, it completes
            # with its lease released. Decided on the row this update locks.
            "finish": f"UPDATE {sagas} SET state = CASE WHEN cancel_requested THEN state ELSE :state END, "
            "error = CASE WHEN cancel_requested THEN error ELSE :error END, "
            f"lease_until = CASE WHEN cancel_requested THEN {lease} ELSE 0 END, "
            f"updated_at = {at}{source} WHERE {fence} RETURNING {SAGA_COLUMNS}",
        }
        """The statements of the hot path (run by :mod:`sagaguard.idempotency.backends.sql_driver`), as
        text."""
        # Parking: due at once when the awaited signal is already recorded or a cancel is pending.
        self.park = sa.text(
            f"UPDATE {sagas} SET state = 'waiting', error = :error, waiting_for = :waiting_for, "
            "wait_until = CAST(:wait_until AS DOUBLE PRECISION), updated_at = c.now, "
            "lease_until = CASE WHEN (cancel_requested AND :wake_on_cancel) "
            f"OR EXISTS (SELECT 1 FROM {signals} AS g WHERE g.saga_id = :saga_id AND g.name = :waiting_for) "
            "THEN c.now ELSE CAST(:wake_at AS DOUBLE PRECISION) END "
            f"FROM {clock} WHERE {fence} RETURNING {SAGA_COLUMNS}"
        )
        kept = ("saga_id", "idx", "started_at")
        updates = ", ".join(f"{c} = excluded.{c}" for c in STEP_COLUMNS.split(", ") if c not in kept)
        self._steps_table = steps
        self._upsert_tail = f"ON CONFLICT (saga_id, idx) DO UPDATE SET {updates}"
        self.text["upsert_step"] = (
            f"INSERT INTO {steps} ({STEP_COLUMNS}) VALUES (:saga_id, :idx, :name, :kind, :state, "
            ":compensation, :result, :error, :not_applied, :compensation_error, :attempts, "
            f":compensation_attempts, :stamp, :stamp, :trace, :resolution) {self._upsert_tail}"
        )
        self.upsert_step = sa.text(self.text["upsert_step"])
        self.text["start"] = str(self.start.text)
        for name in ("get_saga", "get_steps", "get_signals"):
            self.text[name] = str(getattr(self, name).text)
        # An operator puts a saga that needs attention back to work, due at once (fenced on token).
        self.reopen = sa.text(
            f"UPDATE {sagas} SET state = :state, error = :error, token = token + 1, lease_until = c.now, "
            f"updated_at = c.now, recoveries = 0 FROM {clock} "
            "WHERE saga_id = :saga_id AND token = :token AND state = 'needs_attention' "
            f"RETURNING {SAGA_COLUMNS}"
        )
        self.add_signal = sa.text(
            f"INSERT INTO {signals} (saga_id, name, payload, created_at) "
            f"SELECT :saga_id, :name, :payload, c.now FROM {clock} WHERE true "
            "ON CONFLICT (saga_id, name) DO NOTHING RETURNING name"
        )
        self.wake = sa.text(
            f"UPDATE {sagas} SET lease_until = c.now, updated_at = c.now FROM {clock} "
            "WHERE saga_id = :saga_id AND state = 'waiting' AND waiting_for = :name"
        )
        self.cancel = sa.text(
            f"UPDATE {sagas} SET cancel_requested = true, error = :cause, updated_at = c.now, "
            "lease_until = CASE WHEN state = 'waiting' THEN c.now ELSE lease_until END "
            f"FROM {clock} WHERE saga_id = :saga_id AND state IN ('running', 'waiting') "
            "AND NOT cancel_requested RETURNING saga_id"
        )

    def phase(self, update: str, rows: int) -> str:
        """Postgres: the fenced ``update`` (``touch``, ``move`` or ``finish``) of the saga row and
        the upsert of ``rows`` step rows as one statement, so an atomic phase is one round trip in
        autocommit.

        The step rows are selected from the updated saga row: when the fence refuses the update,
        no step row is written either. Their values are the parameters ``{field}{i}`` (``idx0``,
        ``name0``, ... for the first row); both timestamps are the saga row's new ``updated_at``
        (the conflict update keeps the existing ``started_at``).
        """
        return self._with_steps(self.text[update], rows)

    def start_with_step(self) -> str:
        """Postgres: :attr:`start` and, only when it created the saga (token 1), the upsert of its
        first step row (parameters ``idx0``, ``name0``, ...), as one statement."""
        return self._with_steps(self.text["start"], 1, "WHERE r.token = 1")

    def _with_steps(self, saga_sql: str, rows: int, where: str = "") -> str:
        """``saga_sql`` (returning the saga row) with ``rows`` step rows upserted from its result."""
        if rows == 0:
            return saga_sql
        values = ", ".join(
            "(" + ", ".join(f"CAST(:{field}{i} AS {kind})" for field, kind in _STEP_VALUES) + ")"
            for i in range(rows)
        )
        names = ", ".join(field for field, _ in _STEP_VALUES)
        stamped = {"saga_id": "r.saga_id", "started_at": "r.updated_at", "updated_at": "r.updated_at"}
        picked = ", ".join(stamped.get(c, f"v.{c}") for c in STEP_COLUMNS.split(", "))
        # A data-modifying WITH runs to completion whether or not the outer query reads it.
        return (
            f"WITH r AS ({saga_sql}), "
            f"w AS (INSERT INTO {self._steps_table} ({STEP_COLUMNS}) SELECT {picked} "
            f"FROM r, (VALUES {values}) AS v({names}) {where} {self._upsert_tail}) "
            "SELECT * FROM r"
        )


_STEP_VALUES: Final = (
    ("idx", "INTEGER"),
    ("name", "TEXT"),
    ("kind", "TEXT"),
    ("state", "TEXT"),
    ("compensation", "TEXT"),
    ("result", "TEXT"),
    ("error", "TEXT"),
    ("not_applied", "BOOLEAN"),
    ("compensation_error", "TEXT"),
    ("attempts", "INTEGER"),
    ("compensation_attempts", "INTEGER"),
    ("trace", "TEXT"),
    ("resolution", "TEXT"),
)
"""The step fields a phase binds per row, with their Postgres types (a NULL needs one)."""
