"""LangChain 1.x agents (``langchain.agents.create_agent``): one middleware guards the tools and
journals the model.

::

    guard = Guard(open_store("sqlite:///sagaguard.db"))
    agent = create_agent(
        model, tools=[book_flight], middleware=[GuardMiddleware(guard)],
        checkpointer=SqliteSaver(conn),
    )
    agent.invoke({"messages": [...]}, {"configurable": {"thread_id": "t-1"}}, durability="sync")

``create_agent`` builds a LangGraph graph (a model node and a ``ToolNode``), so the identities are
those of :mod:`sagaguard.connectors.frameworks.langgraph`, whose logic this module reuses rather than repeats:

- a tool call is keyed on ``thread_id`` + ``checkpoint_ns`` (the tools task) + ``tool_call_id``
  (:class:`~sagaguard.connectors.frameworks.langgraph.ToolGuard`); a re-run of the task returns the recorded
  ``ToolMessage`` without running the tool;
- a model call is keyed on ``thread_id`` + ``checkpoint_ns`` (the model task) + the call's ordinal in
  the task attempt (:class:`~sagaguard.connectors.frameworks.langgraph.JournaledChatModel`); a re-run of the
  model node after a crash gets the recorded ``AIMessage``, with the same tool calls and the same
  ``tool_call_id`` s, so the tools keep their keys and the model is not paid twice.

The model is journaled where it is asked: the middleware hands the agent's handler a copy of the
request whose model records its answers. Everything the agent does with the answer (structured
output parsing, ``name``) runs again on the replayed message, as it ran on the first. Put this
middleware last in ``middleware=[...]`` (innermost), so a retry or fallback middleware around it
asks the journal, and a model chosen by a routing middleware is the one journaled.

Run the agent with ``durability="sync"`` and a checkpointer: see
:func:`~sagaguard.connectors.frameworks.langgraph.check_durability`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Unpack

from langchain.agents.middleware import AgentMiddleware, AgentState, ModelRequest, ModelResponse
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langgraph.prebuilt.tool_node import ToolCallRequest

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.connectors.frameworks.langgraph import (
    AsyncExecute,
    Execute,
    JournaledChatModel,
    ToolGuard,
    ToolResult,
)
from sagaguard.connectors.in_doubt import OnDoubt
from sagaguard.connectors.toolcall import STOP
from sagaguard.idempotency.effect import Policy
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.options import PassedOptions

__all__ = ["GuardMiddleware"]

ModelResult = ModelResponse[Any] | AIMessage
ModelHandler = Callable[[ModelRequest[Any]], ModelResponse[Any]]
AsyncModelHandler = Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]]


class _RequestModel(JournaledChatModel):
    """The journaled stand-in for a request's model.

    Carries the wrapped model's ``profile`` and name, which ``create_agent`` reads to choose a
    structured-output strategy, so wrapping the model does not change the strategy it picks.
    """

    model_name: str | None = None


def _journaled(model: BaseChatModel, guard: Guard, effect_name: str, strict: bool) -> BaseChatModel:
    if isinstance(model, JournaledChatModel):
        return model  # already journaled (by the caller, or by another GuardMiddleware)
    name = getattr(model, "model_name", None) or getattr(model, "model", None)
    return _RequestModel(
        inner=model, guard=guard, effect_name=effect_name, strict=strict, profile=model.profile,
        model_name=name if isinstance(name, str) else None,
    )  # fmt: skip


class GuardMiddleware(AgentMiddleware[AgentState[Any], Any, Any]):
    """An ``AgentMiddleware`` for ``create_agent``: tool calls replay, model calls replay.

    Read-only tools (the default) are re-run after a crash inside them; tools declared
    :func:`~sagaguard.connectors.declare.changes_world` happen at most once.

    **Saga mode** (``saga=True``): the calls of tools declared ``changes_world(undo=...)`` or
    ``changes_world(pivot=True)`` are steps of the agent run open in the calling context (``with
    runner.run(saga, thread_id)`` around ``invoke``, ``async with`` around ``ainvoke``), keyed on the
    run id and the model's ``tool_call_id``; the undo receives the call's arguments and the tool's
    output (see :class:`~sagaguard.connectors.frameworks.langgraph.ToolGuard`). A tool's exception
    reaches the middleware as it is (``create_agent``'s tools node does not turn it into a
    message), so a failing tool ends the run and undoes it.

    Args:
        guard: the guard the calls run under (a step runs under its run's guard).
        saga: make the calls of tools declared with an undo or as the pivot steps of the open run.
        declare: tool name to :class:`~sagaguard.connectors.declare.ToolDeclaration`. Tools are read-only
            unless declared (here or with ``@changes_world`` on the tool): a crash inside a
            read-only tool re-runs it; only a tool that changes the world is at most once.
        on_doubt: what a tool call does when it, or a guarded effect inside it, is in doubt
            (:mod:`sagaguard.connectors.in_doubt`: ``Stop()``, the default, ``ReturnPending()`` or
            ``WaitForOperator(...)``).
        policy: one policy for every tool instead of the declarations (``"at_most_once"`` gives
            the behaviour before declarations existed).
        journal_model: journal the model calls (default True). Without it, a crash in the model
            node asks the model again, and its new ``tool_call_id`` s give the tools new keys.
        tool_prefix: prepended to a tool's name to make its effect's name.
        model_effect: the effect name of the model calls.
        exclude: names of tools that are not journaled (tools returning a ``Command``).
        strict: refuse a durability other than ``"sync"`` instead of warning.
        options: any other :meth:`Guard.run` option for the tool calls (``reconciler=``, ...).
    """

    def __init__(
        self,
        guard: Guard,
        *,
        saga: bool = False,
        declare: Mapping[str, ToolDeclaration] | None = None,
        on_doubt: OnDoubt = STOP,
        policy: Policy | str | None = None,
        journal_model: bool = True,
        tool_prefix: str = "langchain.tool.",
        model_effect: str = "langchain.model",
        exclude: Collection[str] = (),
        strict: bool = False,
        **options: Unpack[PassedOptions],
    ) -> None:
        super().__init__()
        self.guard = guard
        self.journal_model = journal_model
        self.model_effect = model_effect
        self.strict = strict
        self.tool_guard = ToolGuard(
            guard, saga=saga, declare=declare, on_doubt=on_doubt, policy=policy, prefix=tool_prefix,
            exclude=exclude, strict=strict, **options,
        )  # fmt: skip

    def _request(self, request: ModelRequest[Any]) -> ModelRequest[Any]:
        if not self.journal_model:
            return request
        return request.override(model=_journaled(request.model, self.guard, self.model_effect, self.strict))

    def wrap_model_call(self, request: ModelRequest[Any], handler: ModelHandler) -> ModelResult:
        """Ask the model through the journal: a re-run of the model node replays its answer."""
        return handler(self._request(request))

    async def awrap_model_call(self, request: ModelRequest[Any], handler: AsyncModelHandler) -> ModelResult:
        """The async twin of :meth:`wrap_model_call`."""
        return await handler(self._request(request))

    def wrap_tool_call(self, request: ToolCallRequest, handler: Execute) -> ToolResult:
        """Run the tool call once per ``thread_id`` + ``checkpoint_ns`` + ``tool_call_id`` (in saga
        mode, a declared call as a step of the open run).

        Raises:
            LookupError: in saga mode, a declared tool is called with no agent run open.
        """
        return self.tool_guard.wrap_tool_call(request, handler)

    async def awrap_tool_call(self, request: ToolCallRequest, handler: AsyncExecute) -> ToolResult:
        """The async twin of :meth:`wrap_tool_call`."""
        return await self.tool_guard.awrap_tool_call(request, handler)
