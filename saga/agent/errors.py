"""Errors of agent sagas, under the saga layer's root (:class:`~sagaguard.saga.errors.SagaError`)::

SagaError
├── AgentSagaError          an agent run's saga cannot do what was asked
│   ├── UnknownUndo         the journal names an undo no code registered (also a DefinitionMismatch)
│   ├── AgentRunEnded       the run's saga has ended or is compensating: no more tool calls
│   └── NoOpenRun           a tool call that is a step found no open run (also a LookupError)
├── AgentRunAbandoned       recorded cause: the run crashed and was not resumed within its deadline
├── CallUndone              recorded on a call's effect whose outcome was unknown when its undo ran
└── AgentRunRejected        recorded cause: a human rejected the run at an approval

AgentRunCancelled (BaseException)  raised at a tool call of a run cancelled from outside
"""

from __future__ import annotations

from sagaguard.saga.errors import DefinitionMismatch, SagaError

__all__ = [
    "AgentRunAbandoned",
    "AgentRunCancelled",
    "AgentRunEnded",
    "AgentRunRejected",
    "AgentSagaError",
    "CallUndone",
    "NoOpenRun",
    "UnknownUndo",
]


class AgentSagaError(SagaError):
    """An agent run's saga cannot do what was asked."""


class UnknownUndo(AgentSagaError, DefinitionMismatch):
    """The journal names an undo that no code in this process registered.

    Attributes:
        saga_id: the run's saga.
        undo: the recorded name.
    """

    def __init__(self, saga_id: str, undo: str) -> None:
        DefinitionMismatch.__init__(
            self, saga_id, f"undo {undo!r} is not registered (register it at import, where the worker runs)"
        )
        self.undo = undo


class AgentRunEnded(AgentSagaError):
    """The run's saga is no longer running (it completed, is compensating, or needs attention).

    Opening a COMPLETED run does not raise it (the run replays, see ``AgentRunner.run``); a new
    tool call of that run does.

    Attributes:
        saga_id: the run's saga.
        state: its state, as the journal holds it.
    """

    def __init__(self, saga_id: str, state: str) -> None:
        super().__init__(f"agent run {saga_id!r} is {state}: it takes no more tool calls")
        self.saga_id = saga_id
        self.state = state


class AgentRunAbandoned(SagaError):
    """Recorded cause: the run crashed and was not resumed before its abandon deadline.

    Attributes:
        saga_id: the run's saga.
    """

    def __init__(self, saga_id: str) -> None:
        super().__init__(f"agent run {saga_id!r} was abandoned: not resumed within its deadline")
        self.saga_id = saga_id


class CallUndone(SagaError):
    """Recorded, in the effect ledger, on a tool call's effect that was in doubt (or left in
    progress by a dead process) when the run's compensation undid the call: the record is settled,
    so it no longer counts as in doubt, and the call, if ever made again under its key, replays
    this error instead of running.

    Attributes:
        saga_id: the run's saga.
        step: the undone call's step.
    """

    def __init__(self, saga_id: str, step: str) -> None:
        super().__init__(f"agent run {saga_id!r}: call {step!r} was undone while its outcome was unknown")
        self.saga_id = saga_id
        self.step = step


class AgentRunRejected(SagaError):
    """Recorded cause: a human rejected the run at an approval.

    Attributes:
        reason: what the human said.
    """

    def __init__(self, reason: str = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason


class AgentRunCancelled(BaseException):
    """Raised at the next tool call of a run that was cancelled from outside (``sagaguard sagas
    cancel``, :func:`saga.cancel`); the run's context then compensates.

    Derives from BaseException because it stops the agent: a tool's ``except Exception`` (and the
    frameworks that turn a tool's exception into text for the model) must not turn it into a tool
    result the model reads. Let it reach the run's ``with`` block, which compensates and re-raises
    it; catch it outside the block; code that catches BaseException must re-raise it.

    Attributes:
        saga_id: the run's saga.
    """

    def __init__(self, saga_id: str) -> None:
        super().__init__(f"agent run {saga_id!r} was cancelled")
        self.saga_id = saga_id


class NoOpenRun(AgentSagaError, LookupError):
    """A call of a tool declared with an undo or as the pivot found no agent run open to be a step
    of (``[async] with runner.run(...)`` around the agent, or the adapter's own turn). Nothing ran.
    A ``LookupError`` too, as :func:`~sagaguard.saga.agent.current_run` raised before it existed."""
