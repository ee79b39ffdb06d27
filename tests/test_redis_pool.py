"""A Redis store opened from a URL has a blocking pool: more threads than connections wait for one.

With redis-py's default pool (100 connections, raising past them) the 101st concurrent call failed
with ``StoreUnavailable('redis is unavailable: Too many connections')``. Real Redis.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
from conftest import require_redis

from sagaguard.idempotency import ConfigurationError, Guard, scope
from sagaguard.idempotency.stores.redis import RedisStore

THREADS = 128


@pytest.fixture
def small_pool() -> Iterator[RedisStore]:
    prefix = f"sg-pool-{uuid.uuid4().hex[:8]}"
    store = RedisStore(require_redis(), prefix=prefix, max_connections=8)
    try:
        yield store
    finally:
        for key in store._client.scan_iter(match=f"{prefix}:*"):
            store._client.delete(key)
        store.close()


def test_more_threads_than_connections_wait_for_one_and_every_call_runs(small_pool: RedisStore) -> None:
    guard = Guard(small_pool)
    runs: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS, timeout=30)

    @guard.effect("pool.call")
    def call(n: int) -> int:
        runs.append(n)
        return n

    def worker(n: int) -> None:
        try:
            start.wait()
            with scope(f"t-{n}"):
                assert call(n) == n
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    guard.close()
    assert errors == []
    assert sorted(runs) == list(range(THREADS))
    assert small_pool._client.connection_pool.max_connections == 8  # they shared eight


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_a_bad_pool_size_is_a_configuration_error(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="max_connections"):
        RedisStore("redis://127.0.0.1:6379/0", max_connections=bad)  # type: ignore[arg-type]
