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
import functools
import inspect
import json
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ParamSpec, TypeVar, overload

from dbos import DBOS

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


@overload
def dbos_scoped(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]: ...


@overload
def dbos_scoped(fn: Callable[P, R]) -> Callable[P, R]: ...


def dbos_scoped(fn: Callable[P, Any]) -> Callable[P, Any]:
    """Run a step function (sync or async) inside :func:`dbos_scope`.

    Apply it under ``@DBOS.step()``, so it runs inside the step.
    """
    if inspect.iscoroutinefunction(fn):
        afn: Callable[P, Coroutine[Any, Any, Any]] = fn

        @functools.wraps(fn)
        async def ascoped(*args: P.args, **kwargs: P.kwargs) -> Any:
            with dbos_scope():
                return await afn(*args, **kwargs)

        return ascoped

    @functools.wraps(fn)
    def scoped(*args: P.args, **kwargs: P.kwargs) -> Any:
        with dbos_scope():
            return fn(*args, **kwargs)

    return scoped
