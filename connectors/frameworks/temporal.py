"""Temporal activities: effects keyed on the activity's durable identity, so a retried or re-run
activity replays what its earlier attempts did.

::

    @activity.defn
    @temporal_scoped
    async def charge(order: str) -> str:
        return await pay(order)        # a guarded effect: key = (workflow run, activity id, ordinal)

Temporal runs activities at least once: a worker that dies after the charge and before reporting
completion has the activity retried, from its first line. Inside :func:`activity_scope` (or an
activity decorated with :func:`temporal_scoped`) the idempotency scope is the workflow run id plus
the activity id (Temporal's recommended idempotency key), the same for every attempt; the attempt
number stays out of it. Guarded effects inside get ordinals in that scope, so sequential effects
keep their positions across attempts; an explicit ``key=`` still wins.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import ParamSpec, TypeVar

from temporalio import activity

from sagaguard.connectors.scoped import ScopedDecorator, scoped_by
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.keys import Scope, scope

__all__ = ["activity_scope", "activity_scope_id", "temporal_scoped"]

P = ParamSpec("P")
R = TypeVar("R")


def activity_scope_id(info: activity.Info | None = None) -> str:
    """The scope id of an activity: its workflow run id and activity id, JSON-encoded.

    Args:
        info: the activity's info (default: ``temporalio.activity.info()`` of the running one).

    Raises:
        ConfigurationError: not inside an activity, or the activity has no workflow run (a
            standalone activity: give its effects explicit keys).
    """
    if info is None:
        try:
            info = activity.info()
        except RuntimeError as exc:
            raise ConfigurationError("activity_scope() is used outside a Temporal activity") from exc
    if not info.workflow_run_id:
        raise ConfigurationError(
            f"activity {info.activity_id!r} has no workflow run id: pass key= explicitly"
        )
    return json.dumps(["temporal", info.workflow_namespace, info.workflow_run_id, info.activity_id])


@contextlib.contextmanager
def activity_scope(info: activity.Info | None = None) -> Iterator[Scope]:
    """Run a block of a Temporal activity as the unit of work (workflow run id, activity id).

    Raises:
        ConfigurationError: see :func:`activity_scope_id`.
    """
    with scope(activity_scope_id(info)) as unit:
        yield unit


temporal_scoped: ScopedDecorator = scoped_by(activity_scope)
"""Run an activity function (sync or async) inside :func:`activity_scope`.

Apply it under ``@activity.defn``, so it runs inside the activity.
"""
