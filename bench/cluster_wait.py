"""What waiting for a replica costs a guarded call and a saga step on a Redis Cluster (docs/backends.md).

::

    .venv/bin/python bench/cluster_wait.py redis+cluster://127.0.0.1:7000 [--calls 2000] [--rounds 2]
    .venv/bin/python bench/cluster_wait.py redis+cluster://127.0.0.1:7000 --sagas 300 [--steps 5]

Runs ``--calls`` guarded no-op calls one at a time, each on a new key, with ``wait_replicas=0`` and
``wait_replicas=1``, alternating for ``--rounds`` rounds so the machine's load weighs on both alike,
and prints the calls per second and microseconds per call of each.

With ``--sagas``, runs that many sagas of ``--steps`` guarded no-op steps instead (a ``RedisJournal``
and a ``RedisStore`` on the cluster, both with the same ``wait_replicas``), one at a time, and
prints the microseconds per step and the commands the clients sent per step, counted by the
primaries themselves (``INFO commandstats``, summed over them): the scripts (``EVALSHA``, the
journal's and the store's), the ``WAIT`` riding behind them, and the due index's ``ZADD`` (a saga's
start) and ``ZREM`` (its end). A script and its ``WAIT`` go in one pipeline, one round trip; a
``ZADD`` shares the start's pipeline when one primary serves both keys, and has one of its own
otherwise (with ``WAIT``, ahead of the script; without, in parallel with it).

Writes only keys under its own prefixes and deletes them.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections import Counter
from typing import Any

from redis.cluster import RedisCluster

from sagaguard.idempotency import Guard
from sagaguard.idempotency.backends.redis_client import connect
from sagaguard.idempotency.stores.redis import RedisStore
from sagaguard.saga import Saga, SagaRunner, SagaState, StepContext
from sagaguard.saga.journals.redis import RedisJournal


def _cleanup(url: str, prefix: str) -> None:
    client, _ = connect(url, "cleanup")
    try:
        for name in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(name)
    finally:
        client.close()


def measure(url: str, replicas: int, calls: int) -> float:
    """Seconds per guarded call with ``wait_replicas=replicas``."""
    prefix = f"bench-wait-{uuid.uuid4().hex[:8]}"
    store = RedisStore(url, prefix=prefix, wait_replicas=replicas)
    guard = Guard(store)
    try:
        started = time.perf_counter()
        for i in range(calls):
            guard.run("noop", lambda: None, key=f"k{i}")
        elapsed = time.perf_counter() - started
    finally:
        guard.close()
        store.close()
    _cleanup(url, prefix + ":")
    return elapsed / calls


SENT = ("evalsha", "wait", "zadd", "zrem")
"""The commands a saga's run sends (none of them is called inside the scripts it runs)."""


def _commandstats(client: RedisCluster) -> Counter[str]:
    """Calls per command, summed over the primaries."""
    total: Counter[str] = Counter()
    replies: dict[Any, Any] = client.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
    for stats in replies.values():
        for name, row in stats.items():
            total[name.removeprefix("cmdstat_")] += int(row["calls"])
    return total


def measure_sagas(url: str, replicas: int, sagas: int, steps: int) -> tuple[float, dict[str, float]]:
    """Seconds per saga step, and commands per step, with ``wait_replicas=replicas`` for the
    journal and the store."""
    prefix = f"bench-sagawait-{uuid.uuid4().hex[:8]}"
    store = RedisStore(url, prefix=prefix + "fx", wait_replicas=replicas)
    journal = RedisJournal(url, prefix=prefix, wait_replicas=replicas)
    guard = Guard(store)
    runner = SagaRunner(journal, guard, wait=0, renewer=False)  # no renewal thread's commands
    noops: Saga[int] = Saga("bench_wait", input=int)

    def noop(ctx: StepContext, value: int) -> int:
        return value

    for k in range(steps):
        noops.step(name=f"s{k}", compensate=None)(noop)
    probe, _ = connect(url, "probe")
    assert isinstance(probe, RedisCluster), "a redis+cluster:// URL"
    try:
        before = _commandstats(probe)
        started = time.perf_counter()
        for i in range(sagas):
            outcome = runner.run(noops, f"saga-{i}", i)
            assert outcome.state is SagaState.COMPLETED, outcome
        elapsed = time.perf_counter() - started
        after = _commandstats(probe)
    finally:
        runner.close()
        guard.close()
        journal.close()
        store.close()
        probe.close()
    _cleanup(url, prefix)
    done = sagas * steps
    return elapsed / done, {name: (after[name] - before[name]) / done for name in SENT}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("url", help="a redis+cluster:// URL")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sagas", type=int, default=0, help="sagas per series (0: guarded calls)")
    parser.add_argument("--steps", type=int, default=5, help="no-op steps per saga")
    args = parser.parse_args()
    for _ in range(args.rounds):
        for replicas in (0, 1):
            if args.sagas:
                per_step, counts = measure_sagas(args.url, replicas, args.sagas, args.steps)
                sent = ", ".join(f"{counts[name]:.2f} {name.upper()}" for name in SENT)
                print(f"wait_replicas={replicas}: {per_step * 1e6:,.0f} µs per saga step; per step {sent}")
            else:
                per_call = measure(args.url, replicas, args.calls)
                rate = f"{1 / per_call:,.0f} calls/s, {per_call * 1e6:,.0f} µs per call"
                print(f"wait_replicas={replicas}: {rate}")


if __name__ == "__main__":
    main()
