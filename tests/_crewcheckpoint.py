"""Kickoffs whose ``task_started`` checkpoints are always on disk (CrewAI children and harnesses).

CrewAI 1.15 writes a checkpoint on an event-bus thread, serializing the kickoff's event record
without the lock the kickoff takes to add to it (``EventRecord.add`` takes it, the serializer does
not): under load the write dies (pydantic-core panics, "dictionary changed size during iteration",
a ``BaseException`` the checkpoint handler does not catch) and a test that restores the crew finds
no checkpoint. A ``pre_step`` hook runs in the kickoff's thread right after ``task_started`` and
before the task's next event, so waiting there for the bus keeps the record still while the
checkpoint is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def checkpoints_written() -> Iterator[None]:
    """Within it, each task of a kickoff goes on once its ``task_started`` checkpoint is written."""
    from crewai.hooks.dispatch import InterceptionPoint, register_scoped, scoped_hooks

    with scoped_hooks():
        register_scoped(InterceptionPoint.PRE_STEP, _task_checkpoint_written)
        yield


def _task_checkpoint_written(step: Any) -> None:
    from crewai.events.event_bus import crewai_event_bus

    if step.kind == "task":
        crewai_event_bus.flush(timeout=None)
