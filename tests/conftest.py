"""Fixtures shared by the whole test suite.

Clock
    ``clock``: a :class:`FakeClock` at ``FakeClock.START``. Inject it into stores (``clock=clock``) and
    move time with ``clock.advance(seconds)`` instead of sleeping.

Stores: one contract, every backend, real services (STYLE.md point 8)
    ``store``: one store instance, parametrised over ``memory``, ``sqlite``, ``postgres``, ``redis``
    (the test ids), using ``clock``. Each test gets its own data set: a SQLite file in ``tmp_path``,
    a fresh Postgres table, a fresh Redis key prefix; all are dropped afterwards.

    ``store_factory``: the :class:`StoreFactory` behind ``store`` (same parametrisation). Its
    ``open()`` returns another instance on the same data (a second worker, a zombie), optionally with
    ``clock=None`` for the server's own time, and ``spec()`` tells a subprocess how to open it.

    ``shared_store_factory``: like ``store_factory`` but only over the backends whose data other
    processes can see (``sqlite``, ``postgres``, ``redis``), for multi-process tests.

    ``server_clock_store``: an instance with ``clock=None`` (the database's or Redis's own time).

    :data:`CLUSTER` is one more parameter, ``cluster``: the Redis store on a local Redis Cluster
    (``redis_cluster``), marked ``cluster`` and run only with ``-m cluster`` (CI's sweep stage).
    The contract suites add it to their own parametrisation (:func:`store_factory_for`).

Redis Cluster
    ``redis_cluster``: a session's :class:`~_rediscluster.LocalCluster` (three primaries, three
    replicas on free ports, started on first use, stopped at the end). Without redis-server or
    redis-cli its tests skip; under ``CI=true`` a cluster that cannot start fails them.

Hypothesis
    The ``sagaguard`` profile (loaded here) drops the per-example deadline, which only measures how
    busy the machine is, and prints a reproduction blob on failure. ``HYPOTHESIS_PROFILE`` selects
    another registered profile.

Services
    Postgres and Redis are found at ``$SAGAGUARD_TEST_POSTGRES_URL`` (default
    ``postgresql://postgres@127.0.0.1:5432/test``) and ``$SAGAGUARD_TEST_REDIS_URL`` (default
    ``redis://127.0.0.1:6379/0``). A service that does not answer skips its tests with the reason,
    except when ``$CI`` is ``true``: there a missing service fails them, so CI can never go green by
    silently skipping a backend. Use :func:`require_postgres` / :func:`require_redis` in other
    fixtures and tests that need a service.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from _procs import open_backend
from _rediscluster import ClusterStartError, LocalCluster, cluster_problem
from hypothesis import settings

from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores.memory import MemoryStore

BACKENDS = ("memory", "sqlite", "postgres", "redis")
"""Every store backend; the ids of the ``store`` fixture's parameters."""

SHARED_BACKENDS = ("sqlite", "postgres", "redis")
"""Backends whose data another process can open."""

CLUSTER = pytest.param(
    "cluster",
    marks=[
        pytest.mark.cluster,
        pytest.mark.skipif("'cluster' not in config.getoption('markexpr')", reason="runs with -m cluster"),
    ],
    id="cluster",
)
"""The Redis store on a local Redis Cluster, as one more backend parameter (``-m cluster`` only)."""

POSTGRES_URL = os.environ.get(
    "SAGAGUARD_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("SAGAGUARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


settings.register_profile("sagaguard", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "sagaguard"))


# --------------------------------------------------------------------------------------- clock


