"""DBOS Transact as an anchor: a workflow with one no-op step, on the benchmark's own database.

Imported only inside a phase process: DBOS is a process-wide singleton.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import version
from time import perf_counter_ns
from typing import Any

from _harness import Case
from dbos import DBOS

STEP_NS: list[int] = []
"""Duration of each step call, timed inside the workflow (the step's own cost)."""


@DBOS.step()
def bench_step(i: int) -> int:
    return i


@DBOS.workflow()
def bench_workflow(i: int) -> int:
    t0 = perf_counter_ns()
    out = bench_step(i)
    STEP_NS.append(perf_counter_ns() - t0)
    return out


def dbos_case(url: str) -> tuple[Case, list[int], Callable[[], None], dict[str, Any]]:
    """Launch DBOS on ``url``; return the timed workflow call, the step samples, a stopper, facts.

    DBOS leaves SQLite in its default rollback-journal mode; the caller may switch the file to WAL
    first (the mode is stored in the file), to compare on the store's own settings.
    """
    DBOS(config={"name": "sagaguard-bench", "system_database_url": url, "log_level": "WARNING"})
    DBOS.launch()
    logging.getLogger("dbos").setLevel(logging.WARNING)

    def workflow(i: int) -> int:
        t0 = perf_counter_ns()
        bench_workflow(i)
        return perf_counter_ns() - t0

    def stop() -> None:
        DBOS.destroy(destroy_registry=False)  # relaunchable on another database

    return workflow, STEP_NS, stop, {"dbos": version("dbos")}
