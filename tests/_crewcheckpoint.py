"""Kickoffs of crews run WITHOUT sagaguard whose ``task_started`` checkpoints are always on disk (the
baseline rows of the CrewAI children: ``tests/_crewaichild.py``'s ``plain`` crew).

A protected crew's tasks wait for their checkpoint at their start
(``connectors/frameworks/_crewai_checkpoint.py``: CrewAI 1.15 serialises the kickoff's event record
while the kickoff adds to it, and now and then loses the checkpoint). A crew run without sagaguard
does not, so a baseline restored from its checkpoints would now and then find one missing; within
this block it waits the same way: a ``pre_step`` hook (CrewAI's public ``on`` /
``unregister_hook``, registered for the block only: the children run one kickoff at a time) that
waits for the event bus once the task's ``task_started`` event is out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def checkpoints_written() -> Iterator[None]:
    """Within it, each task of a kickoff goes on once its ``task_started`` checkpoint is written."""
    from crewai.hooks import InterceptionPoint, on, unregister_hook

    on(InterceptionPoint.PRE_STEP)(_task_checkpoint_written)
    try:
        yield
    finally:
        unregister_hook(InterceptionPoint.PRE_STEP, _task_checkpoint_written)


def _task_checkpoint_written(step: Any) -> None:
    from crewai.events import crewai_event_bus

    if step.kind == "task":
        crewai_event_bus.flush(timeout=None)
