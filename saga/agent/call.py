"""What an agent step's journal row records about its tool call, and how its rows are named.

An agent step's row holds, in its ``result`` column, the tool call as JSON: the tool's name, the
guarded effect's name and explicit key, the recorded arguments and (once the call returned) its
result. It is written with the STARTED row, so the undo has the arguments even when the call's
outcome was never recorded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sagaguard.idempotency.codec import Codec
from sagaguard.saga.records import StepRecord

__all__ = ["RUN_PREFIX", "TOOL_PREFIX", "ToolCall", "run_step_name", "tool_step_name"]

TOOL_PREFIX = "tool."
"""Rows of tool calls are named ``tool.{tool}.{index}``."""
RUN_PREFIX = "agent.run."
"""Rows of the run itself (where it failed, or where the worker parks it) are ``agent.run.{index}``."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_ANY: Codec[Any] = Codec(Any)


def tool_step_name(tool: str, index: int) -> str:
    """The row name of a call of ``tool`` at ``index`` (characters a step name cannot hold become
    ``_``; the index keeps it unique)."""
    return f"{TOOL_PREFIX}{_UNSAFE.sub('_', tool)[:80]}.{index}"


def run_step_name(index: int) -> str:
    """The row name of the run's own row at ``index``."""
    return f"{RUN_PREFIX}{index}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One compensatable or pivot tool call, as its journal row records it.

    Attributes:
        tool: the tool's name.
        effect: the guarded effect's name (``agent.tool.{tool}``).
        key: the effect's explicit key (the run's id and the call's id).
        arguments: the recorded arguments, as plain JSON.
        result: the recorded result, as plain JSON; None until ``done``.
        done: whether the call returned and its result is recorded.
    """

    tool: str
    effect: str
    key: str
    arguments: Any
    result: Any = None
    done: bool = False

    @classmethod
    def of(cls, tool: str, key: str, arguments: Any) -> ToolCall:
        """A call about to run; ``arguments`` are stored through the JSON codec (dataclasses and
        pydantic models become plain JSON).

        Raises:
            CodecError: the arguments cannot be stored.
        """
        return cls(tool, f"agent.tool.{tool}", key, json.loads(_ANY.encode(arguments)))

    def returned(self, result: Any) -> ToolCall:
        """This call with its result recorded.

        Raises:
            CodecError: the result cannot be stored.
        """
        stored = json.loads(_ANY.encode(result))
        return ToolCall(self.tool, self.effect, self.key, self.arguments, stored, done=True)

    def as_json(self) -> dict[str, Any]:
        """The JSON object the row's ``result`` column holds."""
        return {
            "tool": self.tool,
            "effect": self.effect,
            "key": self.key,
            "arguments": self.arguments,
            "result": self.result,
            "done": self.done,
        }

    def encode(self) -> str:
        """:meth:`as_json` as text."""
        return json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: Any) -> ToolCall | None:
        """The call an object written by :meth:`as_json` describes; None for anything else."""
        if not isinstance(data, dict) or not isinstance(data.get("key"), str):
            return None
        return cls(
            str(data.get("tool", "")),
            str(data.get("effect", "")),
            data["key"],
            data.get("arguments"),
            data.get("result"),
            bool(data.get("done", False)),
        )

    @classmethod
    def of_row(cls, row: StepRecord) -> ToolCall | None:
        """The call a tool step's row records; None for a row of another kind."""
        if not row.name.startswith(TOOL_PREFIX) or row.result is None:
            return None
        try:
            return cls.from_json(json.loads(row.result))
        except ValueError:
            return None
