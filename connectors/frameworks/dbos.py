"""DBOS steps: effects keyed on the workflow id and the step id, so a step re-run after a crash
replays what its first run did.

::

    @DBOS.step()
    @dbos_scoped
    def charge_step(order: str) -> str:
        return charge(order)           # a guarded effect: key = (workflow id, step id, ordinal)

DBOS records a step's output after the step returns and nothing when it starts, so a process that
dies inside a step has the step re-run on recovery, from its first line, under the same workflow id
and step id (its position in the deterministic workflow). Inside :func:`dbos_scope` (or a step
decorated with :func:`dbos_scoped`) the idempotency scope is that pair, so a guarded effect the dead
run made is replayed and one it left in doubt is resolved, not made twice. The step's retry attempt
stays out of the scope. An explicit ``key=`` still wins.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import ParamSpec, TypeVar

from dbos import DBOS

from sagaguard.connectors.scoped import ScopedDecorator, scoped_by
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.keys import Scope, scope

__all__ = ["dbos_scope", "dbos_scope_id", "dbos_scoped"]

P = ParamSpec("P")
R = TypeVar("R")


def dbos_scope_id() -> str:
    """The scope id of the running DBOS step: its workflow id and step id, JSON-encoded.

    Raises:
        ConfigurationError: not inside a DBOS step.
    """
    workflow_id, step_id = DBOS.workflow_id, DBOS.step_id
    if workflow_id is None or step_id is None:
        raise ConfigurationError("dbos_scope() is used outside a DBOS step (DBOS.step_id is None)")
    return json.dumps(["dbos", workflow_id, step_id])


@contextlib.contextmanager
def dbos_scope() -> Iterator[Scope]:
    """Run a block of a DBOS step as the unit of work (workflow id, step id).

    Raises:
        ConfigurationError: not inside a DBOS step.
    """
    with scope(dbos_scope_id()) as unit:
        yield unit


dbos_scoped: ScopedDecorator = scoped_by(dbos_scope)
"""Run a step function (sync or async) inside :func:`dbos_scope`.

Apply it under ``@DBOS.step()``, so it runs inside the step.
"""
