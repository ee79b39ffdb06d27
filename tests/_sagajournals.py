"""Saga journals for the tests, on every backend, each test on its own data set; and a child process.

``JournalFactory`` opens journals of one backend ("memory", "sqlite", "postgres", "redis", and
"cluster": Redis Cluster, with the ``redis_cluster`` fixture's cluster passed in) on one
isolated data set (a SQLite file in ``tmp_path``, a unique Postgres table prefix, a unique Redis key
prefix) and deletes it afterwards. ``open()`` gives another instance on the same data (a second
worker); ``spec()`` tells a child process (``tests/_sagachild.py``) how to open it.

Postgres and Redis are found as in ``conftest.py``: a service that does not answer skips its tests,
unless ``CI=true``, where it fails them.

Test modules build their fixtures with :func:`factory_for` (parametrised over :data:`JOURNALS`, or
:data:`SHARED_SQL` for multi-process tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _rediscluster import LocalCluster
from conftest import FakeClock, delete_cluster_prefix, require_postgres, require_redis

from sagaguard.idempotency import Guard
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores.memory import MemoryStore
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.journals.memory import MemoryJournal

JOURNALS = ("memory", "sqlite", "postgres", "redis")
SHARED_SQL = ("sqlite", "postgres")
_CLOCK: Any = object()


def open_journal_backend(
    backend: str, url: str, *, clock: Callable[[], float] | None, prefix: str | None
) -> SagaJournal:
    """One journal of ``backend`` on the data set ``prefix`` (also used by the child process)."""
    if backend == "memory":
        return MemoryJournal(clock=clock)
    if backend in ("sqlite", "postgres"):
        from sagaguard.saga.journals.sql import SqlJournal

        return SqlJournal(url, clock=clock, table_prefix=prefix or "sagaguard_")
    if backend in ("redis", "cluster"):
        from sagaguard.saga.journals.redis import RedisJournal

        return RedisJournal(url, clock=clock, prefix=prefix or "sgj")
    raise ValueError(f"unknown journal backend {backend!r}")


def open_store_backend(
    backend: str, url: str, *, clock: Callable[[], float] | None, prefix: str | None
) -> IdempotencyStore:
    """The guard's store on the same backend and data set as the journal."""
    if backend == "memory":
        return MemoryStore(clock=clock)
    if backend in ("sqlite", "postgres"):
        from sagaguard.idempotency.stores.sql import SqlStore

        return SqlStore(url, clock=clock, table_name=f"{prefix}effects")
    from sagaguard.idempotency.stores.redis import RedisStore

    return RedisStore(url, clock=clock, prefix=f"{prefix}fx")


@dataclass
class JournalFactory:
    """Journals of one backend on one isolated data set; cleans up after itself."""

    backend: str
    url: str
    clock: FakeClock
    prefix: str
    _opened: list[SagaJournal] = field(default_factory=list, repr=False)
    _stores: list[IdempotencyStore] = field(default_factory=list, repr=False)
    _memory: MemoryJournal | None = field(default=None, repr=False)
    _memory_store: MemoryStore | None = field(default=None, repr=False)

    def open(self, *, clock: Callable[[], float] | None = _CLOCK) -> SagaJournal:
        """Another journal on the same data (the memory journal: the same instance)."""
        chosen = self.clock if clock is _CLOCK else clock
        if self.backend == "memory":
            if self._memory is None:
                self._memory = MemoryJournal(clock=chosen)
            return self._memory
        journal = open_journal_backend(self.backend, self.url, clock=chosen, prefix=self.prefix)
        self._opened.append(journal)
        return journal

    def store(self) -> IdempotencyStore:
        """The guard's store for this data set (on the factory's clock)."""
        if self.backend == "memory":
            if self._memory_store is None:
                self._memory_store = MemoryStore(clock=self.clock)
            return self._memory_store
        store = open_store_backend(self.backend, self.url, clock=self.clock, prefix=self.prefix)
        self._stores.append(store)
        return store

    def guard(self) -> Guard:
        """A guard on :meth:`store` that never sleeps."""
        return Guard(self.store(), sleep=lambda _s: None)

    def spec(self) -> dict[str, Any]:
        """How a child process opens this data set."""
        return {"backend": self.backend, "url": self.url, "prefix": self.prefix}

    def cleanup(self) -> None:
        for journal in self._opened:
            journal.close()
        for store in self._stores:
            store.close()
        if self.backend == "postgres":
            import psycopg
            from psycopg import sql

            tables = (
                "saga_signals",
                "saga_steps",
                "sagas",
                "effects",
                "effects_version",
                "effects_ledger",
                "journal_version",
            )
            with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
                for table in tables:
                    conn.execute(
                        sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(sql.Identifier(self.prefix + table))
                    )
        elif self.backend == "cluster":
            delete_cluster_prefix(self.url, self.prefix)
        elif self.backend == "redis":
            import redis

            client = redis.Redis.from_url(self.url)
            try:
                keys = list(client.scan_iter(match=f"{self.prefix}*", count=1000))
                for start in range(0, len(keys), 500):
                    client.delete(*keys[start : start + 500])
            finally:
                client.close()


