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
bookkeeping) costs a call about as much client CPU as the round trip itself: with 4 worker
processes on one Redis server, redis-py's ``Script`` on the pool in its place ran 0.73x the agent
sagas and 0.73x the guarded calls per second (medians of 8 alternated rounds; docs/benchmarks.md,
"The fast paths, decided at 4 processes"). A kept connection is checked before each use as the pool
checks one it hands out
(``Connection.can_read``: an idle connection the server closed is connected afresh, so a Redis
restart costs no call), and one whose call failed other than with the server's error reply is
disconnected and given back. A client you pass runs scripts through redis-py's ``Script`` as it is.

A ``redis+cluster://`` URL (or a :class:`redis.cluster.RedisCluster` passed in) gives a cluster
client: redis-py routes each command and script to the primary of its key's hash slot and follows
``MOVED`` redirections, and every node's pool is a blocking one of ``max_connections``. Scripts run
through redis-py's ``Script`` there (no kept connections: a connection belongs to one node), and
are loaded on every primary (:func:`load_scripts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.exceptions import (
    NoScriptError,
    RedisClusterException,
    RedisClusterUnreachableError,
    SlotNotCoveredError,
)
from redis.retry import Retry

from sagaguard.idempotency.backends.kept import KeptConnections
from sagaguard.idempotency.backends.urls import CLUSTER_SCHEMES, cluster_url, masked
from sagaguard.idempotency.checks import count
from sagaguard.idempotency.errors import ConfigurationError, StoreError, StoreUnavailable

__all__ = [
    "CONNECT_TIMEOUT", "ERRORS", "MAX_CONNECTIONS", "READ_TIMEOUT", "TRANSIENT", "RedisClient",
    "ScriptRunner", "connect", "load_scripts", "store_error",
]  # fmt: skip

RedisClient: TypeAlias = "redis.Redis | RedisCluster"
"""A client of one server (or a Sentinel master), or of a Redis Cluster."""

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
# A cluster client's own errors that are not RedisError: no node reachable, a slot nobody serves.
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
             redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
             RedisClusterUnreachableError, SlotNotCoveredError)  # fmt: skip

ERRORS = (redis.RedisError, RedisClusterException)
"""Every error a client raises for a failed command: a cluster client's own
(``RedisClusterException``: no node reachable, keys of one script in different slots) are not
``RedisError``."""


def store_error(exc: redis.RedisError | RedisClusterException) -> StoreError:
    """Our error for a driver error; the caller raises it ``from exc``."""
    if isinstance(exc, TRANSIENT):
        return StoreUnavailable(f"redis is unavailable: {exc}")
    return StoreError(f"redis failed: {exc}")


def connect(
    url_or_client: str | RedisClient, prefix: str, *, max_connections: int = MAX_CONNECTIONS
) -> tuple[RedisClient, bool]:
    """The client for a URL (and True: ours to close) or the caller's client (and False).

    From a URL the client fails fast (:data:`CONNECT_TIMEOUT`, :data:`READ_TIMEOUT`), never
    retries on its own (a script whose reply was lost may have run, so whether to try again is the
    caller's call), decodes replies as UTF-8, and has a blocking pool of ``max_connections`` (on a
    cluster: per node). A ``redis+cluster://`` URL gives a :class:`~redis.cluster.RedisCluster`,
    which connects at once to learn the cluster's slots.

    Raises:
        ConfigurationError: the URL is malformed or has an unknown query parameter,
            ``max_connections`` is below 1, or ``prefix`` is empty or has braces (it would break
            the hash tag that keeps each record's keys in one cluster slot).
        redis.RedisError: a cluster URL's nodes cannot be reached (a ``RedisClusterException``
            too); the caller maps it to its own unavailable error.
    """
    if not prefix or "{" in prefix or "}" in prefix:
        raise ConfigurationError(f"a redis prefix must be non-empty and brace-free: {prefix!r}")
    if not isinstance(url_or_client, str):
        return url_or_client, False
    count("max_connections", max_connections)
    if url_or_client.split("://", 1)[0].lower() in CLUSTER_SCHEMES:
        return _cluster(url_or_client, max_connections), True
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


def _cluster(url: str, max_connections: int) -> RedisCluster:
    parsed = cluster_url(url)
    try:
        # The options every node shares, checked as for one server: redis-py's cluster client
        # drops an option it does not know without a word.
        pool = redis.ConnectionPool.from_url(parsed.node_url)
        pool.connection_class(**pool.connection_kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"malformed redis URL {masked(url)!r}: {exc}") from exc
    return RedisCluster(
        url=parsed.node_url,
        # redis-py leaves ClusterNode's constructor untyped.
        startup_nodes=[ClusterNode(host, port) for host, port in parsed.nodes[1:]],  # type: ignore[no-untyped-call]
        # No retry of a command whose reply was lost (the client still follows MOVED and ASK,
        # which tell that nothing ran).
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
        socket_connect_timeout=CONNECT_TIMEOUT,
        socket_timeout=READ_TIMEOUT,
        connection_pool_class=redis.BlockingConnectionPool,
        max_connections=max_connections,
        timeout=READ_TIMEOUT,
    )


def load_scripts(client: RedisClient, scripts: Sequence[Script]) -> None:
    """Load ``scripts`` on the server (on a cluster, on every primary), which also checks that it
    answers, and spares the first calls a ``NOSCRIPT``.

    Raises:
        redis.RedisError: as the client raises them (a ``RedisClusterException`` too).
    """
    if isinstance(client, RedisCluster):
        # SCRIPT LOAD goes to every primary; a cluster pipeline refuses a command for many nodes.
        for script in scripts:
            client.script_load(script.script)
        return
    pipe = client.pipeline(transaction=False)  # one round trip
    for script in scripts:
        pipe.script_load(script.script)
    pipe.execute()


class ScriptRunner:
    """Runs registered scripts on ``client`` (see the module).

    Args:
        client: the client the scripts were registered on.
        keep: let threads keep connections (a client of the caller's own: False, its pool is
            shared; ignored on a cluster); whoever makes the runner then calls :meth:`close`.

    Thread-safe.
    """

    def __init__(self, client: RedisClient, *, keep: bool) -> None:
        # redis-py's connections are untyped: Any where one is held.
        self._kept: KeptConnections[Any] | None = None
        if isinstance(client, RedisCluster):
            return  # Script routes each call to its slot's primary
        self._pool = client.connection_pool
        # Half the pool at most, so the store's other calls (and the threads that keep none) always
        # find connections: with a pool of one, none is kept.
        limit = int(getattr(self._pool, "max_connections", 0)) // 2
        if keep and limit:
            self._kept = KeptConnections(lambda: limit, self._give_back)

    def __call__(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The script's reply to ``keys`` and ``args``.

        Raises:
            redis.RedisError: as ``Script.__call__`` raises them (on a cluster, a
                ``RedisClusterException`` too).
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
