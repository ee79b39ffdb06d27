"""The SQL journal's hot path: precompiled SQL run on the driver's own cursor.

A statement through SQLAlchemy's ``Connection`` costs more Python than a commit costs the disk, and
a saga step is about one commit; so the calls a running saga makes on every step (the atomic phase,
the start) hand SQL compiled once for the driver's paramstyle straight to a DBAPI cursor on one of
the engine's pooled connections, kept checked out between calls (:mod:`idempotency.stores.shelf`).
Everything else (operator calls, parking, signals, listing) keeps SQLAlchemy: it is rare, and
clearer there.

Transactions: on SQLite a block is one ``BEGIN IMMEDIATE`` (a write) or ``BEGIN`` (a read)
transaction, committed at its end; on Postgres the connection is in autocommit, so a block made of
one statement is one round trip and one transaction, and a block of several asks for ``BEGIN``
explicitly (``atomic=True``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from operator import itemgetter
from typing import Any, NoReturn, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql.compiler import SQLCompiler

from idempotency.stores.shelf import Held, Shelf
from saga.errors import JournalError, JournalUnavailable

__all__ = ["Compiled", "Driver"]

T = TypeVar("T")


class Compiled:
    """One statement compiled for a dialect's driver (its paramstyle), to run on a raw cursor."""

    __slots__ = ("_pick", "order", "sql")

    def __init__(self, text: str, dialect: sa.Dialect) -> None:
        compiled = sa.text(text).compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)
        self.sql: str = compiled.string
        order = compiled.positiontup  # set for positional (qmark) drivers such as sqlite3
        self.order: tuple[str, ...] | None = tuple(order) if order else None
        """The parameter names in the order a positional driver binds them; None: by name."""
        # itemgetter picks the values in C; with one name it returns the value, not a tuple.
        self._pick: Callable[[Mapping[str, Any]], Any] | None = None
        if order:
            getter = itemgetter(*order)
            self._pick = getter if len(order) > 1 else (lambda params: (getter(params),))

    def args(self, params: Mapping[str, Any]) -> Any:
        """The values in the form the driver wants: by name, or in order."""
        return params if self._pick is None else self._pick(params)


class Driver:
    """DBAPI cursors on connections of an engine's pool kept checked out between blocks
    (:class:`~idempotency.stores.shelf.Shelf`), with the driver's errors made ours.

    Args:
        engine: from :func:`idempotency.stores.sql.make_engine` (SQLite with ``isolation_level``
            None, so the transactions here are the ones it emits).
        lock: held around every block (a re-entrant lock for a one-connection pool, where two
            threads' transactions must not interleave).
    """

    def __init__(self, engine: sa.Engine, lock: contextlib.AbstractContextManager[Any]) -> None:
        self._engine = engine
        self._lock = lock
        self._shelf = Shelf(engine)
        self.postgres = self._shelf.postgres
        dbapi = engine.dialect.loaded_dbapi
        self._error: type[Exception] = dbapi.Error
        # PEP 249 names the transient ones: the server went away, SQLite "database is locked".
        self._transient: tuple[type[Exception], ...] = (
            dbapi.OperationalError,
            dbapi.InterfaceError,
            sa_exc.OperationalError,
            sa_exc.InterfaceError,
            sa_exc.TimeoutError,  # the pool had no connection to give in time
            OSError,
        )

    def _translate(self, exc: BaseException) -> JournalError:
        orig = getattr(exc, "orig", None) or exc
        text = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        if isinstance(exc, self._transient) or getattr(exc, "connection_invalidated", False):
            return JournalUnavailable(f"SQL journal unavailable: {text}")
        return JournalError(f"SQL journal error: {text}")

    @contextlib.contextmanager
    def cursor(self, *, write: bool, atomic: bool = False) -> Iterator[Any]:
        """A cursor whose block is one transaction, committed when the block ends.

        Args:
            write: the block writes (SQLite takes the write lock up front: a reader that later
                writes can fail at once with "database is locked", whatever the busy timeout).
            atomic: Postgres: the block runs several statements that must commit together.

        Raises:
            JournalUnavailable, JournalError: the driver failed (chained as ``__cause__``).
        """
        with self._lock:
            held = self._take()
            began = False
            try:
                began = self._begin(held.cursor, write, atomic)
                yield held.cursor
                if began:
                    held.cursor.execute("COMMIT")
            except BaseException as exc:
                self._fail(held, began, exc)
            self._shelf.give(held)

    def write(self, work: Callable[[Any], T]) -> T:
        """``work(cursor)`` as one write transaction: what ``with self.cursor(write=True) as
        cursor: return work(cursor)`` does, as plain calls (a generator context manager costs a few
        µs, and a saga pays this on every step).

        Raises:
            JournalUnavailable, JournalError: as :meth:`cursor`.
        """
        with self._lock:
            held = self._take()
            began = False
            try:
                began = self._begin(held.cursor, True, False)
                found = work(held.cursor)
                if began:
                    held.cursor.execute("COMMIT")
            except BaseException as exc:
                self._fail(held, began, exc)
            self._shelf.give(held)
            return found

    def _take(self) -> Held:
        try:
            return self._shelf.take()
        except (sa_exc.SQLAlchemyError, self._error, OSError) as exc:
            raise self._translate(exc) from exc

    def _begin(self, cursor: Any, write: bool, atomic: bool) -> bool:
        """Open the block's transaction where one is needed; whether one was."""
        if not self.postgres:
            cursor.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            return True
        if atomic:
            cursor.execute("BEGIN")
            return True
        return False  # Postgres in autocommit: the one statement is its own transaction

    def _fail(self, held: Held, began: bool, exc: BaseException) -> NoReturn:
        """End a failed block: roll back and shelve the connection again, or throw it away when it
        may be broken; then raise ``exc``, translated when it is the driver's."""
        disconnect = isinstance(exc, self._error) and self._engine.dialect.is_disconnect(
            exc,  # type: ignore[arg-type]  # the driver's own error, as the dialect expects
            held.conn,
            None,
        )
        self._shelf.settle(held, exc, disconnect=disconnect, rollback=began)
        if isinstance(exc, (self._error, sa_exc.SQLAlchemyError, OSError)):
            raise self._translate(exc) from exc
        raise exc

    def close(self) -> None:
        """Give the shelved connections back to the engine's pool."""
        self._shelf.close()

    @staticmethod
    def run(cursor: Any, statement: Compiled, params: Mapping[str, Any]) -> list[Any]:
        """Execute a statement that returns rows (a ``SELECT``, a ``RETURNING``) and fetch them all
        (SQLite completes a ``RETURNING`` statement only then)."""
        cursor.execute(statement.sql, statement.args(params))
        # Never ask for cursor.description: psycopg builds a column object per column for it.
        return list(cursor.fetchall())

    @staticmethod
    def execute(cursor: Any, statement: Compiled, params: Mapping[str, Any]) -> None:
        """Execute a statement that returns no rows."""
        cursor.execute(statement.sql, statement.args(params))
