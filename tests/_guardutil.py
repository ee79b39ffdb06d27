"""Helpers for the guard tests (test_guard.py, test_guard_async.py): result types, call counters,
an injectable sleep, identities, a span exporter, a multi-process race, and a store used across a
fork (the backends' connection tests)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from sagaguard.idempotency.keys import EffectIdentity, fingerprint
from sagaguard.idempotency.records import Record
from sagaguard.idempotency.store import IdempotencyStore

LEASE = 30.0
"""The lease the guard tests use (seconds of the fake clock)."""

RETENTION = 3600.0
NAMESPACE = "default"

# ------------------------------------------------------------------------------- result types
# At module level: the guard resolves return annotations with typing.get_type_hints.


@dataclasses.dataclass(frozen=True)
class Receipt:
    id: str
    amount: int
    customer: str


class Line(BaseModel):
    sku: str
    quantity: int


class Invoice(BaseModel):
    number: str
    total: Decimal
    lines: list[Line]


class Plain:
    """Neither a dataclass nor a pydantic model: cannot be stored as JSON."""

    def __init__(self, value: int = 0) -> None:
        self.value = value


class Declined(Exception):
    """A permanent provider error carrying two arguments."""


class RateLimited(Exception):
    """A retryable provider error."""


# ------------------------------------------------------------------------------- recorders


class Calls:
    """Counts calls of an effect body (thread-safe) and keeps what each call saw."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.n = 0
        self.seen: list[Any] = []

    def hit(self, seen: Any = None) -> int:
        with self._lock:
            self.n += 1
            self.seen.append(seen)
            return self.n


