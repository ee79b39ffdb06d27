"""How an MCP tool's calls are guarded: defaults from its annotations, overridden per tool.

An MCP server describes each tool with hints (``ToolAnnotations``; the spec's defaults in brackets):
``readOnlyHint`` [false], ``destructiveHint`` [true], ``idempotentHint`` [false] and
``openWorldHint`` [true]. They decide a tool's :class:`Mode`:

============================  ================  ==================================================
annotations                   mode              a call ...
============================  ================  ==================================================
``readOnlyHint: true``        ``pass_through``  is sent as it is, every time (nothing to guard)
``idempotentHint: true``      ``resend``        is guarded; in doubt after a crash, it is re-sent
                                                under the same idempotency key (the server, told
                                                so by its hint, absorbs the repeat)
anything else, or none        ``at_most_once``  is guarded; in doubt after a crash, it is resolved
(destructive, open world)                       by its reconciler when it has one, else parked
                                                for an operator (``sagaguard effects resolve``)
============================  ================  ==================================================

Hints come from the server: the MCP spec says a client should not trust them from a server it does
not trust. Declare a tool yourself (``declare={"search": read_only, "pay": changes_world(...)}``,
with :mod:`sagaguard.connectors.declare`) and the declaration wins:
:data:`~sagaguard.connectors.declare.read_only` is ``pass_through``,
:func:`~sagaguard.connectors.declare.changes_world` is ``at_most_once`` (``resend`` with
``provider_idempotent=True``), its Guard options, undo and pivot carried along.

**A result with** ``isError: true`` **is a tool failure the server reported** (the tool ran and
said it failed: a declined card, a validation error). By default it is *not applied*
(:attr:`OnToolError.NOT_APPLIED`): the call is recorded FAILED, a re-run of the same call gets the
same error result without reaching the server, the model may make a new call (a new tool call id,
so a new key), and an agent saga does not undo it. A tool whose failures can leave work half done
says :attr:`OnToolError.AMBIGUOUS` (``on_error="ambiguous"`` in its declaration's options): the
call is then in doubt, resolved as its mode says. A protocol error the server answers instead of a
result (``MCPError``: unknown tool, invalid arguments) is *not applied* too; a lost connection or a
timeout is ambiguous.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from mcp import types
from mcp.shared.exceptions import MCPError

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.idempotency.effect import Policy
from sagaguard.idempotency.errors import ConfigurationError, NotApplied
from sagaguard.idempotency.records import Disposition

__all__ = [
    "IDEMPOTENCY_META_KEY",
    "LookupTool",
    "Mode",
    "OnToolError",
    "ToolFailed",
    "ToolFailedAmbiguous",
    "ToolPolicy",
    "guard_options",
    "pick",
    "policy_for",
    "policy_from_annotations",
]

IDEMPOTENCY_META_KEY = "io.sagaguard/idempotency-key"
"""The request ``_meta`` entry that carries a guarded call's idempotency key to the server (and, at
the proxy, from a client that sends one). A server that deduplicates on it makes a re-send safe."""

_NOT_APPLIED_CODES = frozenset(
    {types.PARSE_ERROR, types.INVALID_REQUEST, types.METHOD_NOT_FOUND, types.INVALID_PARAMS}
)
"""JSON-RPC errors meaning the server refused the request before running the tool."""


class Mode(enum.StrEnum):
    """How a tool's calls are guarded."""

    PASS_THROUGH = "pass_through"
    """Not guarded: sent every time (read-only tools)."""
    RESEND = "resend"
    """Guarded; in doubt, re-sent under the same idempotency key (idempotent tools)."""
    AT_MOST_ONCE = "at_most_once"
    """Guarded; in doubt, reconciled or parked for an operator, never re-sent blindly."""


class OnToolError(enum.StrEnum):
    """What a result with ``isError: true`` means for the call's record."""

    NOT_APPLIED = "not_applied"
    """The tool failed and changed nothing: recorded FAILED, its error result replayed."""
    AMBIGUOUS = "ambiguous"
    """The tool failed and may have done part of its work: the call is in doubt."""


class ToolFailed(NotApplied):
    """A tool answered with ``isError: true`` and its failure is *not applied*.

    The guard records it FAILED and re-raises it on a replay, rebuilt from its one argument (the
    result as JSON), so the session hands the same error result back.

    Attributes:
        result: the tool's error result.
    """

    def __init__(self, result: str | types.CallToolResult) -> None:
        text = result if isinstance(result, str) else result.model_dump_json(by_alias=True, exclude_none=True)
        super().__init__("the tool answered isError: true")
        self.args = (text,)
        self.result = types.CallToolResult.model_validate_json(text)


class ToolFailedAmbiguous(Exception):
    """A tool answered ``isError: true`` and its failure may have done part of its work."""

    def __init__(self, result: types.CallToolResult) -> None:
        super().__init__("the tool answered isError: true; it may have done part of its work")
        self.result = result


@dataclass(frozen=True)
class LookupTool:
    """A read-only tool that tells whether a call left in doubt happened, by the idempotency key
    it was sent under: ``changes_world(lookup=LookupTool("find_charge"))``.

    When a call is in doubt, the session calls ``tool`` with arguments read by dotted paths from
    ``{"arguments": <the call's arguments>, "idempotency_key": <its key>}`` (paths that find nothing
    are left out). A result whose ``found`` path is true means the call happened: that result is
    recorded as the call's. False means it did not: the call is sent now, under the same key. An
    error result, or no answer, leaves the call in doubt (resend or park, as its mode says).
    """

    tool: str
    """The lookup tool's name, on the same server."""
    arguments: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({"idempotency_key": "idempotency_key"})
    )
    """Lookup argument name to a dotted path (default: ``idempotency_key`` -> the call's key)."""
    found: str = "structuredContent.found"
    """The path, in the lookup's result as the wire spells it, of whether the call happened."""


