"""Small pieces every ``sagaguard`` subcommand module shares (effects, outbox, sagas, llm)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["duration", "positive"]


def duration(seconds: float) -> str:
    """A short human duration: ``42s``, ``3m05s``, ``2h10m``, ``4d03h``."""
    s = int(max(seconds, 0.0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86_400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86_400}d{s % 86_400 // 3600:02d}h"


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse ``type=`` that accepts a finite number > 0 of ``kind``."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse
