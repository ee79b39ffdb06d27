"""Store backends and a factory that opens one from a URL.

Backends import their driver only in their own module, so ``import sagaguard.idempotency`` needs neither redis
nor psycopg: ``from sagaguard.idempotency.stores.redis import RedisStore`` does.
"""

from __future__ import annotations

from collections.abc import Callable

from sagaguard.idempotency.backends.urls import check_url, driver_hint
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores.memory import MemoryStore

__all__ = ["DEFAULT_URL", "MemoryStore", "open_store"]

DEFAULT_URL = "sqlite:///sagaguard.db"
"""The embedded default: a SQLite file in the working directory."""


def open_store(url: str = DEFAULT_URL, *, clock: Callable[[], float] | None = None) -> IdempotencyStore:
    """Open the store a URL names.

    - ``memory://``: :class:`MemoryStore` (one process, nothing survives it).
    - ``sqlite:///path.db`` (or ``sqlite://`` for a private in-memory database),
      ``postgresql://user@host/db`` (psycopg 3; ``postgresql+psycopg://`` too): :class:`SqlStore`.
    - ``redis://host:port/db`` or ``rediss://``, and a Redis Cluster's
      ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://``): :class:`RedisStore`.

    Args:
        url: where the records live.
        clock: inject a clock (tests); by default the store uses its server's own time.

    Raises:
        ConfigurationError: ``url`` is not a string, is malformed, has an unknown scheme, or leaves
            the host or database to a driver default (see
            :func:`~sagaguard.idempotency.backends.urls.check_url`).
        StoreUnavailable: the backend cannot be reached.
    """
    scheme = check_url(url, what="store")
    if scheme == "memory":
        return MemoryStore(clock=clock)
    if scheme in ("sqlite", "postgresql"):
        from sagaguard.idempotency.stores.sql import SqlStore

        return SqlStore(url, clock=clock)
    if scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        try:
            from sagaguard.idempotency.stores.redis import RedisStore
        except ImportError as exc:  # redis-py is not installed
            raise ConfigurationError(f"cannot use store URL: {exc} ({driver_hint(exc)})") from exc
        return RedisStore(url, clock=clock)
    raise AssertionError(f"check_url returned an unknown scheme {scheme!r}")  # pragma: no cover
