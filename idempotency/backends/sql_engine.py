"""The engine every SQL backend uses: SQLAlchemy's, set up by its public settings.

Postgres goes through psycopg 3 (``postgresql://`` is rewritten to ``postgresql+psycopg://``), with a
5 s connect timeout. SQLite files run in WAL mode with ``synchronous=FULL`` and a 30 s busy timeout;
the sqlite3 module's own transaction handling is off (``isolation_level=None``), so a statement
outside ``BEGIN`` is its own transaction and SQLAlchemy Core's transactions begin with ``BEGIN
IMMEDIATE`` (a transaction that starts as a reader and later writes can fail with "database is
locked" at once, whatever the timeout, so writers take the lock first).

The pool is SQLAlchemy's ``QueuePool`` with its defaults (5 connections kept, 10 more on demand,
a rollback when a connection comes back); ``sqlite://`` is one private in-memory database on one
shared connection (``StaticPool``). No pre-ping: every block checks a connection out, so it would
cost a round trip on every call; a connection the server killed instead costs the one call that
finds it, and the pool is then renewed (:mod:`~sagaguard.idempotency.backends.sql_driver`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
import tenacity
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import QueuePool, StaticPool

from sagaguard.idempotency.backends.urls import check_url, driver_hint, masked, postgres_hosts
from sagaguard.idempotency.errors import ConfigurationError

__all__ = ["BUSY_TIMEOUT_MS", "make_engine", "retry_locked"]

BUSY_TIMEOUT_MS = 30_000
"""SQLite's busy timeout: how long a writer waits for another's lock."""
_CONNECT_TIMEOUT_S = 5
_LOCKED_RETRIES = 50


def _sqlite_on_connect(memory: bool) -> Callable[[Any, Any], None]:
    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control from the sqlite3 module: BEGIN IMMEDIATE is ours to emit.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            # busy_timeout first: switching to WAL needs a lock other connections may hold.
            cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if not memory:
                retry_locked(lambda: cursor.execute("PRAGMA journal_mode = WAL"))
            cursor.execute("PRAGMA synchronous = FULL")
        finally:
            cursor.close()

    return on_connect


def retry_locked(step: Callable[[], object]) -> None:
    """Run ``step``, again while SQLite answers "database is locked" (bounded, with backoff).

    Why: some of SQLite's locks are not waited for by the busy timeout. Several processes opening
    one WAL database at the same instant can get SQLITE_BUSY at once from the first read of the
    WAL index (another connection is running its recovery) or from switching the journal mode.
    """
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(_LOCKED_RETRIES),
        wait=tenacity.wait_incrementing(start=0.01, increment=0.01, max=0.2),
        retry=tenacity.retry_if_exception(_locked),
        reraise=True,
    )
    retrying(step)


def _locked(exc: BaseException) -> bool:
    """sqlite3's OperationalError "database is locked", or SQLAlchemy's wrapper of it."""
    return "database is locked" in str(exc)


def _sqlite_on_begin(conn: sa.Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str | sa.URL) -> sa.Engine:
    """An engine configured the way the SQL store, journal and outbox need it (see the module).

    Raises:
        ConfigurationError: the URL is not a string or URL, is malformed, names another database, or
            is a Postgres URL with no host or no database (checked as :func:`open_store` checks it),
            or its driver is not installed (with the extra to install).
    """
    if not isinstance(url, sa.URL):
        check_url(url)
    try:
        # A libpq host list (host1:5432,host2:5433) moves into the query, where SQLAlchemy takes it.
        parsed = sa.make_url(postgres_hosts(url) if isinstance(url, str) else url)
        backend = parsed.get_backend_name()
        if backend in ("postgresql", "postgres"):
            if parsed.drivername in ("postgresql", "postgres"):
                parsed = parsed.set(drivername="postgresql+psycopg")
            return sa.create_engine(
                parsed,
                connect_args={"connect_timeout": _CONNECT_TIMEOUT_S},
                pool_pre_ping=False,
                pool_reset_on_return="rollback",
                hide_parameters=True,
            )
        if backend != "sqlite":
            raise ConfigurationError(f"SqlStore serves sqlite:// and postgresql://, not {backend}")
        memory = parsed.database in (None, "", ":memory:")
        engine = sa.create_engine(
            parsed,
            poolclass=StaticPool if memory else QueuePool,
            connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000},
            pool_reset_on_return="rollback",
            hide_parameters=True,
        )
    except ImportError as exc:  # the driver is not installed
        hint = driver_hint(exc)
        raise ConfigurationError(f"cannot use store URL: {exc}{f' ({hint})' if hint else ''}") from exc
    except sa_exc.ArgumentError as exc:  # malformed: SQLAlchemy's message may quote the whole URL
        text = str(exc) if not isinstance(url, str) else str(exc).replace(url, masked(url))
        raise ConfigurationError(f"cannot use store URL: {text}") from exc
    event.listen(engine, "connect", _sqlite_on_connect(memory))
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine
