"""The relay: claims messages, hands each to its handler, and settles the batch.

::

    relay = Relay(outbox, engine)          # outbox: the Outbox whose handlers deliver
    relay.run()                            # until relay.stop() (or SIGTERM in `sagaguard relay`)

One round: claim a batch (see :mod:`sagaguard.idempotency.outbox.claims`), deliver it (the messages of one
aggregate one after the other, in id order; different aggregates in parallel up to
``concurrency``), then settle it in one statement: delivered, retried after a backoff (tenacity's
wait strategies, with jitter), dead-lettered (after ``max_attempts``, or at once for a permanent
error), or released untried. A failure stops its aggregate's run for this round: the rest of that
aggregate is released, so it waits behind the failed message. A round that claimed something is
followed at once by another; an empty one waits for a NOTIFY (Postgres) or the poll interval.

Delivery is at least once: a relay that dies after its handler ran and before its ack leaves the
claim to expire, and another relay delivers the message again, with the same
:attr:`Message.provider_key`, which a provider that deduplicates absorbs (or the guard replays,
for effects deferred with :meth:`Outbox.effect`).

Graceful stop (:meth:`Relay.stop`, SIGTERM/SIGINT under ``sagaguard relay``): the message being
delivered is finished, the batch's untried messages are released (their attempt not counted), the
batch is settled, and the relay returns. A long batch renews its leases as it goes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
import tenacity
from opentelemetry import trace

from sagaguard.idempotency.errors import ConfigurationError, StoreError
from sagaguard.idempotency.outbox.claims import Claimed, OutboxDb, Settle, _uuid_text
from sagaguard.idempotency.outbox.control import OutboxControl
from sagaguard.idempotency.outbox.model import DEFAULT_TABLE, MessageStatus, check_schema
from sagaguard.idempotency.outbox.policy import (
    Handler,
    RelaySettings,
    RelayStats,
    decode,
    default_backoff,
    failure_outcome,
    released,
)
from sagaguard.idempotency.outbox.records import Message, _current
from sagaguard.idempotency.outbox.renewal import ClaimRenewer
from sagaguard.idempotency.outbox.telemetry import (
    dead_counter,
    delivered_counter,
    failed_counter,
    record_status,
    send_span,
    tracing_enabled,
)
from sagaguard.idempotency.outbox.wake import Waker

__all__ = ["Handler", "Relay", "RelaySettings", "RelayStats", "default_backoff", "failure_outcome"]

log = logging.getLogger("sagaguard.outbox.relay")


class _Loop:
    """One event loop in a daemon thread, for async handlers (made on first use)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="sagaguard-relay-loop", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
        return asyncio.run_coroutine_threadsafe(make(), self._loop).result()

    def close(self) -> None:
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            loop.close()


