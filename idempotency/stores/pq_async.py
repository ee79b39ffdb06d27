"""Postgres statements awaited on the event loop, through libpq's non-blocking interface; and the
same statements run blocking, for the store's sync writes.

An async guarded call on Postgres makes two writes (the claim, the record). A worker thread keeps the
event loop free while they wait for the server, but each hop costs a wake-up of the loop (tens of µs
on a 2-vCPU VM). Waiting for the socket in the loop itself costs what a blocking wait costs, plus the
loop's own turn: measured here at about 11 µs per statement over a blocking ``poll`` (psycopg's
``AsyncConnection`` adds 40-80 µs more, in its Python layers). So the two hot writes go straight to
libpq (``psycopg.pq``, psycopg's documented low-level interface), on a connection the store's shelf
lends, and everything else stays on the blocking path.

Per statement: prepared once per connection under this module's own name (never one of psycopg's),
sent with ``send_query_prepared`` in text format, its reply read as the socket becomes readable
(``loop.add_reader``), the row decoded by column type. A reply the server sends as an error becomes
the psycopg exception of its SQLSTATE, so the store maps it as it maps every other driver error.

Blocking (:func:`execute_blocking`): the same statement, sent the same way, the reply waited for
with ``poll`` in the calling thread. psycopg's ``cursor.execute`` of the same prepared statement
costs more in its Python layers (query and parameter adaptation, its prepared-statement
bookkeeping, result loading): measured interleaved, 30 µs of a 530 µs claim and record. The wait is
a Python ``poll``, so Ctrl-C interrupts it as it does psycopg's.

Cancellation: once a write is sent, its outcome decides what the caller must do (a claim made for a
cancelled call is given back), so a cancellation that arrives while the reply is awaited does not
abandon it: the reply is still read, then :class:`~idempotency.store.WriteCancelled` carries it to
the caller. A second cancellation gives up: the connection (its reply unread) is closed.
"""

from __future__ import annotations

import asyncio
import re
import select
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from idempotency.store import WriteCancelled

__all__ = ["Broken", "Statement", "execute", "execute_blocking"]

_NAMED = re.compile(r"%\((\w+)\)s")

_DECODERS: dict[int, Callable[[bytes], Any]] = {
    16: lambda v: v == b"t",  # bool
    20: int,  # int8
    21: int,  # int2
    23: int,  # int4
    700: float,  # float4
    701: float,  # float8
}
_PARAM_TYPES: dict[type, int] = {bool: 16, int: 20, float: 701}  # str and None: the server infers
_NO_SUCH_STATEMENT = "26000"  # invalid_sql_statement_name
_ALREADY_PREPARED = "42P05"  # duplicate_prepared_statement


class Broken(Exception):
    """The connection failed mid-statement (its state is unknown): it must be thrown away."""


class Statement:
    """One statement in psycopg's ``%(name)s`` style, numbered for libpq (``$1``, ``$2``, ...)."""

    __slots__ = ("name", "order", "sql")

    def __init__(self, name: str, sql: str) -> None:
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in order:
                order.append(match.group(1))
            return f"${order.index(match.group(1)) + 1}"

        if "%%" in sql:  # no statement of ours has a literal %; refuse rather than mistranslate
            raise ValueError("a literal % is not supported")
        self.name = name.encode()
        self.sql = _NAMED.sub(number, sql).encode()
        self.order = tuple(order)


# The statements prepared on each connection (a psycopg Connection: the same one may come back from
# SQLAlchemy's pool in a new shelf entry, and its server session still holds them).
_prepared: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()


def _param(value: Any, encoding: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, float):
        return repr(value).encode()
    return str(value).encode(encoding)


