"""Operator controls: status, dead letters, replay, discard, purge.

::

    control = OutboxControl(engine)
    control.status()              # OutboxStatus(pending=.., in_flight=.., dead=.., oldest_pending_age=..)
    control.dead_letters()        # [DeadLetter(id, type, attempts, last_error, ...)]
    control.blocked_messages()    # [BlockedMessage(id, type, aggregate, blocked_by)]: behind a dead letter
    control.replay(message_id)    # dead -> pending, attempts from 0
    control.replay_all()
    control.discard(message_id)   # dead -> discarded (purged with delivered messages)
    control.cancel(message_id)    # pending, no relay holds it -> discarded (never delivered)
    control.purge(retention=7 * 86400)

Replaying a message a relay still holds, or discarding one that is not dead, is refused: only dead
letters are the operator's to move. Replay wakes listening relays (Postgres NOTIFY). Cancelling
withdraws a message before any relay has claimed it (its producer changed its mind, e.g. a saga
compensating before its email went out); one a relay holds may be on its way and is left alone.
Each call is one transaction through SQLAlchemy Core.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.outbox.claims import OutboxDb, _uuid_text
from sagaguard.idempotency.outbox.errors import MessageNotFound, NotDead
from sagaguard.idempotency.outbox.model import DEFAULT_TABLE, uuid7_floor
from sagaguard.idempotency.outbox.records import BlockedAggregate, BlockedMessage, DeadLetter, OutboxStatus

__all__ = ["DEFAULT_RETENTION", "MessageInfo", "OutboxControl"]

DEFAULT_RETENTION = 7 * 86_400.0
"""Seconds a delivered (or discarded) message is kept before purge deletes it."""

MessageInfo = dict[str, Any]
"""One message row as plain values (``sagaguard outbox show``)."""

_DEAD_COLUMNS = (
    "id, type, aggregatetype, aggregateid, attempts, max_attempts, last_error, created_at, delivered_at"
)
_ALL_COLUMNS = (
    "id, aggregatetype, aggregateid, type, payload, headers, traceparent, tracestate, provider_key, "
    "dedup_key, status, attempts, max_attempts, available_at, lease_until, worker_id, last_error, "
    "created_at, updated_at, delivered_at"
)


_BLOCKED_SHOWN = 20
"""Aggregates :meth:`OutboxControl.status` names with their blocked messages, most first."""


class OutboxControl:
    """What an operator can see and do to one outbox table.

    Args:
        engine: the database holding the outbox (or an :class:`OutboxDb` on it).
        table_name: the outbox table.
        clock: seconds since the epoch; by default the database's own time.
    """

    def __init__(
        self,
        engine: sa.Engine | OutboxDb,
        table_name: str = DEFAULT_TABLE,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.db = engine if isinstance(engine, OutboxDb) else OutboxDb(engine, table_name, clock=clock)
        t = self.db.quoted
        skip = " FOR UPDATE SKIP LOCKED" if self.db.postgres else ""
        settled = "status IN ('delivered', 'discarded') AND delivered_at <= :cutoff"
        blocked = (
            f"EXISTS (SELECT 1 FROM {t} AS d WHERE d.status = 'dead' AND d.aggregatetype = p.aggregatetype "
            "AND d.aggregateid = p.aggregateid AND d.id < p.id)"
            if self.db.poison_blocks_aggregate
            else "(1 = 0)"
        )
        text = {
            # A pending message is blocked when a dead letter of its aggregate is older than it
            # (and dead letters block their aggregate): no relay delivers it until an operator acts.
            "counts": f"SELECT count(*) FILTER (WHERE worker_id IS NULL AND NOT blocked), "
            f"count(*) FILTER (WHERE worker_id IS NOT NULL), min(created_at) FILTER (WHERE NOT blocked), "
            f"(SELECT count(*) FROM {t} WHERE status = 'dead'), count(*) FILTER (WHERE blocked) "
            f"FROM (SELECT p.worker_id, p.created_at, {blocked} AS blocked FROM {t} AS p "
            "WHERE p.status = 'pending') AS q",
            "blocked": f"SELECT p.aggregatetype, p.aggregateid, count(*) FROM {t} AS p "
            f"WHERE p.status = 'pending' AND p.worker_id IS NULL AND {blocked} "
            "GROUP BY p.aggregatetype, p.aggregateid ORDER BY count(*) DESC, 1, 2 LIMIT :limit",
            # The oldest older dead letter by ORDER BY ... LIMIT 1: Postgres has no min() of a uuid.
            "blocked_messages": f"SELECT p.id, p.type, p.aggregatetype, p.aggregateid, p.created_at, "
            f"(SELECT d.id FROM {t} AS d WHERE d.status = 'dead' AND d.aggregatetype = p.aggregatetype "
            "AND d.aggregateid = p.aggregateid AND d.id < p.id ORDER BY d.id LIMIT 1) "
            f"FROM {t} AS p WHERE p.status = 'pending' AND p.worker_id IS NULL AND p.id > :after "
            f"AND {blocked} ORDER BY p.id LIMIT :limit",
            "dead": f"SELECT {_DEAD_COLUMNS} FROM {t} WHERE status = 'dead' AND id > :after "
            "ORDER BY id LIMIT :limit",
            "dead_first": f"SELECT {_DEAD_COLUMNS} FROM {t} WHERE status = 'dead' ORDER BY id LIMIT :limit",
            "get": f"SELECT {_ALL_COLUMNS} FROM {t} WHERE id = :id",
            "status_of": f"SELECT status FROM {t} WHERE id = :id",
            "replay": f"UPDATE {t} SET status = 'pending', attempts = 0, available_at = :nowv, "
            "lease_until = NULL, worker_id = NULL, delivered_at = NULL, updated_at = :nowv "
            "WHERE id = :id AND status = 'dead'",
            "replay_all": f"UPDATE {t} SET status = 'pending', attempts = 0, available_at = :nowv, "
            "lease_until = NULL, worker_id = NULL, delivered_at = NULL, updated_at = :nowv "
            "WHERE status = 'dead'",
            "discard": f"UPDATE {t} SET status = 'discarded', delivered_at = :nowv, updated_at = :nowv "
            "WHERE id = :id AND status = 'dead'",
            # Unclaimed only: a claim sets worker_id in the same row, so the two are serialised by
            # the row (Postgres) or the write lock (SQLite) and exactly one of them wins.
            "cancel": f"UPDATE {t} SET status = 'discarded', delivered_at = :nowv, updated_at = :nowv, "
            "last_error = COALESCE(last_error, 'cancelled before delivery') "
            "WHERE id = :id AND status = 'pending' AND worker_id IS NULL",
            # Walks the primary key (creation order) up to the cutoff's id: a message delivered
            # before the cutoff was created before it. Postgres: a CTE, so the page is chosen
            # once (an IN (subquery) may be rescanned per row); SQLite runs the subquery once,
            # and reports a rowcount only for a plain DELETE.
            "purge": (
                f"WITH doomed AS (SELECT id FROM {t} WHERE id < :bound AND {settled} "
                f"ORDER BY id LIMIT :limit{skip}) "
                f"DELETE FROM {t} WHERE id IN (SELECT id FROM doomed) AND {settled}"
                if self.db.postgres
                else f"DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE id < :bound AND {settled} "
                "ORDER BY id LIMIT :limit)"
            ),
            "now": "SELECT CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)",
            "notify": "SELECT pg_notify(:channel, '')",
        }
        self._sql = {name: sa.text(sql) for name, sql in text.items()}

    def _run(self, conn: sa.Connection, name: str, params: dict[str, Any]) -> Any:
        """Statement ``name``: its result (rows, or the rowcount of a write)."""
        return conn.execute(self._sql[name], params)

    def _now(self, conn: sa.Connection) -> float:
        value = self.db.now_param()
        if value is not None:
            return value
        return float(self._run(conn, "now", {}).scalar_one())

    def _notify(self, conn: sa.Connection) -> None:
        if self.db.postgres:  # wake listening relays
            self._run(conn, "notify", {"channel": self.db.table_name})

    def now(self) -> float:
        """The outbox's clock (injected, or the database's)."""
        with self.db.transaction() as conn:
            return self._now(conn)

    def status(self) -> OutboxStatus:
        """Depth (pending + in flight), dead letters, the oldest pending message's age, and the
        messages blocked behind a dead letter of their aggregate, counted apart (with the
        aggregates holding most of them), so the depth is what relays can still drain.

        Raises:
            StoreUnavailable, StoreError: the database cannot be reached or failed.
        """
        with self.db.transaction() as conn:
            now = self._now(conn)
            pending, in_flight, oldest, dead, blocked = self._run(conn, "counts", {}).one()
            aggregates: tuple[BlockedAggregate, ...] = ()
            if blocked:
                found = self._run(conn, "blocked", {"limit": _BLOCKED_SHOWN})
                aggregates = tuple(BlockedAggregate(str(r[0]), str(r[1]), int(r[2])) for r in found)
        return OutboxStatus(
            pending=int(pending or 0),
            in_flight=int(in_flight or 0),
            dead=int(dead or 0),
            oldest_pending_age=None if oldest is None else max(0.0, now - float(oldest)),
            now=now,
            blocked=int(blocked or 0),
            blocked_aggregates=aggregates,
        )

    def dead_letters(self, *, limit: int = 100, after: str | None = None) -> list[DeadLetter]:
        """Dead letters in id (creation) order, a page at a time: pass the last id as ``after``."""
        with self.db.transaction() as conn:
            if after is None:
                rows: list[Any] = list(self._run(conn, "dead_first", {"limit": max(0, limit)}))
            else:
                params = {"limit": max(0, limit), "after": self.db.id_param(after)}
                rows = list(self._run(conn, "dead", params))
        return [
            DeadLetter(
                _uuid_text(r[0]),
                r[1],
                r[2],
                r[3],
                int(r[4]),
                int(r[5]),
                r[6],
                float(r[7]),
                None if r[8] is None else float(r[8]),
            )
            for r in rows
        ]

    def blocked_messages(self, *, limit: int = 100, after: str | None = None) -> list[BlockedMessage]:
        """Pending messages blocked behind a dead letter of their aggregate (its later messages), in
        id (creation) order, a page at a time: pass the last id as ``after``. None while dead
        letters do not block their aggregate.

        Raises:
            ConfigurationError: ``after`` is not a message id.
        """
        start = self.db.id_param(after if after is not None else "00000000-0000-0000-0000-000000000000")
        with self.db.transaction() as conn:
            rows = list(self._run(conn, "blocked_messages", {"limit": max(0, limit), "after": start}))
        return [
            BlockedMessage(_uuid_text(r[0]), r[1], r[2], r[3], float(r[4]), _uuid_text(r[5])) for r in rows
        ]

    def get(self, message_id: str) -> MessageInfo:
        """One message, every column.

        Raises:
            MessageNotFound: no message has this id.
            ConfigurationError: the id is not a UUID.
        """
        with self.db.transaction() as conn:
            rows: list[Any] = list(self._run(conn, "get", {"id": self.db.id_param(message_id)}))
        if not rows:
            raise MessageNotFound(message_id)
        info = dict(zip(_ALL_COLUMNS.split(", "), rows[0], strict=True))
        info["id"] = _uuid_text(info["id"])
        return info

    def _dead_only(self, name: str, message_id: str) -> None:
        ident = self.db.id_param(message_id)
        with self.db.transaction() as conn:
            now = self._now(conn)
            if self._run(conn, name, {"id": ident, "nowv": now}).rowcount == 1:
                if name == "replay":
                    self._notify(conn)
                return
            found: list[Any] = list(self._run(conn, "status_of", {"id": ident}))
        if not found:
            raise MessageNotFound(message_id)
        raise NotDead(message_id, str(found[0][0]))

    def replay(self, message_id: str) -> None:
        """Give a dead letter back to the relays, with its attempts counted from zero.

        Raises:
            MessageNotFound: no message has this id.
            NotDead: the message is not dead (pending, in flight, delivered or discarded).
        """
        self._dead_only("replay", message_id)

    def replay_all(self) -> int:
        """Replay every dead letter; returns how many."""
        with self.db.transaction() as conn:
            now = self._now(conn)
            count = int(self._run(conn, "replay_all", {"nowv": now}).rowcount)
            if count:
                self._notify(conn)
            return count

    def discard(self, message_id: str) -> None:
        """Give up on a dead letter for good: it is marked discarded (no longer blocks its aggregate)
        and purged with delivered messages after the retention.

        Raises:
            MessageNotFound: no message has this id.
            NotDead: the message is not dead.
        """
        self._dead_only("discard", message_id)

    def cancel(self, message_id: str) -> bool:
        """Withdraw a message that no relay has claimed: pending and unclaimed -> discarded, so it
        is never delivered (and purged with delivered messages after the retention).

        Atomic against the relays' claims: either this cancels the message and no relay ever
        claims it, or a relay claimed it first and this changes nothing.

        Returns:
            True if this call withdrew it; False if it was not pending and unclaimed: a relay holds
            it (it may be being delivered right now), or it is delivered, dead or discarded.

        Raises:
            MessageNotFound: no message has this id.
            ConfigurationError: the id is not a UUID.
        """
        ident = self.db.id_param(message_id)
        with self.db.transaction() as conn:
            now = self._now(conn)
            if self._run(conn, "cancel", {"id": ident, "nowv": now}).rowcount == 1:
                return True
            found: list[Any] = list(self._run(conn, "status_of", {"id": ident}))
        if not found:
            raise MessageNotFound(message_id)
        return False

    def purge(
        self, retention: float = DEFAULT_RETENTION, *, page: int = 1000, max_pages: int | None = None
    ) -> int:
        """Delete delivered and discarded messages settled more than ``retention`` seconds ago, one
        page (one short transaction) at a time, oldest first. Pending, in-flight and dead ones are
        never deleted.

        Returns:
            How many rows were deleted.

        Raises:
            ConfigurationError: a negative, NaN or infinite retention, or a page size below 1.
        """
        if not math.isfinite(retention) or retention < 0 or page < 1:
            raise ConfigurationError(
                f"purge needs a finite retention >= 0 and page >= 1, got {retention!r}, {page!r}"
            )
        total = pages = 0
        while max_pages is None or pages < max_pages:
            with self.db.transaction() as conn:
                cutoff = self._now(conn) - float(retention)
                bound = uuid7_floor(cutoff + 0.001)  # every id of the cutoff's millisecond too
                params = {"cutoff": cutoff, "limit": page, "bound": bound if self.db.postgres else bound.hex}
                deleted = int(self._run(conn, "purge", params).rowcount)
            total += deleted
            pages += 1
            if deleted < page:
                break
        return total
