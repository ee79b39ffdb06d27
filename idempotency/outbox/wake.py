"""How an idle relay waits: for a Postgres NOTIFY, for its poll interval, or for a stop.

A NOTIFY is only a hint (it fires at commit, is not replayed to a listener that was away, and
carries nothing we rely on): the relay claims after every wake-up and polls anyway, so a lost
notification costs at most one poll interval. A listener whose connection breaks falls back to
polling and listens again later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from typing import Any

import sqlalchemy as sa

__all__ = ["Waker"]

log = logging.getLogger("sagaguard.outbox.relay")

_RELISTEN_AFTER = 5.0


class Waker:
    """Waits until woken: by :meth:`wake` (any thread), by a NOTIFY on ``channel`` (Postgres, when
    ``listen``), or by the timeout.

    Args:
        engine: the outbox's engine; on Postgres one pooled connection is held for LISTEN.
        channel: the NOTIFY channel (the outbox table's name).
        listen: False polls only.
    """

    def __init__(self, engine: sa.Engine, channel: str, *, listen: bool = True) -> None:
        self._engine = engine
        self._channel = channel
        self._listen = listen and engine.dialect.name == "postgresql"
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        self._fairy: Any = None
        self._conn: Any = None
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self.notified = 0
        """NOTIFYs received so far."""

    @property
    def mode(self) -> str:
        """``notify`` while listening, else ``poll``."""
        return "notify" if self._conn is not None else "poll"

    def start(self) -> None:
        """Start listening now (a relay does it before its first claim, so no NOTIFY is missed
        between that claim and its first wait). Failing to listen falls back to polling."""
        if self._listen and self._conn is None and time.monotonic() >= self._retry_at:
            try:
                fairy = self._engine.raw_connection()
                conn: Any = fairy.driver_connection
                conn.autocommit = True
                quoted = self._engine.dialect.identifier_preparer.quote(self._channel)
                conn.execute(f"LISTEN {quoted}")
            except Exception as exc:
                log.warning("cannot LISTEN for outbox wake-ups (polling instead): %s", exc)
                self._retry_at = time.monotonic() + _RELISTEN_AFTER
                with contextlib.suppress(Exception):
                    fairy.invalidate()
                return
            self._fairy, self._conn = fairy, conn

    def wake(self) -> None:
        """Wake the waiting thread (safe from any thread and from a signal handler)."""
        with contextlib.suppress(OSError):
            os.write(self._write, b"x")

    def wait(self, timeout: float) -> bool:
        """Block until woken or ``timeout`` seconds pass; True when woken (NOTIFY or :meth:`wake`)."""
        self.start()
        watched = [self._read]
        if self._conn is not None:
            watched.append(self._conn.fileno())
        try:
            ready, _, _ = select.select(watched, [], [], max(0.0, timeout))
        except (OSError, ValueError):  # the listener's socket went away under us
            self._drop("listener socket closed")
            return False
        woken = False
        if self._read in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read, 512):
                    pass
            woken = True
        if self._conn is not None and self._conn.fileno() in ready:
            try:
                got = sum(1 for _ in self._conn.notifies(timeout=0))
            except Exception as exc:
                self._drop(str(exc))
                return woken
            self.notified += got
            woken = woken or got > 0
        return woken

    def _drop(self, reason: str) -> None:
        log.warning("outbox listener lost (%s): polling until it is back", reason)
        fairy, self._fairy, self._conn = self._fairy, None, None
        self._retry_at = time.monotonic() + _RELISTEN_AFTER
        if fairy is not None:
            with contextlib.suppress(Exception):
                fairy.invalidate()

    def unlisten(self) -> None:
        """Stop listening and give the connection back to the pool (:meth:`wait` listens again)."""
        fairy, conn, self._fairy, self._conn = self._fairy, self._conn, None, None
        if conn is not None:
            try:
                conn.execute("UNLISTEN *")
                conn.autocommit = False
                fairy.close()
            except Exception:
                with contextlib.suppress(Exception):
                    fairy.invalidate()

    def close(self) -> None:
        """Stop listening and release everything. Idempotent; the waker is not used again."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.unlisten()
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
