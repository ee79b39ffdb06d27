"""What waiting for a replica costs a guarded call on a Redis Cluster (docs/backends.md).

::

    .venv/bin/python bench/cluster_wait.py redis+cluster://127.0.0.1:7000 [--calls 2000] [--rounds 2]

Runs ``--calls`` guarded no-op calls one at a time, each on a new key, with ``wait_replicas=0`` and
``wait_replicas=1``, alternating for ``--rounds`` rounds so the machine's load weighs on both alike,
and prints the calls per second and microseconds per call of each. Writes only keys under its own
prefixes and deletes them.
"""

from __future__ import annotations

import argparse
import time
import uuid

from sagaguard.idempotency import Guard
from sagaguard.idempotency.stores.redis import RedisStore


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
    from sagaguard.idempotency.backends.redis_client import connect

    client, _ = connect(url, "cleanup")
    try:
        for name in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(name)
    finally:
        client.close()
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("url", help="a redis+cluster:// URL")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for replicas in (0, 1):
            per_call = measure(args.url, replicas, args.calls)
            print(f"wait_replicas={replicas}: {1 / per_call:,.0f} calls/s, {per_call * 1e6:,.0f} µs per call")


if __name__ == "__main__":
    main()
