"""The few hot SQL statements, run through the driver's own public API on pooled connections.

The SQL backends (the effects store, the saga journal, the outbox relay) each make one or two
statements on every call: the claim and the record, the saga phase, the outbox claim and ack. Those
are SQL text with ``:name`` parameters, written out and documented where they are defined, and run
here, without SQLAlchemy's ``Connection`` between (its Python costs about what a commit costs a fast
disk): on Postgres through psycopg's libpq interface, ``psycopg.pq``
(:class:`~sagaguard.idempotency.backends.sql_pq.PqCursor`: ``$1`` parameters, each statement prepared once per
connection outside a transaction; ``prepare_threshold=None`` on the engine's connections, as behind
an old PgBouncer, turns that off), one cursor per connection kept in the pool's ``info`` for it; on
SQLite through sqlite3, which takes ``:name`` parameters itself and caches the compiled statement. Everything
else (listing, purging, operator actions, the schema) goes through SQLAlchemy Core.

Connections come from the engine's SQLAlchemy pool (``Engine.raw_connection()``), one per block, and
go back to it when the block ends; the pool's own reset-on-return rolls back what a failed block
left open. A driver made with ``keep`` (the effects store's and the saga journal's on an engine of
their own) instead lets each thread keep the connection its block used, checked out, for its next
blocks, as many threads as the pool keeps connections (``QueuePool.size()``; the others take one
per block from the overflow), by :class:`~sagaguard.idempotency.backends.kept.KeptConnections`: a checkout and
the reset (on Postgres also the switch into autocommit and back) are most of the driver's own client
CPU per block (docs/benchmarks.md, "The fast paths, decided at 4 processes"). Between blocks a kept
connection holds no transaction (every
block ends in a commit or a rollback), so it holds no lock, on SQLite neither the write lock nor a
read snapshot. Postgres connections run the block in autocommit (set on checkout, restored before
they go back; a kept one stays in it), so a block of one statement is one round trip and one
commit; a block asks for a transaction explicitly. A connection that may be broken is invalidated
(``PoolProxiedConnection.invalidate``); after a disconnect the whole pool is disposed, as the
server's other sessions are as dead, and every kept connection is thrown away before its next use
(so a killed server costs one call, not one per pooled or kept connection). In a forked child,
every engine served here gets a new pool (``Engine.dispose(close=False)``, as SQLAlchemy advises)
and the kept connections are forgotten, not closed, so the child never talks on its parent's
sockets.

Transactions, per block: on SQLite (``isolation_level=None``, set by
:func:`~sagaguard.idempotency.backends.sql_engine.make_engine`) each statement is its own transaction unless
the block takes the write lock up front (``immediate``: ``BEGIN IMMEDIATE``; a reader that later writes
can fail at once with "database is locked", whatever the busy timeout); on Postgres each statement
is its own transaction unless the block asks for one (``transaction``), or for one whose commit does
not wait for the WAL flush (``relaxed``: ``SET LOCAL synchronous_commit = off``). A transaction still
open when the block ends (one a statement of the block began) is committed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql
from sqlalchemy.pool import QueuePool, StaticPool

from sagaguard.idempotency.backends.kept import KeptConnections

__all__ = ["SqlDriver", "Statement"]

_served: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
_served_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # The parent's pooled connections are not ours to use, nor to close (closing one would end the
    # parent's session on the shared socket): a new, empty pool for each engine. (The connections
    # threads kept are forgotten by sagaguard.idempotency.backends.kept's own hook.)
    for engine in list(_served):
        with contextlib.suppress(Exception):
            engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_NUMBERED = postgresql.psycopg.dialect(paramstyle="numeric_dollar")  # type: ignore[no-untyped-call]
"""Renders ``:name`` parameters as ``$1``, ``$2``, ... for libpq."""
_CURSOR = "sagaguard.cursor"
"""The key of a connection's kept cursor in the pool's ``info`` for it."""


class Statement:
    """One SQL statement with ``:name`` parameters, in the form the engine's driver takes.

    Args:
        text: the statement; every value a bound ``:name`` parameter.
        dialect: the engine's dialect: sqlite3 takes the text as it is; for Postgres, SQLAlchemy
            renders it once with ``$n`` parameters (:attr:`order` says which name is which).
    """

    __slots__ = ("numbered", "order", "sql", "text")

    def __init__(self, text: str, dialect: sa.Dialect) -> None:
        self.text = text
        self.sql: str = text
        self.order: tuple[str, ...] = ()
        """Postgres: the parameters' names, in ``$n`` order."""
        self.numbered = dialect.name != "sqlite"
        if self.numbered:
            compiled: Any = sa.text(text).compile(dialect=_NUMBERED)
            self.sql, self.order = compiled.string, tuple(compiled.positiontup or ())

    def values(self, params: Mapping[str, Any]) -> Any:
        """The parameters as the driver binds them: by name (sqlite3), or in ``$n`` order."""
        if self.numbered:
            return [params[name] for name in self.order]
        return params


