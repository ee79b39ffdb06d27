"""A few of an engine's pooled DBAPI connections, kept checked out between calls.

Checking a connection out of SQLAlchemy's pool and back in (events, a reset, weak references) costs
about 7 µs of Python each way, more with cold caches between two commits: a tenth of a commit on a
fast disk, paid twice per guarded call. The hot paths of :class:`~idempotency.stores.sql.SqlStore`
and of the saga's SQL journal therefore take their connections from a shelf that keeps up to
``keep`` of them between calls and goes to the pool only when it is empty or full.

What the pool did on every checkin, the shelf's users do themselves: each block ends its own
transaction (COMMIT or ROLLBACK), and Postgres connections stay in autocommit while shelved (set once
when taken from the pool, restored when given back). A connection that may be broken (a disconnect,
an interrupted call) never goes back on the shelf: it is invalidated, and after a disconnect every
shelved connection is dropped too, as the pool recycles its older connections then.

How many are kept depends on the pool, so that one store never starves the other users of a shared
engine: two of a pool of five or more, one fewer than the pool's size below that (none for a pool of
one), none for a pool that keeps nothing itself (``NullPool``: the user chose fresh connections).

Thread-safe without a lock: ``list.pop`` and ``list.append`` are atomic, so two threads never take
the same connection. After ``fork`` the parent's connections are forgotten, never closed (closing a
Postgres connection would end the parent's session on the shared socket), and the engine's pool is
replaced as SQLAlchemy advises for a child process (``dispose(close=False)``), so the child never
shares a parent's socket through the pool either.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool, QueuePool

__all__ = ["Held", "Shelf", "shelf_size"]

KEEP: int = 2
"""Connections a shelf keeps at most, on a pool large enough to spare them."""


def shelf_size(engine: sa.Engine) -> int:
    """How many idle connections a shelf on ``engine`` keeps (see the module's docstring)."""
    pool = engine.pool
    if isinstance(pool, NullPool):
        return 0
    if isinstance(pool, QueuePool):  # size() is its pool_size; overflow connections are not kept
        return max(0, min(KEEP, pool.size() - 1))
    return KEEP  # StaticPool, SingletonThreadPool: one connection (per thread) whatever we do


class Held:
    """One connection taken from a shelf: the pool's proxy, the DBAPI connection and a cursor on it
    that lives as long as the connection (a new psycopg cursor per call costs several µs)."""

    __slots__ = ("conn", "cursor", "fairy")

    def __init__(self, fairy: Any) -> None:
        self.fairy = fairy
        self.conn: Any = fairy.driver_connection
        self.cursor: Any = self.conn.cursor()


class Shelf:
    """Checked-out connections of ``engine``'s pool, reused across calls.

    Args:
        engine: the engine whose pool the connections come from.
        keep: how many idle connections to keep checked out at most; more are given back to the
            pool. Default: :func:`shelf_size`.
    """

    __slots__ = ("_engine", "_idle", "_keep", "_pid", "postgres")

    def __init__(self, engine: sa.Engine, *, keep: int | None = None) -> None:
        self._engine = engine
        self._keep = shelf_size(engine) if keep is None else keep
        self._idle: list[Held] = []
        self._pid = os.getpid()
        self.postgres = engine.dialect.name == "postgresql"

    def take(self) -> Held:
        """A pooled connection that is the caller's alone until :meth:`give` or :meth:`discard`.
        Postgres ones are in autocommit.

        Raises:
            whatever the pool raises when it cannot connect (the caller translates it).
        """
        held = self.take_idle()
        if held is not None:
            return held
        fairy = self._engine.raw_connection()
        try:
            if self.postgres:
                fairy.driver_connection.autocommit = True  # type: ignore[union-attr]
            return Held(fairy)
        except BaseException:
            fairy.close()
            raise

    def take_idle(self) -> Held | None:
        """:meth:`take`, but only a shelved connection: None rather than a checkout from the pool
        (which may connect, or wait for a connection to come back)."""
        if self._pid != os.getpid():
            self._forked()
        try:
            return self._idle.pop()
        except IndexError:
            return None

    def give(self, held: Held) -> None:
        """Put back a connection whose transaction the caller ended."""
        if len(self._idle) < self._keep and self._pid == os.getpid():
            self._idle.append(held)
        else:
            self._release(held)

    def settle(self, held: Held, exc: BaseException, *, disconnect: bool, rollback: bool = True) -> None:
        """After a block that raised ``exc``: roll its transaction back and shelve the connection
        again, or throw it away when it may be broken (a ``disconnect``, or an interruption such as
        a cancellation or ``KeyboardInterrupt`` that may have left a reply unread)."""
        if disconnect or not isinstance(exc, Exception):
            self.discard(held, exc, disconnect=disconnect)
            return
        try:
            if rollback:
                held.conn.rollback()
        except Exception as failed:
            self.discard(held, failed, disconnect=False)
        else:
            self.give(held)

    def discard(self, held: Held, exc: BaseException | None, *, disconnect: bool) -> None:
        """Throw away a connection that may be broken; after a ``disconnect`` also every shelved one
        (the server went away: they are as dead), as SQLAlchemy's pool does with its older ones."""
        fairy = held.fairy
        with contextlib.suppress(Exception):
            if disconnect:  # and the pool recycles every connection older than this one
                self._engine.pool._invalidate(fairy, exc)
            else:
                fairy.invalidate(exc)
        with contextlib.suppress(Exception):
            fairy.close()
        if disconnect:
            idle, self._idle = self._idle, []
            for other in idle:
                with contextlib.suppress(Exception):
                    other.fairy.invalidate()
                with contextlib.suppress(Exception):
                    other.fairy.close()

    def _forked(self) -> None:
        # The parent's connections are not ours to use, nor to close; nor are those in the pool.
        self._idle, self._pid = [], os.getpid()
        self._engine.dispose(close=False)

    def close(self) -> None:
        """Give every shelved connection back to the pool."""
        idle, self._idle = self._idle, []
        if self._pid != os.getpid():
            return
        for held in idle:
            self._release(held)

    def _release(self, held: Held) -> None:
        with contextlib.suppress(Exception):
            held.cursor.close()
        with contextlib.suppress(Exception):
            if self.postgres:
                held.conn.autocommit = False  # back as the pool gave it
        with contextlib.suppress(Exception):
            held.fairy.close()