async def execute(conn: Any, statement: Statement, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Run ``statement`` on psycopg connection ``conn`` (autocommit, nothing in flight) and return
    its rows, awaiting the server in the running event loop.

    Raises:
        psycopg.Error: the server answered with an error (the connection is fine).
        Broken: libpq failed (chained to its error): the connection is lost or in an unknown state.
        WriteCancelled: cancelled after the statement was sent; carries its rows, or the server's
            error (the reply was read: the connection is fine).
        asyncio.CancelledError: cancelled before anything was written, or twice (the reply was then
            not read: the connection must be thrown away).
    """
    pg = conn.pgconn
    loop = asyncio.get_running_loop()
    done, encoding, values = _bind(conn, statement, params)
    for attempt in range(2):
        if statement.name not in done:
            await _prepare(pg, loop, statement, params)
            done.add(statement.name)
        try:
            result = await _send(pg, loop, lambda: pg.send_query_prepared(statement.name, values))
        except WriteCancelled as cancelled:
            try:
                rows = _rows(_check(cancelled.outcome), encoding)
            except Exception as exc:  # the server refused it: nothing was written
                raise WriteCancelled(exc) from None
            raise WriteCancelled(rows) from None
        answer = _answer(result, encoding, done, statement, last=bool(attempt))
        if answer is not None:
            return answer
    raise AssertionError("unreachable")  # pragma: no cover


def execute_blocking(conn: Any, statement: Statement, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """:func:`execute`, blocking the calling thread until the reply is read.

    Raises:
        psycopg.Error: the server answered with an error (the connection is fine).
        Broken: libpq failed (chained to its error): the connection is lost or in an unknown state.
        KeyboardInterrupt: or whatever else a signal handler raised while the reply was awaited: it
            may be unread, so the connection must be thrown away.
    """
    pg = conn.pgconn
    done, encoding, values = _bind(conn, statement, params)
    for attempt in range(2):
        if statement.name not in done:
            prepared = _send_blocking(
                pg,
                lambda: pg.send_prepare(statement.name, statement.sql, param_types=_types(statement, params)),
            )
            try:
                _check(prepared)
            except Exception as exc:  # prepared by an async call cancelled before it knew
                if getattr(exc, "sqlstate", None) != _ALREADY_PREPARED:
                    raise
            done.add(statement.name)
        result = _send_blocking(pg, lambda: pg.send_query_prepared(statement.name, values))
        rows = _answer(result, encoding, done, statement, last=bool(attempt))
        if rows is not None:
            return rows
    raise AssertionError("unreachable")  # pragma: no cover


def _bind(
    conn: Any, statement: Statement, params: dict[str, Any]
) -> tuple[set[bytes], str, list[bytes | None]]:
    """The names prepared on ``conn``, its session's encoding (a Python codec name), and the values."""
    encoding = conn.info.encoding
    values = [_param(params[name], encoding) for name in statement.order]
    return _prepared.setdefault(conn, set()), encoding, values


def _answer(
    result: Any, encoding: str, done: set[bytes], statement: Statement, *, last: bool
) -> list[tuple[Any, ...]] | None:
    """The rows of ``result``; None when the statement must be prepared again and sent once more."""
    try:
        return _rows(_check(result), encoding)
    except Exception as exc:
        # Gone from the session (psycopg sends DEALLOCATE ALL on a connection after a ROLLBACK or a
        # DROP it ran): nothing was executed, so prepare it again and send it once more.
        if last or getattr(exc, "sqlstate", None) != _NO_SUCH_STATEMENT:
            raise
        done.discard(statement.name)
        return None


def _send_blocking(pg: Any, send: Callable[[], None]) -> Any:
    """``send`` a statement, then wait for its whole reply; its result."""
    try:
        send()
        while pg.flush():  # 1: more to send once the socket is writable (a large statement)
            _wait(pg.socket, select.POLLOUT)
        result = None
        while True:
            while pg.is_busy():
                _wait(pg.socket, select.POLLIN)
                pg.consume_input()
            got = pg.get_result()
            if got is None:
                return result
            result = got
    except Exception as exc:  # libpq's own failures (psycopg.OperationalError): the connection
        raise Broken(str(exc).strip() or type(exc).__name__) from exc


def _wait(fd: int, events: int) -> None:
    poller = select.poll()
    poller.register(fd, events)
    poller.poll()  # readable or writable, or an error or hang-up, which libpq then reports


def _types(statement: Statement, params: dict[str, Any]) -> list[int]:
    """The parameters' types the server is told when the statement is prepared (0: it infers)."""
    return [_PARAM_TYPES.get(type(params[name]), 0) for name in statement.order]


async def _prepare(
    pg: Any, loop: asyncio.AbstractEventLoop, statement: Statement, params: dict[str, Any]
) -> None:
    types = _types(statement, params)
    try:
        result = await _send(
            pg, loop, lambda: pg.send_prepare(statement.name, statement.sql, param_types=types)
        )
    except WriteCancelled:  # nothing was written: a plain cancellation (prepared again next time)
        raise asyncio.CancelledError from None
    try:
        _check(result)
    except Exception as exc:  # already there: prepared by a call cancelled before it knew
        if getattr(exc, "sqlstate", None) != _ALREADY_PREPARED:
            raise


async def _send(pg: Any, loop: asyncio.AbstractEventLoop, send: Callable[[], None]) -> Any:
    try:
        send()
        await _flush(pg, loop)
        return await _reply(pg, loop)
    except asyncio.CancelledError:  # WriteCancelled too
        raise
    except Exception as exc:  # libpq's own failures (psycopg.OperationalError): the connection
        raise Broken(str(exc).strip() or type(exc).__name__) from exc


async def _flush(pg: Any, loop: asyncio.AbstractEventLoop) -> None:
    while pg.flush():  # 1: more to send once the socket is writable (a large statement)
        await _ready(loop, pg.socket, writer=True)


async def _reply(pg: Any, loop: asyncio.AbstractEventLoop) -> Any:
    """The statement's result, after reading to the end of its reply."""
    result = None
    cancelled = False
    while True:
        while pg.is_busy():
            try:
                await _ready(loop, pg.socket, writer=False)
            except asyncio.CancelledError:
                if cancelled:  # a second time: give up; the reply stays unread
                    pg.finish()
                    raise
                cancelled = True  # read the reply all the same: it is the caller's to act on
            pg.consume_input()
        got = pg.get_result()
        if got is None:
            break
        result = got
    if cancelled:
        raise WriteCancelled(result)
    return result


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, *, writer: bool) -> None:
    future = loop.create_future()

    def wake() -> None:
        if not future.done():
            future.set_result(None)

    if writer:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await future
    finally:
        if writer:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


def _check(result: Any) -> Any:
    """``result`` if it is rows or a command's status, else the server's error raised as psycopg's."""
    from psycopg import errors, pq

    if result is None:
        raise Broken("the reply had no result")
    status = result.status
    if status in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
        return result
    sqlstate = (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
    message = (result.error_message or b"").decode(errors="replace").strip()
    try:
        cls = errors.lookup(sqlstate)
    except KeyError:
        cls = errors.DatabaseError
    raise cls(message or f"server error (status {status})")


def _rows(result: Any, encoding: str) -> list[tuple[Any, ...]]:
    def text(value: bytes) -> str:
        return value.decode(encoding)

    # By column type; anything else (text, varchar, ...) as text.
    decoders: Sequence[Callable[[bytes], Any]] = [
        _DECODERS.get(result.ftype(i), text) for i in range(result.nfields)
    ]
    rows = []
    for r in range(result.ntuples):
        row = []
        for c, decode in enumerate(decoders):
            value = result.get_value(r, c)
            row.append(None if value is None else decode(value))
        rows.append(tuple(row))
    return rows
