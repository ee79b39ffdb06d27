"""Numbered kill points for the research agents: ``reach("model_answered")`` is ``model_answered#1`` the
first time this process gets there, ``model_answered#2`` the second, and so on.

The process dies with a real SIGKILL (:func:`sagaguard.idempotency.testing.sigkill`) when
``$SAGAGUARD_CRASH_AT`` names the point reached, either with its number (``model_answered#7``) or, for points
reached once, without (``enter:pay``). Numbers count within one process: the sweep sets the variable only for
the first (fresh) run of an experiment, so they number the run from its start.

With ``$SAGAGUARD_RESEARCH_TRACE`` set to a file path, every point reached is appended to it, one
name per line: that is how a child lists its kill points (the sweep's clean run records them).
"""

from __future__ import annotations

import os
import threading

from sagaguard.idempotency.testing import CRASH_ENV, sigkill

__all__ = ["TRACE_ENV", "reach"]

TRACE_ENV = "SAGAGUARD_RESEARCH_TRACE"
"""A file that every reached point is appended to (one name per line)."""

_lock = threading.Lock()
_counts: dict[str, int] = {}


def reach(name: str, *, numbered: bool = True) -> str:
    """Mark that this process reached the point ``name``; die here if it is the crash point.

    Args:
        name: the point's name, without a number.
        numbered: number it (``name#n``, the n-th time in this process); False for points
            reached once per run.

    Returns:
        The full name of the point reached.
    """
    with _lock:
        _counts[name] = n = _counts.get(name, 0) + 1
    full = f"{name}#{n}" if numbered else name
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a", encoding="utf-8") as out:
            out.write(full + "\n")
    if os.environ.get(CRASH_ENV, "").strip() == full:
        sigkill(full)
    return full