class SqlDriver:
    """Blocks of hot statements on connections of ``engine``'s pool, the driver's errors made ours.

    Args:
        engine: an engine on SQLite (from :func:`~sagaguard.idempotency.backends.sql_engine.make_engine`) or
            Postgres through psycopg 3.
        unavailable: builds the error for a transient failure (the server gone, the pool empty,
            SQLite's "database is locked") from the driver's message.
        error: builds the error for any other failure of the driver.
        keep: with a ``QueuePool`` (not SQLite in memory), let each thread keep its connection
            checked out between blocks (see the module); whoever makes the driver then calls
            :meth:`close`.

    Thread-safe: each block has a connection of its own; on a one-connection pool (``sqlite://``,
    in memory) a re-entrant lock keeps two threads' blocks from interleaving (:attr:`lock`).
    """

    def __init__(
        self,
        engine: sa.Engine,
        *,
        unavailable: Callable[[str], Exception],
        error: Callable[[str], Exception],
        keep: bool = False,
    ) -> None:
        self.engine = engine
        self.postgres = engine.dialect.name == "postgresql"
        self._kept: KeptConnections[Any] | None = None
        """The connections threads keep between blocks (``keep``), as SQLAlchemy pool checkouts."""
        if keep and isinstance(engine.pool, QueuePool):
            pool = engine.pool
            self._kept = KeptConnections(pool.size, self._give_back)
        self.lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if isinstance(engine.pool, StaticPool) else contextlib.nullcontext()
        )
        """Held around every block; re-entrant on a one-connection pool, else a no-op."""
        self._unavailable = unavailable
        self._error = error
        dbapi = engine.dialect.loaded_dbapi
        self.driver_error: type[Exception] = dbapi.Error
        """The root of the driver's own errors (PEP 249 ``Error``)."""
        # PEP 249 names the transient ones: the server went away, SQLite "database is locked".
        self._transient: tuple[type[BaseException], ...] = (
            dbapi.OperationalError,
            dbapi.InterfaceError,
            sa_exc.OperationalError,  # e.g. connecting failed (SQLAlchemy wraps that)
            sa_exc.InterfaceError,
            sa_exc.DisconnectionError,
            sa_exc.TimeoutError,  # the pool had no connection to give in time
            OSError,
        )
        with _served_lock:
            _served.add(engine)

    def translate(self, exc: BaseException) -> Exception:
        """Our error for a driver's or SQLAlchemy's, with the driver's message (never SQLAlchemy's,
        which may quote parameters); the caller raises it ``from exc``."""
        orig = getattr(exc, "orig", None) or exc
        text = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        if isinstance(exc, self._transient) or getattr(exc, "connection_invalidated", False):
            return self._unavailable(text)
        return self._error(text)

    def ours(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the driver's or SQLAlchemy's (see :meth:`translate`)."""
        return isinstance(exc, (self.driver_error, sa_exc.SQLAlchemyError, OSError))

    @contextlib.contextmanager
    def translated(self) -> Iterator[None]:
        """Re-raise the driver's and SQLAlchemy's errors as ours (for Core blocks)."""
        try:
            yield
        except (sa_exc.SQLAlchemyError, self.driver_error, OSError) as exc:
            raise self.translate(exc) from exc

    @contextlib.contextmanager
    def block(
        self, *, immediate: bool = False, transaction: bool = False, relaxed: bool = False
    ) -> Iterator[Any]:
        """A DBAPI cursor on a pooled connection for the statements of one block.

        Args:
            immediate: SQLite: begin with ``BEGIN IMMEDIATE`` (a write of several statements).
            transaction: Postgres: the block's statements are one transaction.
            relaxed: Postgres: one transaction whose commit does not wait for the WAL flush.

        Raises:
            the ``unavailable`` or ``error`` given, chained to the driver's error.
        """
        with self.lock:
            kept = self._kept.take() if self._kept is not None else None
            if kept is not None and not kept.conn.is_valid:  # invalidated since (a failed block)
                self._kept.discard(kept)  # type: ignore[union-attr]  # kept implies _kept
                kept = None
            if kept is not None:
                fairy = kept.conn
            else:
                try:
                    fairy = self.engine.raw_connection()
                except (sa_exc.SQLAlchemyError, self.driver_error, OSError) as exc:
                    raise self.translate(exc) from exc
            conn = fairy.driver_connection
            cursor = None
            try:
                if self.postgres:
                    if kept is None:  # a kept connection stays in autocommit
                        conn.autocommit = True
                    cursor = fairy.info.get(_CURSOR)
                    if cursor is None or cursor.connection is not conn or cursor.closed:
                        cursor = fairy.info[_CURSOR] = raw_cursor(conn)
                    if relaxed:
                        cursor.execute("BEGIN")
                        cursor.execute("SET LOCAL synchronous_commit = off")
                    elif transaction:
                        cursor.execute("BEGIN")
                else:
                    cursor = conn.cursor()
                    if immediate:
                        cursor.execute("BEGIN IMMEDIATE")
                yield cursor
                conn.commit()  # a no-op unless a transaction is open
            except BaseException as exc:
                self._failed(fairy, conn, cursor, exc)
                if self.ours(exc):
                    raise self.translate(exc) from exc
                raise
            finally:
                if kept is not None:
                    if fairy.is_valid:
                        self._kept.done(kept)  # type: ignore[union-attr]
                    else:
                        self._kept.discard(kept)  # type: ignore[union-attr]
                elif self._kept is None or not fairy.is_valid or not self._kept.keep(fairy):
                    self._release(fairy, conn)

    def close(self) -> None:
        """Give back every kept connection (call when no block runs). The driver stays usable."""
        if self._kept is not None:
            self._kept.close()

    def _give_back(self, fairy: Any, broken: bool) -> None:
        """A kept connection back to the pool (thrown away when it may be ``broken``)."""
        if broken and fairy.is_valid:
            with contextlib.suppress(Exception):
                fairy.invalidate()
        self._release(fairy, fairy.driver_connection)

    def _failed(self, fairy: Any, conn: Any, cursor: Any, exc: BaseException) -> None:
        """After a block that raised ``exc``: roll back, or throw the connection away when it may
        be broken (a disconnect, or an interruption such as a cancellation or ``KeyboardInterrupt``
        that may have left a reply unread); after a disconnect, every pooled connection too."""
        disconnect = isinstance(exc, self.driver_error) and self.engine.dialect.is_disconnect(
            exc,  # type: ignore[arg-type]  # the driver's own error, as the dialect expects
            conn,
            cursor,
        )
        if not disconnect and isinstance(exc, Exception):
            try:
                conn.rollback()
                return
            except Exception as failed:
                exc = failed
        with contextlib.suppress(Exception):
            fairy.invalidate(exc)
        if disconnect:  # the server went away: its other sessions are as dead
            if self._kept is not None:
                self._kept.expire()
            with contextlib.suppress(Exception):
                self.engine.dispose()

    def _release(self, fairy: Any, conn: Any) -> None:
        if self.postgres and fairy.is_valid:
            with contextlib.suppress(Exception):
                conn.autocommit = False  # back as the pool gave it
        with contextlib.suppress(Exception):
            fairy.close()

    def run(self, cursor: Any, statement: Statement, params: Mapping[str, Any]) -> list[Any]:
        """Execute a statement that returns rows (a ``SELECT``, a ``RETURNING``) and fetch them all
        (SQLite completes a ``RETURNING`` statement only then)."""
        self.execute(cursor, statement, params)
        return list(cursor.fetchall())

    def execute(self, cursor: Any, statement: Statement, params: Mapping[str, Any]) -> int:
        """Execute a statement; the rows it changed."""
        if self.postgres:
            cursor.execute(statement.sql, statement.values(params), prepare=True)
        else:
            cursor.execute(statement.sql, params)
        return int(cursor.rowcount)


def raw_cursor(conn: Any) -> Any:
    """The hot path's cursor on ``conn``, a :class:`~sagaguard.idempotency.backends.sql_pq.PqCursor` (a name
    of its own, so a test or a bench can count what the hot path sends by replacing it)."""
    from sagaguard.idempotency.backends.sql_pq import PqCursor

    return PqCursor(conn)
