"""Journal backends, and :func:`open_journal`, which opens one from a URL.

The SQL and Redis journals import their drivers only in their own modules:
``from sagaguard.saga.journals.sql import SqlJournal``, ``from sagaguard.saga.journals.redis import
RedisJournal``.
"""

from __future__ import annotations

from collections.abc import Callable

from sagaguard.idempotency.backends.urls import check_url, driver_hint
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.journals.memory import MemoryJournal

__all__ = ["DEFAULT_URL", "MemoryJournal", "open_journal"]

DEFAULT_URL = "sqlite:///sagaguard.db"
"""The embedded default: a SQLite file in the working directory (next to the effect store)."""


def open_journal(url: str = DEFAULT_URL, *, clock: Callable[[], float] | None = None) -> SagaJournal:
    """Open the journal a URL names.

    - ``memory://``: :class:`MemoryJournal` (one process, nothing survives it).
    - ``sqlite:///path.db``, ``postgresql://user@host/db``: :class:`~sagaguard.saga.journals.sql.SqlJournal`.
    - ``redis://host:port/db``, ``rediss://``, ``unix://``, and a Redis Cluster's
      ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://``):
      :class:`~sagaguard.saga.journals.redis.RedisJournal`.

    Raises:
        ConfigurationError: ``url`` is not a string, is malformed, has an unknown scheme, or leaves
            the host or database to a driver default (see
            :func:`~sagaguard.idempotency.backends.urls.check_url`).
        JournalUnavailable: the backend cannot be reached.
    """
    scheme = check_url(url, what="journal")
    if scheme == "memory":
        return MemoryJournal(clock=clock)
    if scheme in ("sqlite", "postgresql"):
        from sagaguard.saga.journals.sql import SqlJournal

        return SqlJournal(url, clock=clock)
    if scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        try:
            from sagaguard.saga.journals.redis import RedisJournal
        except ImportError as exc:  # redis-py is not installed
            raise ConfigurationError(f"cannot use journal URL: {exc} ({driver_hint(exc)})") from exc
        return RedisJournal(url, clock=clock)
    raise AssertionError(f"check_url returned an unknown scheme {scheme!r}")  # pragma: no cover
