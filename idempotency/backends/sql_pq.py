"""The cursor of the hot statements on Postgres: psycopg's libpq interface, ``psycopg.pq``.

The effects store's claim and record, the saga journal's phase writes and the outbox relay's claim
and settle are a few fixed statements made on every call. psycopg's ``Cursor.execute`` runs each
through its Python layers (query and parameter adaptation, its prepared-statement bookkeeping,
result loading), which cost a fleet more than the libraries-first rule allows: with 4 worker
processes on one Postgres, psycopg's ``execute(..., prepare=True)`` on a connection of the pool per
call, in place of this cursor on a kept one, ran 0.82x the agent sagas per second and 0.75x the
guarded calls (medians of 16 alternated rounds) at about 1.5x the client CPU, the server sent the
same statements (docs/benchmarks.md, "The fast paths, decided at 4 processes"). So the statements go
to libpq through psycopg's documented low-level interface (``Connection.pgconn``, a
``psycopg.pq.PGconn``), on the same connections of SQLAlchemy's pool:

- a statement run with ``prepare=True`` outside a transaction (the effects store's and the saga
  journal's, each its own commit) is prepared once per connection under a name of this module's
  (``sg_<n>``, never one of psycopg's ``_pg3_<n>``) and executed by name, parameters in text
  format. psycopg deallocates every prepared statement of a session after a ``ROLLBACK`` once it
  has prepared some of its own (SQLAlchemy Core's statements, on the same pooled connection);
  the server's "no such statement" then makes this cursor prepare it again and run it, which is
  safe only outside a transaction (the failed statement ran nothing and aborted nothing). So
  inside one (the outbox relay's claim and settle), with ``prepare_threshold=None`` on the
  connection (as behind an old PgBouncer), and for any other statement with parameters, it is
  sent unnamed (``exec_params``) every time;
- a statement without parameters (``BEGIN``, ``SET LOCAL ...``) is a simple query;
- the rows are decoded by column type: booleans, integers, floats and text here, any other type
  by the loader psycopg's own adapters give for it (``AdaptersMap.get_loader``);
- a reply the server sends as an error raises the psycopg exception of its SQLSTATE
  (``psycopg.errors.lookup``), and a connection libpq finds broken raises
  ``psycopg.OperationalError`` (the connection then reports ``closed``, which is what SQLAlchemy's
  dialect checks for a disconnect), so the driver maps them as it maps every other driver error.

libpq's calls release the GIL while they wait for the server, as psycopg's do; unlike psycopg's,
the wait is not interruptible by Ctrl-C (the statement finishes first, the interrupt follows).
Only what the hot path uses of a DBAPI cursor is here: ``execute``, ``fetchall``, ``rowcount``,
``description``, ``connection`` and ``closed``.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import pq

__all__ = ["PqCursor"]

_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK, pq.ExecStatus.EMPTY_QUERY)
_FATAL = pq.ExecStatus.FATAL_ERROR
_IDLE = pq.TransactionStatus.IDLE
_NO_SUCH_STATEMENT = b"26000"  # invalid_sql_statement_name
_TEXT = pq.Format.TEXT
_TEXTS_KEPT = 64
"""Encoded statement texts a cursor keeps (the hot path makes a few fixed ones)."""


_NUMBERS: dict[int, Callable[[bytes], Any]] = {
    16: lambda v: v == b"t",  # bool
    20: int, 21: int, 23: int,  # int8, int2, int4
    700: float, 701: float,  # float4, float8 (Postgres 12+ prints the shortest exact digits)
}  # fmt: skip
_TEXTS = frozenset((19, 25, 705, 1042, 1043))  # name, text, unknown, bpchar, varchar

_names = itertools.count(1)
_prepared: weakref.WeakKeyDictionary[psycopg.Connection[Any], dict[bytes, bytes]] = (
    weakref.WeakKeyDictionary()
)
"""Per connection: the text of each statement prepared on it, and its name there."""
_prepared_lock = threading.Lock()


class PqCursor:
    """A cursor on ``connection`` that runs statements through libpq (see the module).

    Args:
        connection: a psycopg 3 ``Connection`` (one of the pool's).
    """

    __slots__ = (
        "_decoders", "_encoding", "_names", "_result", "_rows", "_shapes", "_sql", "connection",
        "rowcount",
    )  # fmt: skip

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self.connection = connection
        self._encoding = connection.info.encoding
        self._sql: dict[str, bytes] = {}
        """Each statement's text, encoded once."""
        self._names = self._connection_names()
        self._decoders: dict[int, Callable[[bytes], Any]] = {}
        self._shapes: dict[tuple[int, ...], list[tuple[int, Callable[[bytes], Any]]]] = {}
        """Per sequence of column types: each column's index and decoder."""
        self._result: pq.abc.PGresult | None = None
        self._rows: list[tuple[Any, ...]] = []
        self.rowcount = -1

    @property
    def description(self) -> tuple[str, ...] | None:
        """The last result's column names, or None when it has no columns."""
        result = self._result
        if result is None or not result.nfields:
            return None
        return tuple((result.fname(i) or b"").decode(self._encoding) for i in range(result.nfields))

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (or found broken)."""
        return self.connection.closed

    def execute(
        self, query: str, params: Sequence[Any] | None = None, *, prepare: bool | None = None
    ) -> None:
        """Run ``query`` (``$n`` parameters, ``params`` in that order); prepared with ``prepare``.

        Raises:
            psycopg.Error: the server's error, by its SQLSTATE; OperationalError if the connection
                is broken.
        """
        pgconn = self.connection.pgconn
        sql = self._sql.get(query)
        if sql is None:
            if len(self._sql) >= _TEXTS_KEPT:  # not one of a few fixed statements: keep none
                self._sql.clear()
            sql = self._sql[query] = query.encode(self._encoding)
        if params is None and not prepare:
            self._load(pgconn.exec_(sql))
            return
        values: list[bytes | None] = []
        types: list[int] = []
        for value in params or ():
            text, oid = self._dump(value)
            values.append(text)
            types.append(oid)
        if not prepare or self.connection.prepare_threshold is None or pgconn.transaction_status != _IDLE:
            self._load(pgconn.exec_params(sql, values, types))
            return
        result = pgconn.exec_prepared(self._prepare(pgconn, sql, types), values)  # type: ignore[arg-type]
        if result.status == _FATAL and result.error_field(pq.DiagnosticField.SQLSTATE) == _NO_SUCH_STATEMENT:
            # psycopg deallocated every statement of the session (it does after a ROLLBACK, a DROP
            # or an ALTER once it has prepared some of its own): nothing ran, outside any
            # transaction, so prepare again and run it.
            self._forget()
            result = pgconn.exec_prepared(self._prepare(pgconn, sql, types), values)  # type: ignore[arg-type]
        self._load(result)

    def fetchall(self) -> list[tuple[Any, ...]]:
        """The rows of the last statement (once)."""
        rows, self._rows = self._rows, []
        return rows

    def _connection_names(self) -> dict[bytes, bytes]:
        """The statements prepared on this cursor's connection (shared by its cursors)."""
        with _prepared_lock:
            return _prepared.setdefault(self.connection, {})

    def _prepare(self, pgconn: pq.abc.PGconn, sql: bytes, types: list[int]) -> bytes:
        """The name ``sql`` is prepared under on this connection, prepared now if it is not."""
        name = self._names.get(sql)
        if name is None:
            name = f"sg_{next(_names)}".encode()
            self._check(pgconn, pgconn.prepare(name, sql, types))
            self._names[sql] = name
        return name

    def _forget(self) -> None:
        with _prepared_lock:
            _prepared.pop(self.connection, None)
        self._names = self._connection_names()

    def _dump(self, value: Any) -> tuple[bytes | None, int]:
        """A parameter in text format (None is NULL), and the type named for it: bool, int8 or
        float8; for a str, None or anything else, 0: the server infers it from the statement
        (every such parameter of ours is a text column or inside a CAST)."""
        if isinstance(value, str):  # a str enum too: its value
            return value.encode(self._encoding), 0
        if value is None:
            return None, 0
        if isinstance(value, bool):
            return (b"t" if value else b"f"), 16
        if isinstance(value, int):
            return str(int(value)).encode(), 20  # an int enum too: its value
        if isinstance(value, float):
            if math.isinf(value):
                return (b"Infinity" if value > 0 else b"-Infinity"), 701
            return repr(float(value)).encode(), 701  # the shortest digits that read back exactly
        if isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError("a bytes parameter has no text form here")
        return str(value).encode(self._encoding), 0  # e.g. a UUID

    def _load(self, result: pq.abc.PGresult) -> None:
        self._check(self.connection.pgconn, result)
        self._result = result
        tuples = result.command_tuples
        self.rowcount = -1 if tuples is None else tuples
        nfields = result.nfields
        if not nfields:
            self._rows = []
            return
        oids = tuple(map(result.ftype, range(nfields)))
        columns = self._shapes.get(oids)
        if columns is None:
            columns = self._shapes[oids] = [(col, self._decoder(oid)) for col, oid in enumerate(oids)]
        get = result.get_value
        self._rows = [
            tuple([None if (v := get(row, col)) is None else decode(v) for col, decode in columns])
            for row in range(result.ntuples)
        ]

    def _decoder(self, oid: int) -> Callable[[bytes], Any]:
        if (known := self._decoders.get(oid)) is not None:
            return known
        decoder = _NUMBERS.get(oid)
        if decoder is None:
            encoding = self._encoding
            loader = None if oid in _TEXTS else self.connection.adapters.get_loader(oid, _TEXT)
            decoder = (lambda v: v.decode(encoding)) if loader is None else loader(oid, self.connection).load
        self._decoders[oid] = decoder
        return decoder

    def _check(self, pgconn: pq.abc.PGconn, result: pq.abc.PGresult) -> None:
        if result.status in _OK:
            return
        field = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
        raw = field or result.error_message or pgconn.error_message
        message = raw.decode(self._encoding, errors="replace").strip() or "the statement failed"
        if pgconn.status == pq.ConnStatus.BAD:
            raise psycopg.OperationalError(message)
        sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE)
        try:
            error = psycopg.errors.lookup(sqlstate.decode()) if sqlstate else psycopg.DatabaseError
        except KeyError:
            error = psycopg.DatabaseError
        raise error(message)
