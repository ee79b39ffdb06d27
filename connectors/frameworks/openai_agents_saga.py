"""OpenAI Agents SDK turns as agent sagas: a turn's tool calls are undone in reverse when it fails,
is rejected at an approval, is cancelled or is abandoned.

::

    @function_tool                                       # a declared tool's failure ends the turn
    @changes_world(undo="cancel_booking")                # a name in the agent saga's UndoRegistry
    def book_hotel(hotel: str) -> dict: ...

    trip_agent = AgentSaga("trip_agent", undos)          # registered with the worker too
    runner = AgentRunner(journal, guard)

    async with SagaTurn(runner, trip_agent, session.session_id, n) as turn:
        go_on = await turn.resume_turn(session, text)    # the turn's input, [] to go on, None: done
        if go_on is not None:
            result = await turn.run(agent, go_on, session=session)
    # later, a human said no at the approval the turn stopped at (any process):
    await SagaTurn(runner, trip_agent, session_id, n).reject("the manager said no")

**What is keyed on what.** The run's saga is the *turn*: ``{session_id}/turn-{n}``
(:func:`turn_run_id`), the durable identity of one ``Runner.run`` of a conversation, its approval
interruptions and resumes included. A turn that completes keeps its effects, and a later turn that
fails undoes only its own calls: the user was told what the earlier turn did. The same string is the
run key of the journaled model (:class:`~sagaguard.connectors.frameworks.openai_agents.JournaledRun`,
which this class runs inside, in saga mode), so a rerun of the turn gets the recorded answers and
the same ``tool_call_id``\\ s. A call of a tool declared ``changes_world(undo="name")`` or
``changes_world(pivot=True)`` (on the function, the ``FunctionTool``, or by name in ``declare=``)
is a step of the turn's run (:meth:`sagaguard.saga.agent.AgentRun.acall`): the effect
``agent.tool.{tool}`` under the key ``{run id}/{tool_call_id}``, registered with its undo in one
journal commit before it runs. Other tools stay guarded as
:class:`~sagaguard.connectors.frameworks.openai_agents.JournaledRun` guards them. The undo receives
the call's arguments (the model's JSON, parsed) and the tool's output
(:func:`~sagaguard.connectors.declare.recorded_output`).

**Approvals.** A tool with ``needs_approval`` interrupts the turn: :meth:`SagaTurn.run` then
pauses it (WAITING, no process held). Approved, the turn is opened again and resumed from its saved
``RunState`` (:meth:`SagaTurn.resume`). Rejected, :meth:`SagaTurn.reject` undoes it, from any
process. (The SDK's own ``state.reject(item)`` only tells the model that one call was refused and
goes on; nothing is undone.)

**A declared tool's failure is a failed step.** The SDK turns a tool's exception into text for the
model (its default ``failure_error_function``), which a step would record as the tool's output and
the model could answer by calling the tool again under a new id. So a step runs the tool's function
with ``failure_error_function=None`` whatever the tool says: the exception ends the turn (the SDK
raises ``UserError`` from it), which is undone; a pivot in flight whose failure was an effect in
doubt parks the turn NEEDS_ATTENTION instead (it may have happened). Undeclared tools keep the
SDK's behaviour.

**What an undo sees.** ``undoing().key`` is ``{run id}/{tool_call_id}``, the scope the tool's body
ran in, so ``provider_key(effect)`` is the key an effect of the body was sent under.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, TypeVar, Unpack

from agents import Agent, Runner, RunResult, RunState
from agents.items import TResponseInputItem
from agents.memory import Session
from agents.models.interface import ModelProvider

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.connectors.frameworks.openai_agents import JournaledRun
from sagaguard.connectors.in_doubt import OnDoubt
from sagaguard.connectors.llm import LlmUsage
from sagaguard.connectors.toolcall import STOP
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.options import PassedOptions, RunOptions
from sagaguard.saga.agent import AgentRun as SagaRun
from sagaguard.saga.agent import AgentRunner, AgentSaga, NoOpenRun
from sagaguard.saga.records import SagaOutcome

__all__ = ["SagaTurn", "turn_run_id"]

TContext = TypeVar("TContext")
Input = str | list[TResponseInputItem] | RunState[Any, Any]



def turn_run_id(session_id: str, turn: int) -> str:
    """The run id of a conversation's ``turn``-th turn (from 1): its saga's id and its run key."""
    return f"{session_id}/turn-{turn}"


class SagaTurn:
    """One turn of an Agents SDK conversation, run under an agent saga. Open it with ``async with``
    (or ``with``, around ``Runner.run_sync``); it ends as :class:`sagaguard.saga.agent.AgentRun` ends: the
    block returning completes the turn (or leaves it paused at an approval), an exception undoes
    it (with the saga's ``on_failure="compensate"``), a cancellation undoes it at its next call.

    Args:
        runner: opens the turn's run (its journal, and the guard every call runs under).
        saga: the agent's saga type (its undos; register it with the worker).
        session_id: the conversation's durable id (a session's ``session_id``, a ticket id).
        turn: the turn's position in the conversation, from 1.
        declare: tool name to declaration, for tools not declared where they are defined.
        on_doubt: what a call does when it is left in doubt (:mod:`sagaguard.connectors.in_doubt`).
        tool_options: per tool name, :meth:`Guard.effect` options over its declaration's.
        provider: resolves an agent's model given by name or left unset.
        fingerprint_model: whether a replayed model call's input must match (default True).
        usage: where to total model usage (default: a new one, as :attr:`usage`).
        options: any other :meth:`Guard.run` option for every tool, as :class:`JournaledRun` takes them.

    Attributes:
        run_id: the turn's run id (:func:`turn_run_id`).
        saga_run: the turn's :class:`sagaguard.saga.agent.AgentRun`.
        journaled: the :class:`~sagaguard.connectors.frameworks.openai_agents.JournaledRun` the agent is
            wrapped by, in saga mode (its steps are this turn's).

    Raises:
        ConfigurationError: an empty session id, or a turn below 1.
    """

    def __init__(
        self,
        runner: AgentRunner,
        saga: AgentSaga,
        session_id: str,
        turn: int,
        *,
        declare: Mapping[str, ToolDeclaration] | None = None,
        on_doubt: OnDoubt = STOP,
        tool_options: Mapping[str, RunOptions] | None = None,
        provider: ModelProvider | None = None,
        fingerprint_model: bool = True,
        usage: LlmUsage | None = None,
        **options: Unpack[PassedOptions],
    ) -> None:
        if not session_id:
            raise ConfigurationError("a saga turn needs the conversation's session id")
        if turn < 1:
            raise ConfigurationError(f"turns are counted from 1, not {turn}")
        self.runner = runner
        self.saga = saga
        self.turn = turn
        self.run_id = turn_run_id(session_id, turn)
        self.saga_run: SagaRun = runner.run(saga, self.run_id)
        self.journaled = JournaledRun(
            runner.guard, self.run_id, declare=declare, on_doubt=on_doubt, tool_options=tool_options,
            provider=provider, fingerprint_model=fingerprint_model, usage=usage, saga=self._open_run,
            **options,
        )  # fmt: skip
        self._wrapped: dict[int, Agent[Any]] = {}
        self._open = False

    # -- opening ---------------------------------------------------------------------------------

    async def __aenter__(self) -> SagaTurn:
        await self.saga_run.__aenter__()
        self._open = True
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._open = False
        await self.saga_run.__aexit__(kind, exc, tb)

    def __enter__(self) -> SagaTurn:
        self.saga_run.__enter__()
        self._open = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._open = False
        self.saga_run.__exit__(kind, exc, tb)

    def _open_run(self) -> SagaRun:
        """The run the declared tools' calls are steps of: this turn's, open here.

        Raises:
            NoOpenRun: the turn is not open (the agent runs outside ``async with``).
        """
        if not self._open:
            raise NoOpenRun(
                f"a declared tool is a step of the turn {self.run_id!r}: run the agent inside "
                "`async with SagaTurn(...)`"
            )
        return self.saga_run

    # -- running ---------------------------------------------------------------------------------

    def wrap(self, agent: Agent[TContext]) -> Agent[TContext]:
        """The agent (and the agents it hands off to) with its model journaled and its tools
        guarded, the declared ones as steps of the turn; the same copy for the same agent (load a
        saved ``RunState`` against it)."""
        found = self._wrapped.get(id(agent))
        if found is None:
            found = self._wrapped[id(agent)] = self.journaled.wrap(agent)
        return found

    async def run(self, agent: Agent[Any], input: Input, **options: Any) -> RunResult:
        """``Runner.run`` of the wrapped ``agent``; a result stopped at an approval (its
        ``interruptions``) pauses the turn, so the block then leaves it WAITING, not completed.

        Args:
            agent: the agent (not wrapped).
            input: the turn's input, or the ``RunState`` to resume.
            options: ``Runner.run`` options (``session=``, ``context=``, ``max_turns=``, ...).
        """
        result = await Runner.run(self.wrap(agent), input, **options)
        if result.interruptions:
            self.pause()
        return result

    def resume(self, state: RunState[Any, Any]) -> RunState[Any, Any]:
        """Go on with a turn interrupted for approval: its model-call ordinals continue after those
        in ``state`` (loaded against :meth:`wrap`'s agent). See
        :meth:`sagaguard.connectors.frameworks.openai_agents.JournaledRun.resume`."""
        return self.journaled.resume(state)

    async def resume_turn(
        self, session: Session, input: str | list[TResponseInputItem]
    ) -> str | list[TResponseInputItem] | None:
        """What to pass :meth:`run` to run or go on with this turn of ``session`` (see
        :meth:`sagaguard.connectors.frameworks.openai_agents.JournaledRun.resume_turn`)."""
        return await self.journaled.resume_turn(session, self.turn, input)

    def pause(self) -> None:
        """Leave the turn WAITING at the block's end (a human must approve first)."""
        self.saga_run.pause()

    async def reject(self, reason: str = "rejected") -> SagaOutcome:
        """A human rejected the turn at an approval: undo its tool calls now, in reverse order,
        inside the block or from any process after it.

        Raises:
            AgentRunEnded: the turn has already ended (completed, compensated, ...).
        """
        if self._open:
            return await self.saga_run.areject(reason)
        return await self.runner.areject(self.saga, self.run_id, reason)

    @property
    def is_open(self) -> bool:
        """Whether the turn is open here (inside its ``async with`` block)."""
        return self._open

    @property
    def usage(self) -> LlmUsage:
        """The turn's model usage, paid and saved by replays."""
        return self.journaled.usage

    @property
    def outcome(self) -> SagaOutcome | None:
        """Where the turn's saga ended, once this process ended it."""
        return self.saga_run.outcome
