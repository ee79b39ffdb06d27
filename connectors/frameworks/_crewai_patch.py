"""How the CrewAI adapters patch CrewAI's pydantic objects in place, shared by ``crewai.py`` (tools,
models) and ``crewai_saga.py`` (kickoffs): one mark, so nothing is wrapped twice, and one way to
set an attribute that pydantic would refuse."""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["is_marked", "mark", "shadow"]

F = TypeVar("F")

MARK = "__sagaguard_crewai__"
"""Set on each function the adapters put in place of a CrewAI method."""


def mark(fn: F) -> F:
    """Mark ``fn`` as an adapter's replacement; returns it."""
    setattr(fn, MARK, True)
    return fn


def is_marked(instance: Any, name: str) -> bool:
    """Whether ``instance``'s ``name`` was already replaced by an adapter (on the instance)."""
    return bool(getattr(instance.__dict__.get(name), MARK, False))


def shadow(instance: Any, name: str, value: Any) -> None:
    """Set ``name`` on the instance itself.

    Pydantic refuses unknown attributes through ``__setattr__``; an instance attribute shadows the
    method and stays out of ``model_dump`` (so out of CrewAI's checkpoints).
    """
    object.__setattr__(instance, name, value)
