"""Agent sagas: an agent's tool calls undone in reverse when its run fails, is cancelled, is
rejected or is abandoned, on top of the framework's checkpointer.

::

    undos = UndoRegistry()

    @undos.register
    def cancel_booking(arguments, result): ...

    trip_agent = AgentSaga("trip_agent", undos)          # register it with the worker too
    runner = AgentRunner(journal, guard)
    with runner.run(trip_agent, thread_id) as run:
        booking = run.call("book_hotel", lambda: hotel.book(...), {"hotel": h}, undo="cancel_booking")
    async with runner.run(trip_agent, run_id) as run:    # async agents: the same, awaited
        booking = await run.acall("book_hotel", lambda: hotel.abook(...), {"hotel": h}, undo="cancel_booking")

An agent run is an ordinary saga in the journal (``sagaguard sagas list/show/cancel/retry``), whose
steps are its compensatable and pivot tool calls, appended as they happen.
"""

from sagaguard.saga.agent.call import ToolCall
from sagaguard.saga.agent.definition import (
    AgentSaga,
    AgentStep,
    OnFailure,
    resume_signal,
    settle_undone,
    tool_outcome,
    tool_outcomes,
)
from sagaguard.saga.agent.errors import (
    AgentRunAbandoned,
    AgentRunCancelled,
    AgentRunEnded,
    AgentRunRejected,
    AgentSagaError,
    CallUndone,
    NoOpenRun,
    UnknownUndo,
)
from sagaguard.saga.agent.run import AgentRun, current_run
from sagaguard.saga.agent.runner import AgentRunner
from sagaguard.saga.agent.undo import Undo, UndoRegistry, dependency, provider_key, undoing

__all__ = [
    "AgentRun",
    "AgentRunAbandoned",
    "AgentRunCancelled",
    "AgentRunEnded",
    "AgentRunRejected",
    "AgentRunner",
    "AgentSaga",
    "AgentSagaError",
    "AgentStep",
    "CallUndone",
    "NoOpenRun",
    "OnFailure",
    "ToolCall",
    "Undo",
    "UndoRegistry",
    "UnknownUndo",
    "current_run",
    "dependency",
    "provider_key",
    "resume_signal",
    "settle_undone",
    "tool_outcome",
    "tool_outcomes",
    "undoing",
]
