"""Cases every backend shares: the store alone, and sync against async guarded calls."""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

from _common import RETENTION, anoop, noop
from _harness import AsyncCase, Case

from sagaguard.idempotency import Guard, scope
from sagaguard.idempotency.keys import EffectIdentity


def store_cases(store: Any, tag: str, total: int) -> dict[str, Case]:
    """The store's own primitives with no guard above them: what the guard adds is the rest."""
    fp = "f1_" + "0" * 64
    done = [EffectIdentity.of("bench", f"{tag}-sr{i}", "bench.noop", 0) for i in range(total)]
    for identity in done:
        claimed = store.claim(identity, fp, 60.0)
        store.complete(identity.key, claimed.record.token, "0", RETENTION)

    def claim_complete(i: int) -> int:
        identity = EffectIdentity.of("bench", f"{tag}-sn{i}", "bench.noop", 0)
        t0 = perf_counter_ns()
        claimed = store.claim(identity, fp, 60.0)
        store.complete(identity.key, claimed.record.token, "0", RETENTION)
        return perf_counter_ns() - t0

    def claim_existing(i: int) -> int:
        identity = done[i]
        t0 = perf_counter_ns()
        store.claim(identity, fp, 60.0)
        return perf_counter_ns() - t0

    return {"store_claim_complete": claim_complete, "store_claim_existing": claim_existing}


def async_cases(store: Any, tag: str) -> tuple[dict[str, AsyncCase], list[Guard]]:
    """Sync, async offloaded and async direct new calls on one store (shared with the SQL phase)."""
    sync_guard = Guard(store, namespace="bench", retention=RETENTION)
    default_guard = Guard(store, namespace="bench", retention=RETENTION)
    offload_guard = Guard(store, namespace="bench", retention=RETENTION, offload=True)
    direct_guard = Guard(store, namespace="bench", retention=RETENTION, offload=False)
    sync_fn = sync_guard.effect("bench.noop")(noop)
    default_fn = default_guard.effect("bench.anoop")(anoop)
    offload_fn = offload_guard.effect("bench.anoop")(anoop)
    direct_fn = direct_guard.effect("bench.anoop")(anoop)

    async def sync_new(i: int) -> int:
        with scope(f"{tag}-as{i}"):
            t0 = perf_counter_ns()
            sync_fn(i)
            return perf_counter_ns() - t0

    async def default_new(i: int) -> int:
        with scope(f"{tag}-af{i}"):
            t0 = perf_counter_ns()
            await default_fn(i)
            return perf_counter_ns() - t0

    async def offload_new(i: int) -> int:
        with scope(f"{tag}-ao{i}"):
            t0 = perf_counter_ns()
            await offload_fn(i)
            return perf_counter_ns() - t0

    async def direct_new(i: int) -> int:
        with scope(f"{tag}-ad{i}"):
            t0 = perf_counter_ns()
            await direct_fn(i)
            return perf_counter_ns() - t0

    cases = {
        "sync_new": sync_new,
        "async_default_new": default_new,
        "async_offload_new": offload_new,
        "async_direct_new": direct_new,
    }
    return cases, [sync_guard, default_guard, offload_guard, direct_guard]
