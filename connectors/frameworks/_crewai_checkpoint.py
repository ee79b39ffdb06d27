"""A protected crew's tasks start once the checkpoint of their start is written (``protect`` in
``crewai.py`` calls :func:`wait_for_task_checkpoints`).

Why: CrewAI writes a checkpoint in a handler on its event bus's thread pool, serialising the
kickoff's event record without the lock the kickoff takes to add to it (``EventRecord.add`` takes
it, ``RuntimeState``'s serializer does not; still so in 1.15.44, the newest release). When the
kickoff adds an event during the write, pydantic-core panics ("dictionary changed size during
iteration", a ``BaseException`` the checkpoint handler does not catch) and that checkpoint is never
written. Losing a later one is harmless (a restore goes back one task boundary and the keys, which
do not depend on it, still match); losing the first task's ``task_started`` checkpoint leaves a
crash in that task nothing to restore: the restart is a new kickoff, with new keys, and the task's
effects can happen twice.

How: a ``pre_step`` hook runs in the kickoff's thread (in ``akickoff``, on its event loop) right
after the task's ``task_started`` event is emitted and before its agent does anything. There it
waits (``crewai_event_bus.flush``) until the handlers of the events emitted so far have run, the
checkpoint among them; while it waits the kickoff adds nothing, so the serializer has the record to
itself and the checkpoint is on disk before the task's first model or tool call.

Which crews: one process-wide hook, registered with CrewAI's documented global registration
(``crewai.hooks.on``) once, and again only if it is gone (``clear_all_hooks``). CrewAI documents no
other registration for a ``Crew`` object: its crew-scoped hooks are methods of ``@CrewBase``
classes, and its execution-scoped registry (``crewai.hooks.dispatch.scoped_hooks``) is not exported
by ``crewai.hooks`` and would need a context around every kickoff. A task step's context carries the
task (its ``crew`` is None at step points), so :func:`wait_for_task_checkpoints` marks the tasks of a
crew that has a checkpoint configured and the hook does nothing for any other step: other crews and
flows pay one attribute lookup per step (and CrewAI's ``HookDispatchedEvent``, which it emits for
each dispatch once a hook is registered at that point).
"""

from __future__ import annotations

import threading
from typing import Any

from crewai.events import crewai_event_bus
from crewai.hooks import InterceptionPoint, get_hooks, on

from sagaguard.connectors.frameworks._crewai_patch import shadow

__all__ = ["wait_for_task_checkpoints", "waits_for_checkpoint"]

WAITS = "__sagaguard_crewai_checkpoint__"
"""Set on a task (an instance attribute, out of its ``model_dump``) that waits for its checkpoint."""

_REGISTERING = threading.Lock()


def wait_for_task_checkpoints(crew: Any) -> None:
    """Make each task of ``crew`` wait, when it starts, until CrewAI's event-bus handlers of the
    events emitted so far have run: the checkpoint of its ``task_started`` event is then written
    (or failed) before the task's first step.

    Only for a crew with a checkpoint configured (``checkpoint=`` on the crew or on one of its
    agents); for any other crew nothing changes and no hook is registered. Call it again on the
    crew ``Crew.from_checkpoint`` returns (its tasks are new objects). However often it is called,
    CrewAI holds the hook once.

    The wait is for every handler pending on CrewAI's event bus, the crew's and any other's, with
    no timeout: a handler that never returns holds the task's start as long.
    """
    if not _checkpointed(crew):
        return
    for task in crew.tasks or []:
        shadow(task, WAITS, True)
    with _REGISTERING:  # two first protects at once register it once
        if _wait_for_checkpoint not in get_hooks(InterceptionPoint.PRE_STEP):
            on(InterceptionPoint.PRE_STEP)(_wait_for_checkpoint)


def waits_for_checkpoint(task: Any) -> bool:
    """Whether ``task`` waits for its checkpoint at its start (see :func:`wait_for_task_checkpoints`)."""
    return bool(task.__dict__.get(WAITS))


def _checkpointed(crew: Any) -> bool:
    # CrewAI looks for a task's checkpoint configuration on its agent, then on the agent's crew; a
    # configuration (or True) anywhere on the crew is enough to wait: an unneeded wait costs a
    # flush, a missing one a checkpoint.
    owners = [crew, crew.manager_agent, *(crew.agents or []), *(task.agent for task in crew.tasks or [])]
    return any(bool(getattr(owner, "checkpoint", None)) for owner in owners if owner is not None)


def _wait_for_checkpoint(step: Any) -> None:
    """The ``pre_step`` hook: a marked task's step waits for the event bus; any other step goes on."""
    task = getattr(step, "task", None)
    if step.kind == "task" and task is not None and waits_for_checkpoint(task):
        crewai_event_bus.flush(timeout=None)