class Sleeper:
    """An injected ``sleep``/``async_sleep``: records each pause and advances the fake clock by it.

    ``hook(n)`` runs inside the n-th sleep (1-based), e.g. to let another worker finish meanwhile.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock
        self.pauses: list[float] = []
        self.hook: Callable[[int], None] | None = None

    def __call__(self, seconds: float) -> None:
        self.pauses.append(seconds)
        advance = getattr(self.clock, "advance", None)
        if advance is not None:
            advance(seconds)
        if self.hook is not None:
            self.hook(len(self.pauses))

    async def asleep(self, seconds: float) -> None:
        self(seconds)

    @property
    def total(self) -> float:
        return sum(self.pauses)


def forbidden_sleep(seconds: float) -> None:
    """For guards whose sync sleep must never be used (async effects)."""
    raise AssertionError(f"the sync sleep was called ({seconds}s) by an async effect")


async def forbidden_async_sleep(seconds: float) -> None:
    raise AssertionError(f"the async sleep was called ({seconds}s) by a sync effect")


# ------------------------------------------------------------------------------- identities


def identity(scope_id: str, name: str, ordinal: int = 0, namespace: str = NAMESPACE) -> EffectIdentity:
    """The identity a guard derives for the ``ordinal``-th call of ``name`` in ``scope_id``."""
    return EffectIdentity.of(namespace, scope_id, name, ordinal)


def explicit(key: str, name: str, namespace: str = NAMESPACE) -> EffectIdentity:
    return EffectIdentity.explicit(namespace, key, name)


def fp(**arguments: Any) -> str:
    """The fingerprint the guard computes for these bound arguments."""
    return fingerprint(arguments)


def all_records(store: IdempotencyStore) -> list[Record]:
    return store.list(limit=10_000)


# --------------------------------------------------------------------------------- TCP proxy


class TcpProxy:
    """Forwards a local port to a server until :meth:`cut`: a database that goes away on demand.

    After ``cut()`` the port refuses connections and every forwarded connection is closed, as if
    the server had died or the network had partitioned.
    """

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._cut:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


# ------------------------------------------------------------------------------ OpenTelemetry


@functools.cache
def span_exporter() -> Any:
    """An ``InMemorySpanExporter`` on the global SDK tracer provider, installed once per process.

    The global provider can be set only once; if an SDK provider is already set (by another test
    module), the exporter is added to it. Returns None when a non-SDK provider is already set.
    ``sagaguard.idempotency.telemetry.tracer`` is a proxy, so it follows the provider set here.
    """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        return None
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


# ------------------------------------------------------------------------- process race

_PRELOAD = [
    "_guardutil", "_procs", "sagaguard.idempotency.guard", "sagaguard.idempotency.stores.sql",
    "sagaguard.idempotency.stores.redis",
]  # fmt: skip
"""Imported once by the fork server, so each racer is a cheap fork instead of a fresh interpreter."""


def race_effect_in_processes(
    spec: dict[str, Any],
    *,
    scope_id: str,
    name: str,
    log: Path,
    processes: int = 8,
    timeout: float = 120.0,
) -> list[dict[str, Any]]:
    """Start ``processes`` processes that each open the store and call one guarded effect at once.

    Each process opens the store ``spec`` describes (``StoreFactory.spec()``) on the server's own
    clock, builds its own guard, waits at a barrier with the others, then calls the effect in
    ``scope_id``. The effect body appends a line to ``log`` (counted by the caller, outside the code
    under test) and returns the provider key it was given. Returns one dict per process: ``result``
    or ``error``.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # ignored if the fork server already runs
    barrier = ctx.Barrier(processes + 1)
    results = ctx.Queue()
    child_spec = {**spec, "scope": scope_id, "name": name, "log": str(log)}
    procs = [ctx.Process(target=_racer, args=(child_spec, barrier, results)) for _ in range(processes)]
    try:
        for proc in procs:
            proc.start()
        # Released together with every racer; broken if one failed to open (its error is queued).
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=timeout)
        outcomes = [results.get(timeout=timeout) for _ in procs]
        for proc in procs:
            proc.join(timeout=timeout)
            assert proc.exitcode == 0, f"racer exited {proc.exitcode}: {outcomes}"
        return outcomes
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def _racer(spec: dict[str, Any], barrier: Any, results: Any) -> None:
    from _procs import open_backend

    from sagaguard.idempotency.effect import current_effect
    from sagaguard.idempotency.guard import Guard
    from sagaguard.idempotency.keys import scope

    outcome: dict[str, Any]
    try:
        store = open_backend(
            spec["backend"], spec["url"], clock=None, table_name=spec["table_name"], prefix=spec["prefix"]
        )
        guard = Guard(store, lease=LEASE, wait=60.0)

        @guard.effect(spec["name"])
        def effect(amount: int) -> str:
            with open(spec["log"], "a", encoding="utf-8") as out:
                out.write(f"{os.getpid()}\n")
            time.sleep(0.2)  # hold the claim a while so the others must wait and replay
            return current_effect().provider_key

        store.get("warm-up")  # connect before the race, so the race is about the claim
    except BaseException as exc:
        barrier.abort()
        results.put({"error": f"opening: {type(exc).__name__}: {exc}"})
        return
    try:
        barrier.wait(timeout=60)
        with scope(spec["scope"]):
            outcome = {"result": effect(100)}
    except BaseException as exc:
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    results.put(outcome)
    guard.close()
    store.close()


def claim_then_fork(
    store: IdempotencyStore, parent: EffectIdentity, child: EffectIdentity, fingerprint: str, lease: float
) -> int:
    """Claim ``parent`` here (the store's connection is then pooled or kept), fork, and in the child
    claim and complete ``child`` (result ``"2"``) on the same store object; fails unless the child
    exited cleanly. Returns the parent's token, for the caller to complete ``parent`` on what the
    parent kept."""
    claimed = store.claim(parent, fingerprint, lease).record
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            got = store.claim(child, fingerprint, lease).record
            store.complete(child.key, got.token, "2", 60.0)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return claimed.token


def caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``exc`` is a ``kind``, or has one in its chain of causes and contexts (a framework
    that wraps a tool's exception keeps it there)."""
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
