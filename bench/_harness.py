"""Timing for the guard benchmark: interleaved rounds, percentiles, no I/O of its own.

A *case* runs one operation for an index ``i`` and returns how long the part that counts took, in
nanoseconds (``time.perf_counter_ns``), so per-call set-up (entering a scope, building arguments)
stays outside the timed region. :func:`interleave` runs several cases in small alternating blocks
(A/B/C, then B/C/A, ...) so that machine noise on a busy 2-core box hits every case alike, and
ratios between them stay meaningful even when absolute figures drift.
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

Case = Callable[[int], int]
"""Run one operation for index ``i``; return its duration in ns."""

AsyncCase = Callable[[int], Awaitable[int]]
"""The async twin of :data:`Case`."""


@dataclass(frozen=True)
class Stats:
    """Percentiles of one series, in microseconds."""

    n: int
    p50: float
    p99: float
    mean: float

    def as_dict(self) -> dict[str, float]:
        return {"n": self.n, "p50": self.p50, "p99": self.p99, "mean": self.mean}


def stats(samples_ns: list[int]) -> Stats:
    """Nearest-rank p50/p99 and the mean of ``samples_ns``, in microseconds."""
    if not samples_ns:
        raise ValueError("no samples")
    ordered = sorted(samples_ns)
    n = len(ordered)

    def rank(q: float) -> float:
        return ordered[min(n - 1, max(0, int(q * n + 0.5) - 1))] / 1000

    return Stats(n, rank(0.50), rank(0.99), sum(ordered) / n / 1000)


def _plan(names: list[str], iterations: int, block: int) -> list[tuple[str, range]]:
    """The interleaved order: blocks of ``block`` indices, case order rotated every round."""
    steps: list[tuple[str, range]] = []
    for round_no, start in enumerate(range(0, iterations, block)):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            steps.append((name, range(start, min(start + block, iterations))))
    return steps


def _settle() -> None:
    gc.collect()
    gc.freeze()  # set-up garbage (pre-created records, loaded modules) never rescanned in the loop


def interleave(
    cases: Mapping[str, Case], iterations: int, *, warmup: int, block: int = 10
) -> dict[str, Stats]:
    """Run every case ``warmup`` times, then ``iterations`` times in interleaved blocks.

    Indices ``0..warmup-1`` are the warm-up, ``warmup..warmup+iterations-1`` the measured calls,
    so a case that needs a fresh key per call gets one from its index.
    """
    names = list(cases)
    for name in names:
        for i in range(warmup):
            cases[name](i)
    samples: dict[str, list[int]] = {name: [] for name in names}
    _settle()
    for name, indices in _plan(names, iterations, block):
        case, out = cases[name], samples[name]
        for i in indices:
            out.append(case(warmup + i))
    gc.unfreeze()
    return {name: stats(values) for name, values in samples.items()}


async def interleave_async(
    cases: Mapping[str, AsyncCase], iterations: int, *, warmup: int, block: int = 10
) -> dict[str, Stats]:
    """:func:`interleave` for async cases (sync work can be wrapped in a coroutine)."""
    names = list(cases)
    for name in names:
        for i in range(warmup):
            await cases[name](i)
    samples: dict[str, list[int]] = {name: [] for name in names}
    _settle()
    for name, indices in _plan(names, iterations, block):
        case, out = cases[name], samples[name]
        for i in indices:
            out.append(await case(warmup + i))
    gc.unfreeze()
    return {name: stats(values) for name, values in samples.items()}
