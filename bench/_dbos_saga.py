"""DBOS Transact anchor for the saga benchmark: a workflow of ``n`` no-op steps.

Imported only inside a phase process, before DBOS is launched (DBOS registers workflows at import).
"""

from __future__ import annotations

from dbos import DBOS


@DBOS.step()
def saga_noop_step(i: int) -> int:
    return i


@DBOS.workflow()
def noop_steps_workflow(steps: int) -> int:
    total = 0
    for k in range(steps):
        total += saga_noop_step(k)
    return total