class Relay:
    """Delivers outbox messages to their handlers. Run several, in several processes: they share
    the work through leases and ``SKIP LOCKED``.

    Args:
        handlers: an :class:`~sagaguard.idempotency.outbox.Outbox` (its handlers and table), or a mapping of
            message type to handler.
        engine: the database (an engine, a URL, or an :class:`OutboxDb`).
        settings: see :class:`RelaySettings`.
        table_name: the outbox table (default: the Outbox's, else ``sagaguard_outbox``).
        worker_id: this relay's name in the table (default: host:pid:random).
        clock: seconds since the epoch for every time the relay writes or compares; inject one to
            test backoff and lease expiry without sleeping. Default: the database's clock.

    Raises:
        ConfigurationError: bad settings or database (a URL is checked as
            :func:`~sagaguard.idempotency.backends.urls.check_url` does).
    """

    def __init__(
        self,
        handlers: Any,
        engine: sa.Engine | str | OutboxDb,
        settings: RelaySettings | None = None,
        *,
        table_name: str | None = None,
        worker_id: str | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.settings = settings or RelaySettings()
        found = getattr(handlers, "handlers", handlers)
        if not isinstance(found, Mapping):
            raise ConfigurationError("handlers must be an Outbox or a mapping of message type to handler")
        self._handlers: Mapping[str, Handler] = found
        table = str(table_name or getattr(handlers, "table_name", DEFAULT_TABLE))
        self._owned_engine: sa.Engine | None = None
        if isinstance(engine, OutboxDb):
            self.db = engine
        else:
            if not isinstance(engine, sa.Engine):
                from sagaguard.idempotency.backends.urls import check_url
                from sagaguard.idempotency.stores.sql import make_engine

                if check_url(engine, what="outbox database") not in ("sqlite", "postgresql"):
                    raise ConfigurationError("the outbox lives in SQLite or Postgres, not this URL's backend")
                engine = self._owned_engine = make_engine(str(engine))
            self.db = OutboxDb(
                engine,
                table,
                clock=clock,
                poison_blocks_aggregate=self.settings.poison_blocks_aggregate,
                synchronous_commit=self.settings.synchronous_commit,
            )
        self.control = OutboxControl(self.db)
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        self._renewer = ClaimRenewer(f"sagaguard-relay-renew-{self.worker_id}")
        self._clock = clock
        self._stop = threading.Event()
        self._waker = Waker(self.db.engine, self.db.table_name, listen=self.settings.listen)
        self._loop = _Loop()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stats = RelayStats(worker_id=self.worker_id)
        self._stats_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._next_purge = 0.0
        self._next_status = 0.0
        self._checked = False
        self._async_handlers: dict[Any, bool] = {}

    # -- public --------------------------------------------------------------------------------

    def stats(self) -> RelayStats:
        """A copy of the counters."""
        with self._stats_lock:
            return replace(self._stats, wake_mode=self._waker.mode)

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Ask the relay to stop after the message in hand (safe from a signal handler)."""
        self._stop.set()
        self._waker.wake()

    def run_once(self) -> int:
        """One round: claim a batch, deliver it, settle it. Returns how many messages were claimed.

        Raises:
            StoreUnavailable, StoreError: the claim failed (nothing was delivered).
            ConfigurationError: the outbox table is missing or of another schema version.
        """
        if not self._checked:
            check_schema(self.db.engine, self.db.table_name)
            self._checked = True
        batch = self.db.claim(self.worker_id, self.settings.batch_size, self.settings.lease)
        if not batch:
            return 0
        with self._stats_lock:
            self._stats.claimed += len(batch)
            self._stats.batches += 1
        outcomes: dict[Any, Settle] = {}
        started: set[Any] = set()
        try:
            self._deliver_batch(batch, outcomes, started)
        finally:
            # Also on KeyboardInterrupt/SystemExit from a handler: settle what is known and give
            # back what was never tried. The message in hand stays claimed: it may have been sent,
            # so it is left to expire and be delivered again under its provider key.
            for claimed in batch:
                if claimed.ref not in outcomes and claimed.ref not in started:
                    outcomes[claimed.ref] = released(claimed)
            self._settle(batch, outcomes)
        return len(batch)

    def run(self, *, until_idle: bool = False) -> RelayStats:
        """Deliver until :meth:`stop` (or, with ``until_idle``, until a round claims nothing).

        A database that cannot be reached is waited for (polling), never fatal.

        Raises:
            ConfigurationError: the outbox table is missing or of another schema version.
        """
        with self._stats_lock:
            self._stats.started_at = time.time()
        pause = self.settings.poll_interval
        try:
            self._waker.start()
            while not self._stop.is_set():
                self._maintain()
                try:
                    claimed = self.run_once()
                except StoreError as exc:
                    log.warning("outbox relay %s: claim failed: %s", self.worker_id, exc)
                    with self._stats_lock:
                        self._stats.last_error = str(exc)
                    self._waker.wait(pause)
                    pause = min(pause * 2, 30.0)
                    continue
                pause = self.settings.poll_interval
                if claimed:
                    continue
                if until_idle:
                    break
                self._waker.wait(self.settings.poll_interval)
        finally:
            self._waker.unlisten()  # give the listening connection back; run() may be called again
        return self.stats()

    def start(self) -> None:
        """Run in a background thread (:meth:`stop` ends it)."""
        if self._thread is not None:
            raise ConfigurationError("this relay is already running")
        name = f"sagaguard-relay-{self.worker_id}"
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop gracefully: finish the message in hand, release the rest, settle, return."""
        self.request_stop()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    def close(self) -> None:
        """Stop and release threads (and the engine's connections if the relay made the engine)."""
        self.stop()
        self._renewer.close()
        self._waker.close()
        self._loop.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._owned_engine is not None:
            self._owned_engine.dispose()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- a round ------------------------------------------------------------------------------

    def _mark(self) -> float:
        """Now, for measuring how long a batch has held its claims (the injected clock in tests)."""
        return self._clock() if self._clock is not None else time.monotonic()

    def _deliver_batch(self, batch: list[Claimed], outcomes: dict[Any, Settle], started: set[Any]) -> None:
        groups: dict[tuple[str, str], list[Claimed]] = {}
        if self.settings.concurrency > 1:
            for claimed in batch:
                groups.setdefault((claimed.aggregatetype, claimed.aggregateid), []).append(claimed)
        lock = threading.Lock()
        tracing = tracing_enabled()
        held = {c.ref: c for c in batch}  # every claim of the batch stays ours until it is settled
        lost: set[Any] = set()
        claimed_at = self._mark()
        renew_after = self.settings.lease / 2

        def record(settle: Settle) -> None:
            with lock:
                outcomes[settle.ref] = settle

        renewing = threading.Lock()

        def renew() -> None:
            # Called by the renewer thread while a handler runs, and between messages (which is
            # what an injected clock sees); one renewal at a time, the other caller skips.
            nonlocal claimed_at
            if self._mark() - claimed_at < renew_after or not renewing.acquire(blocking=False):
                return
            try:
                with lock:
                    still = list(held.values())
                gone = self.db.extend(batch[0].token, still, self.settings.lease)
                with lock:
                    lost.update(gone)
                    for ref in gone:
                        held.pop(ref, None)
                claimed_at = self._mark()
            finally:
                renewing.release()

        def run_group(group: list[Claimed]) -> None:
            for index, claimed in enumerate(group):
                if self._stop.is_set() or claimed.ref in lost:
                    for rest in group[index:]:
                        if rest.ref not in lost:
                            record(released(rest))
                    return
                with lock:
                    started.add(claimed.ref)
                settle = self._deliver(claimed, tracing)
                record(settle)
                if settle.status != MessageStatus.DELIVERED:
                    for rest in group[index + 1 :]:
                        record(released(rest))
                    return

        # One renewer on every path: the claims are renewed while a handler runs, not only between
        # messages, so a handler slower than the lease keeps its message (docs/outbox.md).
        every = renew_after / 2
        if self.settings.concurrency == 1 or len(groups) <= 1:
            # The common case, kept lean: the batch in id order (so each aggregate's messages in
            # their order), one at a time in this thread, no locks taken per message.
            blocked: set[tuple[str, str]] = set()
            with self._renewer.renewing(renew, every):
                for claimed in batch:
                    key = (claimed.aggregatetype, claimed.aggregateid)
                    if claimed.ref in lost:
                        blocked.add(key)
                        continue
                    if key in blocked or self._stop.is_set():
                        blocked.add(key)
                        outcomes[claimed.ref] = released(claimed)
                        continue
                    started.add(claimed.ref)
                    settle = outcomes[claimed.ref] = self._deliver(claimed, tracing)
                    if settle.status != MessageStatus.DELIVERED:
                        blocked.add(key)
                    if self._mark() - claimed_at >= renew_after:
                        with contextlib.suppress(StoreError):
                            renew()
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.settings.concurrency, thread_name_prefix="sagaguard-relay"
            )
        with self._renewer.renewing(renew, every):
            futures = [self._pool.submit(run_group, group) for group in groups.values()]
            concurrent.futures.wait(futures)
        for future in futures:
            future.result()  # a BaseException from a handler surfaces here

    def _deliver(self, claimed: Claimed, tracing: bool) -> Settle:
        if claimed.attempts > claimed.max_attempts:
            # Claimed more often than allowed without ever being settled: relays keep dying (or
            # losing their lease) while delivering it. Give up rather than loop forever.
            error = (
                f"gave up after {claimed.attempts - 1} claims: relays died or lost their lease delivering it"
            )
            return Settle(claimed.ref, claimed.attempts, MessageStatus.DEAD, error=error)
        span = (
            send_span(claimed.type, claimed.id, claimed.aggregateid, claimed.attempts, claimed)
            if tracing
            else None
        )
        try:
            message = decode(claimed)
            handler = self._handlers.get(claimed.type)
            if handler is None:
                raise ConfigurationError(f"no handler is registered for message type {claimed.type!r}")
            token = _current.set(message)
            try:
                if span is None:
                    self._call(handler, message, None)
                else:
                    with trace.use_span(span.span, end_on_exit=False):
                        self._call(handler, message, span.span)
            finally:
                _current.reset(token)
        except Exception as exc:
            if span is not None:
                span.failed(exc)
            return failure_outcome(claimed, exc, self.settings)
        finally:
            if span is not None:
                span.end()
        return Settle(claimed.ref, claimed.attempts, MessageStatus.DELIVERED)

    def _is_async(self, handler: Handler) -> bool:
        found = self._async_handlers.get(handler)
        if found is None:
            found = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
                getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
            )
            with contextlib.suppress(TypeError):  # an unhashable callable is checked every time
                self._async_handlers[handler] = found
        return found

    def _call(self, handler: Handler, message: Message, span: trace.Span | None) -> None:
        if self._is_async(handler):

            async def call() -> Any:
                _current.set(message)
                if span is None:
                    return await handler(message)
                with trace.use_span(span, end_on_exit=False):
                    return await handler(message)

            self._loop.run(call)
            return
        result = handler(message)
        if inspect.isawaitable(result):

            async def wait() -> Any:
                return await result

            self._loop.run(wait)

    def _settle(self, batch: list[Claimed], outcomes: Mapping[Any, Settle]) -> None:
        settles = [outcomes[c.ref] for c in batch if c.ref in outcomes]
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(3),
            wait=tenacity.wait_incrementing(start=0.1, increment=0.1),
            retry=tenacity.retry_if_exception_type(StoreError),
            reraise=True,
        )
        try:
            lost: list[Any] = retrying(self.db.settle, batch[0].token, settles)
        except StoreError as exc:
            # The claims stay in flight until their lease runs out; another relay then delivers
            # them again under the same provider keys.
            log.error("outbox relay %s: cannot settle a batch: %s", self.worker_id, exc)
            with self._stats_lock:
                self._stats.last_error = str(exc)
            return
        lost_set = set(lost)
        counts = {"delivered": 0, "failed": 0, "dead": 0, "released": 0}
        for settle in settles:
            if settle.ref in lost_set:
                continue
            if settle.release:
                counts["released"] += 1
            elif settle.status == MessageStatus.DELIVERED:
                counts["delivered"] += 1
            elif settle.status == MessageStatus.DEAD:
                counts["dead"] += 1
                log.warning("outbox message %s dead-lettered: %s", _uuid_text(settle.ref), settle.error)
            else:
                counts["failed"] += 1
        if lost:
            log.warning("outbox relay %s lost %d claims to other relays", self.worker_id, len(lost))
        attrs = {"sagaguard.outbox.table": self.db.table_name}
        counters = (("delivered", delivered_counter), ("failed", failed_counter), ("dead", dead_counter))
        for name, counter in counters:
            if counts[name]:
                counter.add(counts[name], attrs)
        with self._stats_lock:
            s = self._stats
            s.delivered += counts["delivered"]
            s.failed += counts["failed"]
            s.dead += counts["dead"]
            s.released += counts["released"]
            s.lost += len(lost)

    def _maintain(self) -> None:
        """Now and then: read the status for the gauges, purge old delivered messages."""
        now = time.monotonic()
        try:
            if now >= self._next_status:
                self._next_status = now + self.settings.status_every
                status = self.control.status()
                record_status(self.db.table_name, status.depth, status.oldest_pending_age)
                with self._stats_lock:
                    self._stats.depth = status.depth
                    self._stats.oldest_age = status.oldest_pending_age
                    self._stats.dead_total = status.dead
            if self.settings.purge_every is not None and now >= self._next_purge:
                self._next_purge = now + self.settings.purge_every
                purged = self.control.purge(self.settings.retention)
                if purged:
                    log.info("outbox relay %s purged %d delivered messages", self.worker_id, purged)
        except StoreError as exc:
            log.warning("outbox relay %s: maintenance failed: %s", self.worker_id, exc)
