"""The relay's primitives in SQL, one dialect at a time: claim, settle, extend.

Postgres: a claim is one ``UPDATE .. FROM (SELECT .. ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED)``
statement in autocommit, so any number of relays claim at once without waiting on each other. It
takes only the *head* of each aggregate (a row with no older row of its aggregate pending, in flight
or, when poison blocks, dead): the test reads committed state, so a row another relay is claiming
is still pending in its snapshot and keeps its followers back; per-aggregate order therefore holds
without a table lock. A batch settles in one ``UPDATE .. WHERE id = ANY(...)`` (failures and
releases, which carry per-message values, in one more).

SQLite: a claim is one ``BEGIN IMMEDIATE`` write transaction, so claims are serialised and may take
a *run* of an aggregate (a row whose older live rows are all claimable now is claimed with them, in
id order, by the same relay, which delivers them in order and stops at the first failure).

Every claim writes a fresh *claim token* (the relay's worker id plus a random suffix) into
``worker_id``, and every write after it is fenced by that token and ``status = 'pending'``: a relay
whose claim was taken over (its lease ran out and another relay claimed the row under its own
token) changes nothing, and learns which rows it lost.

Times: the database's clock, read inside the statement (Postgres), or the machine's clock (SQLite
is on this machine), unless a clock is injected.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from sagaguard.idempotency.backends.sql_driver import SqlDriver, Statement
from sagaguard.idempotency.errors import ConfigurationError, StoreError, StoreUnavailable
from sagaguard.idempotency.outbox.model import DEFAULT_TABLE, MessageStatus, check_table_name

__all__ = ["Claimed", "OutboxDb", "Settle"]

_PG_NOW = "CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)"
_RETURNED = (
    "id, aggregatetype, aggregateid, type, payload, headers, traceparent, tracestate, "
    "provider_key, attempts, max_attempts, created_at"
)


@dataclass(slots=True)  # not frozen: built per message on the hot path, where frozen costs 3x
class Claimed:
    """A row as a claim returned it. ``ref`` is the id as the driver gives it (for the fence)."""

    ref: Any
    id: str
    token: str
    """The claim token (stored in ``worker_id``) that fences every later write of this claim."""
    aggregatetype: str
    aggregateid: str
    type: str
    payload: str
    headers: str | None
    traceparent: str | None
    tracestate: str | None
    provider_key: str
    attempts: int
    max_attempts: int
    created_at: float


@dataclass(slots=True)
class Settle:
    """How one claimed message leaves the relay's hands."""

    ref: Any
    attempts: int
    """The attempts counted so far, this claim included."""
    status: str
    """``delivered``, ``pending`` (retry or release) or ``dead``."""
    delay: float = 0.0
    """For ``pending``: seconds until it may be claimed again."""
    error: str | None = None
    release: bool = False
    """Give the message back untried: its attempt is not counted."""


def _settle_json(o: Settle) -> dict[str, Any]:
    item: dict[str, Any] = {"id": str(o.ref), "s": o.status}
    if o.release:
        item["r"] = 1
    if o.delay:
        item["d"] = float(o.delay)
    if o.error is not None:
        item["e"] = o.error
    return item


def _uuid_text(ref: Any) -> str:
    return str(ref if isinstance(ref, uuid.UUID) else uuid.UUID(hex=str(ref)))


def _unavailable(text: str) -> StoreUnavailable:
    return StoreUnavailable(f"outbox database unavailable: {text}")


def _error(text: str) -> StoreError:
    return StoreError(f"outbox database error: {text}")


