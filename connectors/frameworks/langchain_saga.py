"""LangChain ``create_agent`` runs as agent sagas: one middleware journals the model, guards the
tools, and makes the calls of tools declared with an undo (or as the pivot) steps of the open run.

::

    @tool
    @changes_world(undo="cancel_booking")                # a name in the agent saga's UndoRegistry
    def book_hotel(hotel: str) -> dict: ...

    agent = create_agent(
        model, tools=[book_hotel, charge, search], checkpointer=SqliteSaver(conn),
        middleware=[SagaMiddleware(guard, declare={"charge": changes_world(undo="refund")})],
    )
    config = {"configurable": {"thread_id": thread_id}}
    with runner.run(trip_agent, thread_id) as run:       # the agent's durable identity
        result = agent.invoke(inputs, config, durability="sync")
        if "__interrupt__" in result:
            run.pause()                                  # at a human's approval
    async with runner.run(trip_agent, thread_id) as run: # or async (ainvoke): the same steps
        await agent.ainvoke(inputs, config, durability="sync")

:class:`SagaMiddleware` is a :class:`~sagaguard.connectors.frameworks.langchain.GuardMiddleware` (the model
journaled, so a re-run after a crash sees the same ``tool_call_id``\\ s; the read-only and ``changes_world()``
tools guarded as there) whose tool calls go through
:class:`sagaguard.connectors.frameworks.langgraph_saga.SagaTools`, the ``ToolNode`` handler, sync and async:
one implementation for both frameworks (``create_agent`` builds a LangGraph graph whose tools node is a
``ToolNode``). A declared call is a step of the run open in the calling context (``with`` for ``invoke``,
``async with`` for ``ainvoke``), keyed on the run id and the model's ``tool_call_id``; its undo receives the
call's arguments and the tool's output.

A tool's exception reaches the middleware as it is (``create_agent``'s tools node does not turn it
into a message), so a failing tool ends the run and undoes it. An approval is LangChain's
``HumanInTheLoopMiddleware`` (an ``interrupt``): pause the run when the result holds
``__interrupt__``; approved, open the run again and resume with ``Command(resume=...)``; rejected,
:meth:`sagaguard.saga.agent.AgentRunner.reject` undoes it, from any process. (Its own ``"reject"`` decision
only tells the model that one call was refused; nothing is undone.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langgraph.prebuilt.tool_node import ToolCallRequest

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.connectors.frameworks.langchain import GuardMiddleware
from sagaguard.connectors.frameworks.langgraph import AsyncExecute, Execute, ToolResult
from sagaguard.connectors.frameworks.langgraph_saga import SagaTools
from sagaguard.idempotency.guard import Guard

__all__ = ["SagaMiddleware"]


class SagaMiddleware(GuardMiddleware):
    """An ``AgentMiddleware`` for ``create_agent``: model calls replay, tool calls replay, and the
    calls of tools declared ``changes_world(undo=...)`` or ``changes_world(pivot=True)`` are steps
    of the open agent run (:class:`sagaguard.connectors.frameworks.langgraph_saga.SagaTools`).

    Args:
        guard: the guard the model and the other tools run under (the run's guard runs the steps).
        declare: tool name to declaration, for tools not declared where they are defined; read by
            both the saga (``undo=``, ``pivot=``) and the guard (``changes_world()``).
        options: the other :class:`~sagaguard.connectors.frameworks.langchain.GuardMiddleware` options
            (``on_doubt=``, ``journal_model=``, ``exclude=``, ...).
    """

    def __init__(
        self, guard: Guard, *, declare: Mapping[str, ToolDeclaration] | None = None, **options: Any
    ) -> None:
        super().__init__(guard, declare=declare, **options)
        self.saga_tools = SagaTools(declare, inner=self.tool_guard)

    def wrap_tool_call(self, request: ToolCallRequest, handler: Execute) -> ToolResult:
        """A declared call is a step of the run open here (``with runner.run(...)``); any other
        runs as :class:`~sagaguard.connectors.frameworks.langchain.GuardMiddleware` runs it.

        Raises:
            LookupError: a declared tool is called with no agent run open.
        """
        return self.saga_tools.wrap_tool_call(request, handler)

    async def awrap_tool_call(self, request: ToolCallRequest, handler: AsyncExecute) -> ToolResult:
        """The async twin of :meth:`wrap_tool_call` (``async with runner.run(...)``)."""
        return await self.saga_tools.awrap_tool_call(request, handler)