def make_factory(
    backend: str, clock: FakeClock, tmp_path: Path, cluster: LocalCluster | None = None
) -> JournalFactory:
    unique = uuid.uuid4().hex[:10]
    if backend == "memory":
        return JournalFactory("memory", "memory://", clock, f"m{unique}_")
    if backend == "sqlite":
        return JournalFactory("sqlite", f"sqlite:///{tmp_path}/journal.db", clock, f"sg{unique}_")
    if backend == "postgres":
        return JournalFactory("postgres", require_postgres(), clock, f"sgt{unique}_")
    if backend == "redis":
        return JournalFactory("redis", require_redis(), clock, f"sgjt{unique}")
    if backend == "cluster" and cluster is not None:
        return JournalFactory("cluster", cluster.url, clock, f"sgjt{unique}")
    raise ValueError(backend)


def factory_for(
    backend: str, clock: FakeClock, tmp_path: Path, cluster: LocalCluster | None = None
) -> Iterator[JournalFactory]:
    """The body of a ``journal_factory`` fixture: a factory for ``backend``, cleaned up after.

    Test modules define their fixtures with it (parametrised over :data:`JOURNALS` or
    :data:`SHARED_SQL`)::

        @pytest.fixture(params=JOURNALS)
        def journal_factory(request, clock, tmp_path):
            yield from factory_for(request.param, clock, tmp_path)
    """
    factory = make_factory(backend, clock, tmp_path, cluster)
    try:
        yield factory
    finally:
        factory.cleanup()


# ------------------------------------------------------------------------------- child processes

CHILD = Path(__file__).resolve().parent / "_sagachild.py"


def start_child(config: dict[str, Any], *, gate: bool = False) -> subprocess.Popen[str]:
    """Start ``tests/_sagachild.py``; with ``gate`` it says ``ready`` and waits for a stdin line."""
    root = str(CHILD.parent.parent)
    path = os.pathsep.join(p for p in (root, str(CHILD.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps({**config, "gate": gate})],
        stdin=subprocess.PIPE if gate else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    if gate:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            proc.kill()
            _, err = proc.communicate()
            raise AssertionError(f"saga child said {line!r}, not 'ready':\n{err}")
    return proc


def finish_child(proc: subprocess.Popen[str], *, go: bool = False, timeout: float = 60.0) -> dict[str, Any]:
    """Open the gate (``go``), wait for the child, return its JSON report."""
    try:
        out, err = proc.communicate("go\n" if go else None, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"saga child hung:\n{out}\n{err}") from None
    assert proc.returncode == 0, f"saga child exited {proc.returncode}:\n{out}\n{err}"
    lines = out.strip().splitlines()
    assert lines, f"saga child printed nothing:\n{err}"
    return dict(json.loads(lines[-1]))


def run_child(config: dict[str, Any]) -> dict[str, Any]:
    """Run the child to its end and return its report."""
    return finish_child(start_child(config))