class OutboxDb:
    """Raw-cursor access to one outbox table: the relay's primitives and the operators' queries.

    Args:
        engine: an engine on SQLite or Postgres (:func:`sagaguard.idempotency.stores.sql.make_engine` builds
            one with the settings this needs: WAL and ``BEGIN IMMEDIATE`` on SQLite).
        table_name: the outbox table.
        clock: seconds since the epoch; by default the database's own time.
        poison_blocks_aggregate: a dead message keeps the later messages of its aggregate back
            until it is replayed or discarded (order kept); False lets them through.
        synchronous_commit: Postgres: wait for the WAL flush of claims, settles and lease renewals.
            False (the default) commits them with ``synchronous_commit = off``: a database crash
            may forget the last few of them, which makes a message be delivered again (under the
            same provider key), never lost. Operators' writes always wait.

    Raises:
        ConfigurationError: another database, or a bad table name.
    """

    def __init__(
        self,
        engine: sa.Engine,
        table_name: str = DEFAULT_TABLE,
        *,
        clock: Callable[[], float] | None = None,
        poison_blocks_aggregate: bool = True,
        synchronous_commit: bool = False,
    ) -> None:
        self.table_name = check_table_name(table_name)
        dialect = engine.dialect
        if dialect.name not in ("postgresql", "sqlite"):
            raise ConfigurationError(f"the outbox serves SQLite and Postgres, not {dialect.name}")
        self.engine = engine
        self.postgres = dialect.name == "postgresql"
        self.clock = clock
        self.poison_blocks_aggregate = poison_blocks_aggregate
        self.synchronous_commit = synchronous_commit
        self.quoted = dialect.identifier_preparer.quote(table_name)
        self._driver = SqlDriver(engine, unavailable=_unavailable, error=_error)
        self._sql: dict[str, Statement] = {}
        self._build()

    # -- SQL ---------------------------------------------------------------------------------

    def _build(self) -> None:
        t = self.quoted
        now = f"COALESCE(CAST(:now AS DOUBLE PRECISION), {_PG_NOW})" if self.postgres else ":now"
        blocking = "p.status IN ('pending', 'dead')"  # the aggregate index's predicate
        if not self.poison_blocks_aggregate:
            blocking += " AND p.status <> 'dead'"
        older = (
            f"SELECT 1 FROM {t} AS p WHERE p.aggregatetype = o.aggregatetype "
            f"AND p.aggregateid = o.aggregateid AND p.id < o.id AND {blocking}"
        )
        claimable = "o.status = 'pending' AND o.available_at <= "
        sql: dict[str, str] = {}
        if self.postgres:
            sql["claim"] = f"""
            WITH c AS (SELECT {now} AS now),
            cand AS (SELECT o.id FROM {t} AS o
                     WHERE {claimable}(SELECT c.now FROM c) AND NOT EXISTS ({older})
                     ORDER BY o.id LIMIT :limit FOR UPDATE OF o SKIP LOCKED)
            UPDATE {t} AS m SET attempts = m.attempts + 1, worker_id = :worker,
                lease_until = c.now + :lease, available_at = c.now + :lease, updated_at = c.now
            FROM c WHERE m.id = ANY(ARRAY(SELECT id FROM cand))
            RETURNING CAST(m.id AS text), {", ".join("m." + col for col in _RETURNED.split(", ")[1:])}"""
            # The batch travels as one JSON text (cheaper to build than six arrays); the ids are
            # also given as an array, so the rows are found through the primary key.
            batch = (
                "jsonb_to_recordset(CAST(:batch AS jsonb)) "
                "AS s(id uuid, s text, r integer, d double precision, e text)"
            )
            sql["settle"] = f"""
            WITH c AS (SELECT {now} AS now), s AS (SELECT * FROM {batch})
            UPDATE {t} AS m SET status = s.s, attempts = m.attempts - COALESCE(s.r, 0),
                available_at = CASE WHEN s.s = 'pending' THEN c.now + COALESCE(s.d, 0)
                                    ELSE m.available_at END,
                lease_until = NULL,
                worker_id = CASE WHEN s.s = 'pending' THEN NULL ELSE m.worker_id END,
                last_error = COALESCE(s.e, m.last_error),
                delivered_at = CASE WHEN s.s = 'pending' THEN NULL ELSE c.now END,
                updated_at = c.now
            FROM s, c
            WHERE m.id = ANY(ARRAY(SELECT s.id FROM s)) AND m.id = s.id
              AND m.worker_id = :worker AND m.status = 'pending'
            RETURNING CAST(m.id AS text)"""
            # Delivered messages, the common case: the ids as one array literal (cheap to build),
            # found through the primary key, no join.
            ours = "m.id = ANY(CAST(:ids AS uuid[])) AND m.worker_id = :worker AND m.status = 'pending'"
            sql["ack"] = f"""
            WITH c AS (SELECT {now} AS now)
            UPDATE {t} AS m SET status = 'delivered', lease_until = NULL, delivered_at = c.now,
                updated_at = c.now
            FROM c WHERE {ours}
            RETURNING CAST(m.id AS text)"""
            sql["extend"] = f"""
            WITH c AS (SELECT {now} AS now)
            UPDATE {t} AS m SET lease_until = c.now + :lease, available_at = c.now + :lease,
                updated_at = c.now
            FROM c WHERE {ours}
            RETURNING CAST(m.id AS text)"""
        else:
            # Serialised by BEGIN IMMEDIATE: a row is claimable when every older live row of its
            # aggregate is claimable too; ORDER BY id LIMIT n then takes a prefix of each aggregate.
            sql["claim"] = f"""
            UPDATE {t} SET attempts = attempts + 1, worker_id = :worker,
                lease_until = :now + :lease, available_at = :now + :lease, updated_at = :now
            WHERE id IN (SELECT o.id FROM {t} AS o
                         WHERE {claimable}:now AND NOT EXISTS ({older}
                             AND NOT (p.status = 'pending' AND p.available_at <= :now))
                         ORDER BY o.id LIMIT :limit)
            RETURNING {_RETURNED}"""
            fence = "id = :id AND worker_id = :worker AND status = 'pending'"
            sql["settle"] = f"""
            UPDATE {t} SET status = :status, attempts = attempts - :rel,
                available_at = CASE WHEN :status = 'pending' THEN :now + :delay ELSE available_at END,
                lease_until = NULL,
                worker_id = CASE WHEN :status = 'pending' THEN NULL ELSE worker_id END,
                last_error = COALESCE(:error, last_error),
                delivered_at = CASE WHEN :status = 'pending' THEN NULL ELSE :now END,
                updated_at = :now
            WHERE {fence}"""
            sql["extend"] = (
                f"UPDATE {t} SET lease_until = :now + :lease, available_at = :now + :lease, "
                f"updated_at = :now WHERE {fence}"
            )
        sql["now"] = f"SELECT {_PG_NOW}" if self.postgres else "SELECT :now"
        self._sql = {name: Statement(text, self.engine.dialect) for name, text in sql.items()}

    def id_param(self, message_id: str) -> Any:
        """A message id as the driver binds it.

        Raises:
            ConfigurationError: not a UUID.
        """
        try:
            value = uuid.UUID(str(message_id))
        except ValueError as exc:
            raise ConfigurationError(f"not a message id (a UUID): {message_id!r}") from exc
        return value if self.postgres else value.hex

    # -- plumbing ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def translated(self) -> Iterator[None]:
        """Re-raise driver errors as :class:`StoreUnavailable` (transient) or :class:`StoreError`."""
        with self._driver.translated():
            yield

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sa.Connection]:
        """A SQLAlchemy Core connection in one transaction (operators' calls), errors made ours."""
        with self._driver.lock, self._driver.translated(), self.engine.begin() as conn:
            yield conn

    def cursor(self, *, write: bool = False, relaxed: bool = False) -> contextlib.AbstractContextManager[Any]:
        """A DBAPI cursor on a pooled connection: autocommit statements on Postgres, one
        transaction (``BEGIN IMMEDIATE`` when ``write``) on SQLite. ``relaxed`` (Postgres, unless
        ``synchronous_commit``): one transaction with ``SET LOCAL synchronous_commit = off``."""
        return self._driver.block(immediate=write, relaxed=relaxed and not self.synchronous_commit)

    def now_param(self) -> float | None:
        """The ``:now`` to bind: the injected clock, the machine's (SQLite), or None (Postgres's)."""
        if self.clock is not None:
            return float(self.clock())
        return None if self.postgres else time.time()

    def run(self, cursor: Any, name_or_statement: str | Statement, params: dict[str, Any]) -> list[Any]:
        """Execute with ``:now`` bound, and fetch every row (SQLite completes RETURNING only then)."""
        statement = self._sql[name_or_statement] if isinstance(name_or_statement, str) else name_or_statement
        params.setdefault("now", self.now_param())
        self._driver.execute(cursor, statement, params)
        return list(cursor.fetchall()) if cursor.description is not None else []

    def now(self) -> float:
        """The outbox's clock: the injected one, or the database's."""
        if self.clock is not None:
            return float(self.clock())
        with self.cursor() as cursor:
            return float(self.run(cursor, "now", {})[0][0])

    # -- the relay's primitives ----------------------------------------------------------------

    def claim(self, worker: str, limit: int, lease: float) -> list[Claimed]:
        """Claim up to ``limit`` claimable messages for ``lease`` seconds, in id order, under a
        fresh claim token made from ``worker``. Each claim counts an attempt. Expired claims of
        other relays are taken over."""
        token = f"{worker}/{os.urandom(3).hex()}"
        params = {"worker": token, "limit": int(limit), "lease": float(lease)}
        with self.cursor(write=True, relaxed=True) as cursor:
            rows = self.run(cursor, "claim", params)
        # Postgres returns the id as text (cheaper to load and hash than a UUID object); SQLite
        # stores it as 32 hex digits.
        text = (lambda ref: ref) if self.postgres else _uuid_text
        claimed = [
            Claimed(
                row[0],
                text(row[0]),
                token,
                row[1],
                row[2],
                row[3],
                row[4],
                row[5],
                row[6],
                row[7],
                row[8],
                int(row[9]),
                int(row[10]),
                float(row[11]),
            )
            for row in rows
        ]
        claimed.sort(key=lambda c: c.id)  # RETURNING order is not promised
        return claimed

    def settle(self, token: str, outcomes: Sequence[Settle]) -> list[Any]:
        """Write the outcomes of a batch claimed under ``token``; returns the refs whose claim
        was lost (taken over by another relay)."""
        if not outcomes:
            return []
        with self.cursor(write=True, relaxed=True) as cursor:
            if self.postgres:
                acks = [o.ref for o in outcomes if o.status == MessageStatus.DELIVERED]
                rest = [o for o in outcomes if o.status != MessageStatus.DELIVERED]
                done: set[Any] = set()
                if acks:
                    params: dict[str, Any] = {"worker": token, "ids": "{" + ",".join(acks) + "}"}
                    done.update(row[0] for row in self.run(cursor, "ack", params))
                if rest:
                    batch = json.dumps([_settle_json(o) for o in rest])
                    rows = self.run(cursor, "settle", {"worker": token, "batch": batch})
                    done.update(row[0] for row in rows)
                return [o.ref for o in outcomes if o.ref not in done]
            lost: list[Any] = []
            now = self.now_param()
            for o in outcomes:
                params = {
                    "worker": token, "id": o.ref, "status": o.status, "rel": 1 if o.release else 0,
                    "delay": float(o.delay), "error": o.error, "now": now,
                }  # fmt: skip
                self.run(cursor, "settle", params)
                if cursor.rowcount != 1:
                    lost.append(o.ref)
            return lost

    def extend(self, token: str, claims: Sequence[Claimed], lease: float) -> list[Any]:
        """Renew the lease of claims still held under ``token``; returns the refs it lost."""
        if not claims:
            return []
        with self.cursor(write=True, relaxed=True) as cursor:
            if self.postgres:
                ids = "{" + ",".join(str(c.ref) for c in claims) + "}"
                params = {"worker": token, "lease": float(lease), "ids": ids}
                done = {row[0] for row in self.run(cursor, "extend", params)}
                return [c.ref for c in claims if c.ref not in done]
            lost: list[Any] = []
            now = self.now_param()
            for c in claims:
                params = {"worker": token, "id": c.ref, "lease": lease, "now": now}
                self.run(cursor, "extend", params)
                if cursor.rowcount != 1:
                    lost.append(c.ref)
            return lost

    def __repr__(self) -> str:
        url = self.engine.url.render_as_string(hide_password=True)
        return f"OutboxDb({url!r}, table={self.table_name!r})"


STATUSES = (
    MessageStatus.PENDING,
    MessageStatus.IN_FLIGHT,
    MessageStatus.DELIVERED,
    MessageStatus.DEAD,
    MessageStatus.DISCARDED,
)