@dataclass(frozen=True)
class ToolPolicy:
    """How one tool's calls are guarded (see the module docstring)."""

    mode: Mode
    """The tool's mode."""
    reason: str
    """Why: which annotation or declaration decided it (``sagaguard mcp tools`` prints it)."""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Other :meth:`~sagaguard.idempotency.guard.Guard.run` options for the call (``reconciler=``, ...)."""
    on_error: OnToolError = OnToolError.NOT_APPLIED
    """What an ``isError`` result means."""
    undo: str | None = None
    """In an agent saga: the registered name of the call's undo."""
    pivot: bool = False
    """In an agent saga: the tool is the run's pivot."""
    lookup: LookupTool | None = None
    """How to ask the server about a call in doubt (the call's reconciler)."""

    @property
    def guarded(self) -> bool:
        """Whether calls are guarded effects (every mode but ``pass_through``)."""
        return self.mode is not Mode.PASS_THROUGH


def policy_from_annotations(tool: types.Tool | None) -> ToolPolicy:
    """The default policy of ``tool`` from its annotations (None: a tool the server never listed,
    which is ``at_most_once`` as the spec's defaults say)."""
    hints = None if tool is None else tool.annotations
    if tool is None:
        return ToolPolicy(Mode.AT_MOST_ONCE, "not listed by the server")
    if hints is None:
        return ToolPolicy(Mode.AT_MOST_ONCE, "no annotations (the spec's defaults: destructive, open world)")
    if hints.read_only_hint:
        return ToolPolicy(Mode.PASS_THROUGH, "readOnlyHint")
    if hints.idempotent_hint:
        return ToolPolicy(Mode.RESEND, "idempotentHint")
    if hints.destructive_hint is False and hints.open_world_hint is False:
        return ToolPolicy(Mode.AT_MOST_ONCE, "additive, closed world, not idempotent")
    return ToolPolicy(Mode.AT_MOST_ONCE, "destructive or open world, not idempotent")


def _from_declaration(declaration: ToolDeclaration) -> ToolPolicy:
    if not declaration.changes_world:
        return ToolPolicy(Mode.PASS_THROUGH, "declared read_only")
    options = dict(declaration.options)
    on_error = OnToolError(options.pop("on_error", OnToolError.NOT_APPLIED))
    lookup = options.pop("lookup", None)
    if lookup is not None and not isinstance(lookup, LookupTool):
        raise ConfigurationError(f"changes_world(lookup={lookup!r}): a LookupTool")
    if lookup is not None and "reconciler" in options:
        raise ConfigurationError("changes_world(lookup=..., reconciler=...): one way to ask, not two")
    resend = bool(options.get("provider_idempotent"))
    mode = Mode.RESEND if resend else Mode.AT_MOST_ONCE
    kept = MappingProxyType(options)
    return ToolPolicy(
        mode, "declared changes_world", kept, on_error, declaration.undo, declaration.pivot, lookup
    )


def policy_for(
    name: str,
    tool: types.Tool | None,
    declare: Mapping[str, ToolDeclaration | ToolPolicy] | None = None,
) -> ToolPolicy:
    """The policy of the tool ``name``: the user's declaration when there is one, else the
    annotations' default.

    Raises:
        ConfigurationError: a declaration's ``on_error`` is not ``not_applied`` or ``ambiguous``.
    """
    found = (declare or {}).get(name)
    if found is None:
        return policy_from_annotations(tool)
    if isinstance(found, ToolPolicy):
        return found
    try:
        return _from_declaration(found)
    except ConfigurationError:
        raise
    except ValueError as exc:
        raise ConfigurationError(f"tool {name!r}: on_error must be 'not_applied' or 'ambiguous'") from exc


def _classify(exc: BaseException) -> Disposition | None:
    if isinstance(exc, ToolFailedAmbiguous):
        return Disposition.AMBIGUOUS
    if isinstance(exc, MCPError):
        return Disposition.PERMANENT if exc.code in _NOT_APPLIED_CODES else Disposition.AMBIGUOUS
    return None  # ToolFailed is permanent by its type; anything else is ambiguous


def guard_options(policy: ToolPolicy) -> dict[str, Any]:
    """The :meth:`~sagaguard.idempotency.guard.Guard.arun` options of a guarded call under ``policy``."""
    options: dict[str, Any] = {
        "policy": Policy.AT_MOST_ONCE,
        "provider_idempotent": policy.mode is Mode.RESEND,
        "classify": _classify,
        # Listed so that a replay rebuilds them as themselves (the classifier decides MCPError).
        "permanent": (ToolFailed, MCPError),
    }
    options.update(policy.options)
    return options


_MISSING = object()


def _at(source: Any, path: str) -> Any:
    found = source
    for part in path.split("."):
        if isinstance(found, Mapping) and part in found:
            found = found[part]
        elif isinstance(found, list) and part.isdigit() and int(part) < len(found):
            found = found[int(part)]
        else:
            return _MISSING
    return found


def pick(paths: Mapping[str, str], source: Any) -> dict[str, Any]:
    """``{name: the value at path in source}`` for each of ``paths`` (dotted: mapping keys and list
    indexes); a path that finds nothing, or None, is left out."""
    found = {name: _at(source, path) for name, path in paths.items()}
    return {name: value for name, value in found.items() if value is not _MISSING and value is not None}
