"""Closed-loop load for the throughput yardstick: N threads or N asyncio tasks calling one operation.

Every client calls the operation back to back until the window closes; each call gets a fresh index
(so a fresh key) from one shared counter. A window reports the calls completed, the wall time from
the start to the last client's return (so calls still running at the deadline count, and their
time too), the process CPU time spent meanwhile (every thread of the process:
``time.process_time``), and each call's latency.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from time import perf_counter_ns

Op = Callable[[int], object]
AsyncOp = Callable[[int], Awaitable[object]]


@dataclass
class Window:
    """What one or more windows of one series measured (added up)."""

    calls: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    latencies_ns: list[int] = field(default_factory=list)

    def merge(self, other: Window) -> None:
        self.calls += other.calls
        self.wall += other.wall
        self.cpu += other.cpu
        self.latencies_ns.extend(other.latencies_ns)

    def summary(self) -> dict[str, float]:
        """Calls per second, p50 and p99 latency (µs), CPU per call (µs)."""
        ordered = sorted(self.latencies_ns)
        n = len(ordered)

        def rank(q: float) -> float:
            return ordered[min(n - 1, max(0, int(q * n + 0.5) - 1))] / 1000 if n else 0.0

        return {
            "calls": self.calls,
            "rate": self.calls / self.wall if self.wall else 0.0,
            "p50": rank(0.50),
            "p99": rank(0.99),
            "cpu_us": self.cpu / self.calls * 1e6 if self.calls else 0.0,
        }


def run_threads(op: Op, clients: int, seconds: float, start: int) -> Window:
    """``clients`` threads calling ``op(i)`` for ``seconds``; indices count up from ``start``."""
    counter = itertools.count(start)
    barrier = threading.Barrier(clients + 1)
    stop = threading.Event()
    latencies: list[list[int]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []

    def client(out: list[int]) -> None:
        barrier.wait()
        try:
            while not stop.is_set():
                i = next(counter)  # itertools.count is atomic under the GIL
                t0 = perf_counter_ns()
                op(i)
                out.append(perf_counter_ns() - t0)
        except BaseException as exc:  # reported by the caller: a bench must not hide a failure
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(out,), daemon=True) for out in latencies]
    for thread in threads:
        thread.start()
    barrier.wait()
    cpu0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if errors:
        raise RuntimeError(f"a client failed: {errors[0]!r}") from errors[0]
    merged = [x for out in latencies for x in out]
    return Window(len(merged), wall, cpu, merged)


async def run_tasks(op: AsyncOp, clients: int, seconds: float, start: int) -> Window:
    """``clients`` asyncio tasks awaiting ``op(i)`` for ``seconds`` on the running loop.

    Each client reads the clock itself: an operation that never suspends (the memory store)
    would otherwise starve a sleeping timer for ever.
    """
    counter = itertools.count(start)
    latencies: list[list[int]] = [[] for _ in range(clients)]
    gate = asyncio.Event()
    deadline = 0.0

    async def client(out: list[int]) -> None:
        await gate.wait()
        while time.perf_counter() < deadline:
            i = next(counter)
            t0 = perf_counter_ns()
            await op(i)
            out.append(perf_counter_ns() - t0)

    tasks = [asyncio.create_task(client(out)) for out in latencies]
    await asyncio.sleep(0)
    cpu0, t0 = time.process_time(), time.perf_counter()
    deadline = t0 + seconds
    gate.set()
    await asyncio.gather(*tasks)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    merged = [x for out in latencies for x in out]
    return Window(len(merged), wall, cpu, merged)
