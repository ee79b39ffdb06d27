"""OpenTelemetry for the connectors: what model calls cost, and what the journal saved.

Depends on ``opentelemetry-api`` only: without an SDK configured every call here is a no-op.

- ``sagaguard.llm.calls`` ({call}): model calls, by ``sagaguard.llm.source``: ``provider`` (paid:
  the model was asked) or ``journal`` (saved: a replay or a reconciled answer returned the recorded
  response).
- ``sagaguard.llm.tokens`` ({token}): their tokens, by the same source and ``gen_ai.token.type``
  (``input`` / ``output``), so ``source=journal`` is the tokens that replays saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics

__all__ = ["llm_calls", "llm_tokens", "record_llm_call", "usage_of"]

_meter = metrics.get_meter("sagaguard.connectors")
llm_calls = _meter.create_counter(
    "sagaguard.llm.calls",
    unit="{call}",
    description="Model calls by source: provider (paid) or journal (replayed, saved)",
)
llm_tokens = _meter.create_counter(
    "sagaguard.llm.tokens",
    unit="{token}",
    description="Model tokens by source (provider: paid; journal: saved by replays) and token type",
)


def record_llm_call(name: str, *, paid: bool, input_tokens: int, output_tokens: int) -> None:
    """Count one model call of the effect ``name`` and its tokens."""
    source = "provider" if paid else "journal"
    attrs = {"sagaguard.llm.source": source, "sagaguard.effect.name": name}
    llm_calls.add(1, attrs)
    if input_tokens:
        llm_tokens.add(input_tokens, {**attrs, "gen_ai.token.type": "input"})
    if output_tokens:
        llm_tokens.add(output_tokens, {**attrs, "gen_ai.token.type": "output"})


def usage_of(result: Any) -> tuple[int, int]:
    """(input, output) tokens of an OpenAI-shaped response (chat ``prompt_tokens`` /
    ``completion_tokens``, or ``input_tokens`` / ``output_tokens``); (0, 0) when it has none."""
    usage = result.get("usage") if isinstance(result, Mapping) else getattr(result, "usage", None)
    if usage is None:
        return 0, 0

    def pick(*names: str) -> int:
        for name in names:
            value = usage.get(name) if isinstance(usage, Mapping) else getattr(usage, name, None)
            if isinstance(value, int):
                return value
        return 0

    return pick("prompt_tokens", "input_tokens"), pick("completion_tokens", "output_tokens")
