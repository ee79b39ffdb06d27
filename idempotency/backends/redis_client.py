"""The redis-py client every Redis-backed ledger and journal uses, and its errors mapped to ours.

From a URL the client gets a :class:`redis.BlockingConnectionPool` of :data:`MAX_CONNECTIONS`:
each call in flight takes one connection and gives it back when it returns, so more threads than
connections wait for one (up to the read timeout) rather than failing with redis-py's
``Too many connections``, as its default pool makes the 101st concurrent call do.

The hot scripts (a guarded call's claim and record, a saga's phase) run through
:class:`ScriptRunner`: on a client of the store's (or journal's) own, each thread keeps the
connection its script used for its next ones (:class:`~sagaguard.idempotency.backends.kept.KeptConnections`,
half the pool at most), and sends ``EVALSHA`` with redis-py's public ``Connection.send_command`` and
``read_response``. redis-py's command path (the pool's checkout and release, its retry and metrics
bookkeeping) costs a call about as much client CPU as the round trip itself (docs/benchmarks.md). A
kept connection is checked before each use as the pool checks one it hands out
(``Connection.can_read``: an idle connection the server closed is connected afresh, so a Redis
restart costs no call), and one whose call failed other than with the server's error reply is
disconnected and given back. A client you pass runs scripts through redis-py's ``Script`` as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.exceptions import NoScriptError
from redis.retry import Retry

from sagaguard.idempotency.backends.kept import KeptConnections
from sagaguard.idempotency.backends.urls import masked
from sagaguard.idempotency.checks import count
from sagaguard.idempotency.errors import ConfigurationError, StoreError, StoreUnavailable

__all__ = [
    "CONNECT_TIMEOUT", "MAX_CONNECTIONS", "READ_TIMEOUT", "TRANSIENT", "ScriptRunner", "connect",
    "store_error",
]  # fmt: skip

MAX_CONNECTIONS = 64
"""Connections a client built from a URL keeps open at most. A call holds one for one round trip
(well under a millisecond on a local network), so 64 serve hundreds of threads; Redis's own limit
is 10,000 clients, shared by every process that connects."""

CONNECT_TIMEOUT = 2.0
"""Seconds to connect before the store is reported unavailable."""

READ_TIMEOUT = 5.0
"""Seconds to wait for a reply, and for a free connection of the pool, before the same."""

# ConnectionError covers BusyLoadingError (still loading). The others are failovers under way (a
# replica not yet promoted, a cluster reshuffling slots): transient like a lost connection.
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
             redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)  # fmt: skip


def store_error(exc: redis.RedisError) -> StoreError:
    """Our error for a driver error; the caller raises it ``from exc``."""
    if isinstance(exc, TRANSIENT):
        return StoreUnavailable(f"redis is unavailable: {exc}")
    return StoreError(f"redis failed: {exc}")


def connect(
    url_or_client: str | redis.Redis, prefix: str, *, max_connections: int = MAX_CONNECTIONS
) -> tuple[redis.Redis, bool]:
    """The client for a URL (and True: ours to close) or the caller's client (and False).

    From a URL the client fails fast (:data:`CONNECT_TIMEOUT`, :data:`READ_TIMEOUT`), never
    retries on its own (a script whose reply was lost may have run, so whether to try again is the
    caller's call), decodes replies as UTF-8, and has a blocking pool of ``max_connections``.

    Raises:
        ConfigurationError: the URL is malformed or has an unknown query parameter,
            ``max_connections`` is below 1, or ``prefix`` is empty or has braces (it would break
            the hash tag that keeps each record's keys in one cluster slot).
    """
    if not prefix or "{" in prefix or "}" in prefix:
        raise ConfigurationError(f"a redis prefix must be non-empty and brace-free: {prefix!r}")
    if not isinstance(url_or_client, str):
        return url_or_client, False
    count("max_connections", max_connections)
    try:
        pool = redis.BlockingConnectionPool.from_url(
            url_or_client,
            max_connections=max_connections,
            timeout=READ_TIMEOUT,
            decode_responses=True,
            socket_connect_timeout=CONNECT_TIMEOUT,
            socket_timeout=READ_TIMEOUT,
            retry=Retry(NoBackoff(), 0),
        )
        # redis-py hands the URL's query parameters to the connection class, and an unknown one
        # is a TypeError only when the first connection is made: make one (it opens no socket).
        pool.connection_class(**pool.connection_kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"malformed redis URL {masked(url_or_client)!r}: {exc}") from exc
    return redis.Redis.from_pool(pool), True


class ScriptRunner:
    """Runs registered scripts on ``client`` (see the module).

    Args:
        client: the client the scripts were registered on.
        keep: let threads keep connections (a client of the caller's own: False, its pool is
            shared); whoever makes the runner then calls :meth:`close`.

    Thread-safe.
    """

    def __init__(self, client: redis.Redis, *, keep: bool) -> None:
        self._pool = client.connection_pool
        # redis-py's connections are untyped: Any where one is held.
        self._kept: KeptConnections[Any] | None = None
        # Half the pool at most, so the store's other calls (and the threads that keep none) always
        # find connections: with a pool of one, none is kept.
        limit = int(getattr(self._pool, "max_connections", 0)) // 2
        if keep and limit:
            self._kept = KeptConnections(lambda: limit, self._give_back)

    def __call__(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The script's reply to ``keys`` and ``args``.

        Raises:
            redis.RedisError: as ``Script.__call__`` raises them.
            UnicodeEncodeError: an argument has no UTF-8 form.
        """
        if self._kept is None:
            return script(keys=list(keys), args=list(args))
        kept = self._kept.take()
        conn = kept.conn if kept is not None else self._pool.get_connection()
        usable = False  # whether the connection is in a known state after the call
        try:
            if kept is not None:
                _ready(conn)
            reply = _evalsha(conn, script, keys, args)
            usable = True
            return reply
        except redis.ResponseError:  # the server's error reply, read in full
            usable = True
            raise
        finally:
            if kept is not None:
                if usable:
                    self._kept.done(kept)
                else:
                    self._kept.discard(kept)
            elif not usable or not self._kept.keep(conn):
                self._give_back(conn, not usable)

    def close(self) -> None:
        """Give back every kept connection (call when no script runs)."""
        if self._kept is not None:
            self._kept.close()

    def _give_back(self, conn: Any, broken: bool) -> None:
        if broken:
            conn.disconnect()  # a reply may be half read: the next use connects afresh
        self._pool.release(conn)


def _ready(conn: Any) -> None:
    """Make a kept connection fit to send on, as the pool checks one it hands out."""
    try:
        if conn.can_read():  # a reply nobody asked for, or the server closed it
            raise redis.ConnectionError("connection not ready")
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        conn.disconnect()  # send_command connects again


def _evalsha(conn: Any, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """``EVALSHA`` on ``conn``; the script loaded first if the server does not have it (nothing
    ran then), as ``Script.__call__`` does."""
    try:
        conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return conn.read_response()
    except NoScriptError:
        conn.send_command("SCRIPT", "LOAD", script.script)
        conn.read_response()
        conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return conn.read_response()
