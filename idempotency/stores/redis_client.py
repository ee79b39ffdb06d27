"""The redis-py client every Redis-backed ledger and journal uses, and its errors mapped to ours.

From a URL the client gets a :class:`redis.BlockingConnectionPool` of :data:`MAX_CONNECTIONS`:
each call in flight takes one connection and gives it back when it returns, so more threads than
connections wait for one (up to the read timeout) rather than failing with redis-py's
``Too many connections``, as its default pool makes the 101st concurrent call do.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from idempotency.errors import ConfigurationError, StoreError, StoreUnavailable

__all__ = ["CONNECT_TIMEOUT", "MAX_CONNECTIONS", "READ_TIMEOUT", "TRANSIENT", "connect", "store_error"]

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
        ConfigurationError: the URL is malformed, ``max_connections`` is below 1, or ``prefix`` is
            empty or has braces (it would break the hash tag that keeps each record's keys in one
            cluster slot).
    """
    if not prefix or "{" in prefix or "}" in prefix:
        raise ConfigurationError(f"a redis prefix must be non-empty and brace-free: {prefix!r}")
    if not isinstance(url_or_client, str):
        return url_or_client, False
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
        raise ConfigurationError(f"max_connections must be a whole number >= 1, got {max_connections!r}")
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
    except ValueError as exc:
        raise ConfigurationError(f"malformed redis URL: {exc}") from exc
    return redis.Redis.from_pool(pool), True
