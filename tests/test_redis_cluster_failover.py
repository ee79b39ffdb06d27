"""A Redis Cluster primary SIGKILLed in the middle of guarded calls: no acknowledged claim is lost.

The store waits for a replica after each claim (the default on a cluster), so a claim the guard acts
on is on the replica promoted in the dead primary's place. Four threads charge their own orders at
a counter service through the guard (with a reconciler that asks the service, as a real payment
integration would); the primary of one third of the slots is SIGKILLed once a few dozen charges
went through, its replica is promoted, the killed node is started again and rejoins as a replica.
Calls in flight fail closed with sagaguard's typed errors and are retried; at the end the service
counts exactly one charge per order. Runs with ``-m cluster`` (its own cluster: it kills a node).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from _rediscluster import ClusterStartError, LocalCluster, cluster_problem
from conftest import require_service
from redis.cluster import RedisCluster

from sagaguard.idempotency import Guard, current_effect, scope
from sagaguard.idempotency.backends.redis_client import connect
from sagaguard.idempotency.errors import IdempotencyError
from sagaguard.idempotency.stores.redis import RedisStore
from sagaguard.idempotency.testing import Charge, CounterClient, CounterService

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif("'cluster' not in config.getoption('markexpr')", reason="runs with -m cluster"),
    pytest.mark.timeout(240),
]

WORKERS = 4
ORDERS = 25
"""Orders per worker thread."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require_service("Redis Cluster", cluster_problem())
    local = LocalCluster(Path(tmp_path_factory.mktemp("failover")))
    try:
        local.start()
    except ClusterStartError as exc:
        local.stop()
        require_service("Redis Cluster", str(exc))
    yield local
    local.stop()


def _failed_over(port: int, victim: int) -> bool:
    """Whether the node on ``port`` sees the cluster ok with another primary for the victim's slots."""
    import redis

    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            return False
        primaries = {int(entry[2][1]) for entry in client.execute_command("CLUSTER SLOTS")}
        return victim not in primaries and len(primaries) == 3
    except redis.RedisError:
        return False
    finally:
        client.close()


def test_a_primary_killed_mid_run_loses_no_acknowledged_claim(cluster: LocalCluster) -> None:
    prefix = f"sgfo-{uuid.uuid4().hex[:8]}"
    errors: Counter[str] = Counter()
    untyped: list[BaseException] = []
    in_flight = 0
    lock = threading.Lock()
    done = threading.Event()

    with CounterService() as service:
        client = CounterClient(service.url)
        store = RedisStore(cluster.url, prefix=prefix, replica_timeout=0.5)
        guard = Guard(store, namespace="failover", lease=1.0, wait=30.0)

        @guard.effect("charge", reconciler=client.reconciler())
        def charge(order: str) -> Charge:
            return client.charge(order, 100, provider_key=current_effect().provider_key)

        def worker(n: int) -> None:
            nonlocal in_flight
            deadline = time.monotonic() + 120
            for i in range(ORDERS):
                order = f"{prefix}-w{n}-o{i}"
                while time.monotonic() < deadline:
                    with lock:
                        in_flight += 1
                    try:
                        with scope(order):
                            charge(order)
                        break
                    except IdempotencyError as exc:  # typed: the guard's and the store's errors
                        errors[type(exc).__name__] += 1
                        time.sleep(0.1)  # a worker's back-off, not a measurement
                    except Exception as exc:
                        untyped.append(exc)
                        return
                    finally:
                        with lock:
                            in_flight -= 1

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(WORKERS)]
        for thread in threads:
            thread.start()
        probe, _ = connect(cluster.url, "probe")
        assert isinstance(probe, RedisCluster)
        victim = probe.get_primaries()[0].port
        probe.close()
        while sum(client.counts().values()) < 30:  # some charges went through before the fault
            time.sleep(0.05)
        with lock:
            at_fault = in_flight
        faulted = time.monotonic()
        cluster.kill(victim)
        survivor = next(p for p in cluster.ports if p != victim)
        while not _failed_over(survivor, victim):  # until its replica is promoted
            time.sleep(0.1)
        promoted = time.monotonic()
        cluster.restart(victim)  # it rejoins as the replica the new primary waits for
        for thread in threads:
            thread.join(timeout=180)
        finished = time.monotonic()
        done.set()
        counts = client.counts()
        guard.close()
        store.close()

    orders = {f"{prefix}-w{n}-o{i}" for n in range(WORKERS) for i in range(ORDERS)}
    print(  # the figures the docs quote; nothing below asserts a duration
        f"\ncalls in flight at the fault: {at_fault}; errors seen: {dict(errors)}; "
        f"replica promoted after {promoted - faulted:.1f} s; "
        f"all orders done {finished - faulted:.1f} s after the fault"
    )
    assert untyped == [], untyped  # every failure was one of sagaguard's typed errors
    assert not any(t.is_alive() for t in threads)
    assert errors, "no call failed: the fault did not hit a call in flight"
    assert set(counts) == orders  # every order was charged...
    assert {o: c for o, c in counts.items() if c != 1} == {}  # ...exactly once: 0 duplicates
