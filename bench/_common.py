"""What every phase of the guard benchmark shares: its settings and the guarded no-ops."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from _harness import Stats

BASE_ITERATIONS = {"memory": 5000, "redis": 2000, "sqlite": 500, "postgres": 1000}
"""Measured calls per series in a full run (``--quick`` divides by 10)."""

RETENTION = 900.0
"""Seconds a benchmark record is kept: Redis evicts whatever a crashed run leaves behind."""
DBOS_ROUNDS = 4
"""Rounds in which a block of guarded calls alternates with a block of DBOS workflows (bench/_sql.py)."""

MILLION = 1_000_000


@dataclass(frozen=True)
class Config:
    """The settings of one run, passed to each phase process as JSON."""

    quick: bool = False
    million: bool = False
    scale: float = 1.0
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_million_db: int = 14
    pg_url: str = "postgresql://postgres@127.0.0.1:5432/test"
    """An existing database to connect to; the benchmark creates (and drops) its own beside it."""
    million_rows: int = MILLION

    def iterations(self, backend: str) -> int:
        n = BASE_ITERATIONS[backend] * self.scale
        return max(20, int(n / 10 if self.quick else n))

    def warmup(self, backend: str) -> int:
        n = max(5, self.iterations(backend) // 10)
        if backend == "sqlite":
            # Past the first WAL auto-checkpoint (1000 pages): until then every commit grows the
            # WAL file, and an fsync that changes a file's size costs more than one that does not.
            n = max(n, 30 if self.quick else 200)
        return n

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Config:
        return cls(**json.loads(text))


@dataclass
class PhaseResult:
    """What a phase reports: series (µs), facts about the setup, and free-form notes."""

    series: dict[str, dict[str, float]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, prefix: str, found: dict[str, Stats]) -> None:
        for name, st in found.items():
            self.series[f"{prefix}.{name}"] = st.as_dict()


def run_tag() -> str:
    """A short id that keeps this run's keys apart from any other run's."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def noop(i: int) -> int:
    """The effect body: does nothing, returns its argument (stored and replayed as an int)."""
    return i


async def anoop(i: int) -> int:
    """The async effect body."""
    return i


def balance() -> str:
    """The machine's CPU speed and its disk's flush latency, measured now, as a sentence.

    A DBOS step is mostly Python and a guarded call mostly fsync, so their ratio moves with these
    two figures from one machine to the next; printing them beside the results says which kind of
    machine a run was on. The flush is of a 4 KiB rewrite in the temporary directory, where the
    SQLite phase puts its files.
    """
    started = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i
    loop = time.perf_counter() - started
    flushes = []
    with tempfile.TemporaryDirectory(prefix="sgbench-") as tmp:
        fd = os.open(os.path.join(tmp, "flush"), os.O_RDWR | os.O_CREAT)
        try:
            os.write(fd, bytes(64 * 4096))
            os.fsync(fd)
            for i in range(200):
                os.pwrite(fd, b"x" * 4096, (i % 64) * 4096)
                t0 = time.perf_counter()
                os.fdatasync(fd)
                flushes.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
    flushes.sort()
    return (
        f"a Python loop of 1,000,000 additions took {loop * 1000:.0f} ms; "
        f"fdatasync of a 4 KiB rewrite, p50 {flushes[len(flushes) // 2] * 1e6:.0f} µs"
    )