class FakeClock:
    """A settable clock: call it for the time in seconds since the epoch.

    Thread-safe. Pass it wherever code takes ``clock: Callable[[], float]``.
    """

    START = 1_700_000_000.0

    def __init__(self, start: float = START) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    @property
    def now(self) -> float:
        """The current fake time."""
        return self()

    def set(self, when: float) -> None:
        """Jump to ``when`` (backwards too: tests of clock skew may need it)."""
        with self._lock:
            self._now = float(when)

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` and return the new time."""
        with self._lock:
            self._now += seconds
            return self._now

    def __repr__(self) -> str:
        return f"FakeClock({self._now!r})"


@pytest.fixture
def clock() -> FakeClock:
    """A fresh :class:`FakeClock` at ``FakeClock.START``."""
    return FakeClock()


# ---------------------------------------------------------------------------- service discovery


def in_ci() -> bool:
    """Whether we run under CI (``CI=true``), where a missing service is a failure."""
    return os.environ.get("CI", "").strip().lower() == "true"


def _tcp_problem(url: str, default_port: int) -> str | None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or default_port
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return None
    except OSError as exc:
        return f"nothing answers at {host}:{port} ({exc})"


@functools.cache
def postgres_problem(url: str = POSTGRES_URL) -> str | None:
    """Why Postgres at ``url`` cannot be used, or None when it answers a query. Cached."""
    problem = _tcp_problem(url, 5432)
    if problem:
        return problem
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install -e '.[dev]')"
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return f"cannot query {url}: {exc}"
    return None


@functools.cache
def redis_problem(url: str = REDIS_URL) -> str | None:
    """Why Redis at ``url`` cannot be used, or None when it answers PING. Cached."""
    problem = _tcp_problem(url, 6379)
    if problem:
        return problem
    try:
        import redis
    except ImportError:
        return "redis-py is not installed (pip install -e '.[dev]')"
    try:
        client = redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)
        try:
            client.ping()
        finally:
            client.close()
    except redis.RedisError as exc:
        return f"cannot PING {url}: {exc}"
    return None


def require_service(name: str, problem: str | None) -> None:
    """Skip the test when ``problem`` is set, or fail it under CI (``CI=true``)."""
    if problem is None:
        return
    message = f"{name} is not available: {problem}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)", False)
    pytest.skip(message)


def require_postgres() -> str:
    """The Postgres URL, after skipping (or failing under CI) when Postgres does not answer."""
    require_service("Postgres", postgres_problem(POSTGRES_URL))
    return POSTGRES_URL


def require_redis() -> str:
    """The Redis URL, after skipping (or failing under CI) when Redis does not answer."""
    require_service("Redis", redis_problem(REDIS_URL))
    return REDIS_URL


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start redis-servers of the test's own on free ports, with the given extra arguments; each
    call returns its URL. Stopped afterwards. Without redis-server installed the test is skipped
    (a failure under CI)."""
    import shutil
    import subprocess
    import time

    import redis

    require_service("redis-server", None if shutil.which("redis-server") else "redis-server is not installed")
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> str:
        port = closed_port()
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(proc)
        client = redis.Redis(port=port)
        for _ in range(500):  # until it answers (bounded; no timing assertion)
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.fail(f"redis-server {args} exited with {proc.returncode}")
                time.sleep(0.02)
        client.close()
        return f"redis://127.0.0.1:{port}/0"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A local Redis Cluster for the session (see :mod:`_rediscluster`); a test that takes it and
    cannot have it is skipped, or fails under ``CI=true``."""
    require_service("Redis Cluster", cluster_problem())
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
    except ClusterStartError as exc:
        cluster.stop()
        require_service("Redis Cluster", str(exc))
    yield cluster
    cluster.stop()


def closed_port() -> int:
    """A local TCP port that nothing listens on (just released by the OS), for unreachable tests."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------------------- stores

_FIXTURE_CLOCK: Any = object()


@dataclass
class StoreFactory:
    """Opens instances of one backend on one isolated data set, and cleans it up afterwards.

    Attributes:
        backend: "memory", "sqlite", "postgres" or "redis".
        url: the store URL.
        clock: the clock that :meth:`open` injects by default.
        table_name: the SQL table of this data set (SQL backends), else None.
        prefix: the Redis key prefix of this data set (Redis), else None.
    """

    backend: str
    url: str
    clock: Callable[[], float] | None
    table_name: str | None = None
    prefix: str | None = None
    _opened: list[IdempotencyStore] = field(default_factory=list, repr=False)
    _memory: MemoryStore | None = field(default=None, repr=False)

    @property
    def shared_between_processes(self) -> bool:
        """Whether another process can open this data set (not the memory store)."""
        return self.backend != "memory"

    def open(self, *, clock: Callable[[], float] | None = _FIXTURE_CLOCK) -> IdempotencyStore:
        """Open another instance on the same data. Closed at teardown.

        Args:
            clock: defaults to the factory's clock; ``None`` means the server's own time.

        The memory store keeps its data in the instance, so with the factory's clock it returns
        the same instance each time (two "workers" share it); with another clock, a new, empty one.
        """
        chosen = self.clock if clock is _FIXTURE_CLOCK else clock
        if self.backend == "memory":
            if chosen is self.clock:
                if self._memory is None:
                    self._memory = MemoryStore(clock=chosen)
                return self._memory
            return MemoryStore(clock=chosen)
        store = open_backend(
            self.backend, self.url, clock=chosen, table_name=self.table_name, prefix=self.prefix
        )
        self._opened.append(store)
        return store

    def spec(self) -> dict[str, Any]:
        """JSON-able arguments for :func:`_procs.open_backend` in another process."""
        return {
            "backend": self.backend,
            "url": self.url,
            "table_name": self.table_name,
            "prefix": self.prefix,
        }

    def cleanup(self) -> None:
        """Close every instance opened here and delete this data set."""
        errors: list[BaseException] = []
        for store in reversed(self._opened):
            try:
                store.close()
            except Exception as exc:
                errors.append(exc)
        self._opened.clear()
        if self.backend == "postgres" and self.table_name:
            _drop_postgres_table(self.url, self.table_name)
        elif self.backend == "redis" and self.prefix:
            _delete_redis_prefix(self.url, self.prefix)
        elif self.backend == "cluster" and self.prefix:
            delete_cluster_prefix(self.url, self.prefix)
        if errors:
            raise errors[0]


def _drop_postgres_table(url: str, table: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        conn.execute("SET lock_timeout = '5s'")
        # The table, its schema revision's table and its ledger table (the ledger id).
        for name in (table, f"{table}_version", f"{table}_ledger"):
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def _delete_redis_prefix(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        # ``*prefix*``: the store may wrap the prefix in a hash tag ({...}) for Redis Cluster.
        keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    finally:
        client.close()


def delete_cluster_prefix(url: str, prefix: str) -> None:
    """Delete every key of ``prefix`` on every primary of the cluster at ``url``."""
    from sagaguard.idempotency.backends.redis_client import connect

    client, _ = connect(url, "cleanup")
    try:
        keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:  # one DEL per key: keys of different slots cannot share one
            pipe.delete(key)
        if keys:
            pipe.execute()
    finally:
        client.close()


def _make_factory(
    backend: str, clock: FakeClock, tmp_path: Path, request: pytest.FixtureRequest | None = None
) -> StoreFactory:
    unique = uuid.uuid4().hex[:12]
    if backend == "memory":
        return StoreFactory("memory", "memory://", clock)
    if backend == "sqlite":
        return StoreFactory("sqlite", f"sqlite:///{tmp_path}/s.db", clock, table_name=f"sg_{unique}")
    if backend == "postgres":
        url = require_postgres()
        return StoreFactory("postgres", url, clock, table_name=f"sg_test_{unique}")
    if backend == "redis":
        url = require_redis()
        return StoreFactory("redis", url, clock, prefix=f"sgtest-{unique}")
    if backend == "cluster" and request is not None:
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        return StoreFactory("cluster", cluster.url, clock, prefix=f"sgtest-{unique}")
    raise ValueError(f"unknown backend {backend!r}")


def store_factory_for(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[StoreFactory]:
    """The body of a ``store_factory`` fixture over ``request.param`` (``cluster`` included): a
    factory, cleaned up after. A module adds :data:`CLUSTER` to its backends with it::

        @pytest.fixture(params=[*BACKENDS, CLUSTER])
        def store_factory(request, clock, tmp_path):
            yield from store_factory_for(request, clock, tmp_path)
    """
    factory = _make_factory(request.param, clock, tmp_path, request)
    yield factory
    factory.cleanup()


@pytest.fixture(params=BACKENDS)
def store_factory(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[StoreFactory]:
    """A :class:`StoreFactory` for each backend (ids: memory, sqlite, postgres, redis)."""
    factory = _make_factory(request.param, clock, tmp_path)
    yield factory
    factory.cleanup()


@pytest.fixture(params=SHARED_BACKENDS)
def shared_store_factory(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[StoreFactory]:
    """A :class:`StoreFactory` for each backend other processes can open (sqlite, postgres, redis)."""
    factory = _make_factory(request.param, clock, tmp_path)
    yield factory
    factory.cleanup()


@pytest.fixture
def store(store_factory: StoreFactory) -> IdempotencyStore:
    """One store instance per backend, on the injected ``clock``, with its own data set."""
    return store_factory.open()


@pytest.fixture
def server_clock_store(store_factory: StoreFactory) -> IdempotencyStore:
    """One store instance per backend on the server's own clock (``clock=None``)."""
    return store_factory.open(clock=None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``slow``, ``sweep`` or ``cluster`` runs only when its marker is selected
    (``-m slow``, as CI's sweep stage does): ``make test`` passes no ``-m``, and a marker alone does
    not deselect anything. One rule here, so a test that forgets its own ``skipif`` still stays out
    of the default suite's budget."""
    selected = config.getoption("markexpr") or ""
    for item in items:
        for name in ("slow", "sweep", "cluster"):
            if item.get_closest_marker(name) is not None and name not in selected:
                item.add_marker(pytest.mark.skip(reason=f"runs with -m {name}"))
                break
