"""The guard's own cost: guarded no-op calls on the memory store (no I/O), new and replayed."""

from __future__ import annotations

from time import perf_counter_ns

from _cases import store_cases
from _common import RETENTION, Config, PhaseResult, noop, run_tag
from _harness import Case, interleave

from sagaguard.idempotency import Guard, MemoryStore, scope


def run(cfg: Config) -> PhaseResult:
    result = PhaseResult()
    tag = run_tag()
    n, warm = cfg.iterations("memory"), cfg.warmup("memory")
    store = MemoryStore()
    guard = Guard(store, namespace="bench", retention=RETENTION)
    guarded = guard.effect("bench.noop")(noop)
    for i in range(n + warm):
        with scope(f"{tag}-r{i}"):
            guarded(i)

    def new(i: int) -> int:
        with scope(f"{tag}-n{i}"):
            t0 = perf_counter_ns()
            guarded(i)
            return perf_counter_ns() - t0

    def replay(i: int) -> int:
        with scope(f"{tag}-r{i}"):
            t0 = perf_counter_ns()
            guarded(i)
            return perf_counter_ns() - t0

    cases: dict[str, Case] = {"new": new, "replay": replay, **store_cases(store, tag, n + warm)}
    result.add("memory", interleave(cases, n, warmup=warm))
    guard.close()
    return result
