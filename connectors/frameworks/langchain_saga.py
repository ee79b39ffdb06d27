"""Deprecated: ``create_agent`` runs as agent sagas are :class:`GuardMiddleware` in saga mode.

::

    agent = create_agent(
        model, tools=[book_hotel, charge, search], checkpointer=SqliteSaver(conn),
        middleware=[GuardMiddleware(guard, saga=True, declare={"charge": changes_world(undo="refund")})],
    )
    with runner.run(trip_agent, thread_id):              # the agent's durable identity
        agent.invoke(inputs, {"configurable": {"thread_id": thread_id}}, durability="sync")

:class:`SagaMiddleware` keeps working and warns (``DeprecationWarning``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.connectors.frameworks.langchain import GuardMiddleware
from sagaguard.idempotency.guard import Guard

__all__ = ["SagaMiddleware"]


class SagaMiddleware(GuardMiddleware):
    """Deprecated: ``GuardMiddleware(guard, saga=True, ...)``, which this is.

    Args:
        guard: the guard the model and the other tools run under (the run's guard runs the steps).
        declare: tool name to declaration, for tools not declared where they are defined.
        options: the other :class:`~sagaguard.connectors.frameworks.langchain.GuardMiddleware` options.
    """

    def __init__(
        self, guard: Guard, *, declare: Mapping[str, ToolDeclaration] | None = None, **options: Any
    ) -> None:
        warnings.warn(
            "SagaMiddleware is deprecated: use GuardMiddleware(guard, saga=True, declare=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(guard, saga=True, declare=declare, **options)
