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
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

from mcp import types
from mcp.shared.exceptions import MCPError

from sagaguard.connectors.declare import ToolDeclaration
from sagaguard.idempotency.effect import Policy
from sagaguard.idempotency.errors import ConfigurationError, NotApplied
from sagaguard.idempotency.records import Disposition

__all__ = [
    "IDEMPOTENCY_META_KEY",
    "InvalidArguments",
    "InvalidKey",
    "LookupTool",
    "ErrorText",
    "Mode",
    "OnToolError",
    "ServerGone",
    "ToolFailed",
    "ToolFailedAmbiguous",
    "ToolPolicy",
    "check_arguments",
    "check_key",
    "guard_options",
    "is_failure",
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


class InvalidArguments(ConfigurationError):
    """A tool call's arguments are not JSON (a ``Decimal``, ``datetime``, ``set``, ``bytes``, a
    tuple, a non-string key, NaN): refused before anything is recorded or sent.

    Attributes:
        path: where in the arguments the bad value is (``amount``, ``items.0``).
    """

    def __init__(self, path: str, value: object) -> None:
        super().__init__(
            f"MCP tool argument {path or '(the arguments)'!r} is a {type(value).__name__}, not JSON "
            "(str, int, float, bool, None, list, dict with str keys): convert it before the call"
        )
        self.path = path


class InvalidKey(ConfigurationError):
    """An idempotency key that is not a non-empty string (an int, an empty string, an object).

    Treating it as no key would make a retry a second call, so it is refused before anything is
    recorded or sent.
    """


_JSON_SCALARS = (str, bool, int, type(None))


def check_arguments(arguments: object, path: str = "") -> None:
    """Refuse arguments that are not JSON as the wire carries it, before anything is sent.

    Only ``dict`` (with ``str`` keys), ``list``, ``str``, ``int``, ``bool``, ``None`` and finite
    ``float`` pass; no conversion is guessed (a ``Decimal`` amount, a ``datetime``, a ``set`` or
    ``bytes`` are the caller's to convert, in the form the tool's schema asks for).

    Raises:
        InvalidArguments: the first value that is not JSON, with its path.
    """
    kind = type(arguments)
    if kind in _JSON_SCALARS:
        return
    if kind is float:
        if not math.isfinite(cast(float, arguments)):
            raise InvalidArguments(path, arguments)
        return
    if kind is list:
        for index, item in enumerate(cast(list[Any], arguments)):
            check_arguments(item, f"{path}.{index}" if path else str(index))
        return
    if kind is dict:
        for name, item in cast(dict[Any, Any], arguments).items():
            if type(name) is not str:
                raise InvalidArguments(f"{path}.{name!r}" if path else repr(name), name)
            check_arguments(item, f"{path}.{name}" if path else name)
        return
    raise InvalidArguments(path, arguments)


def check_key(key: object, what: str = "key") -> str:
    """``key`` if it is a non-empty string.

    Raises:
        InvalidKey: anything else (an int, an empty string, an object).
    """
    if type(key) is not str or not key:
        raise InvalidKey(f"{what} {key!r} ({type(key).__name__}): a non-empty string, or none at all")
    return key


class ServerGone(NotApplied):
    """The connection to the MCP server is closed (the server died or hung up): the call was not
    sent. Retryable: the call's record is released, not left in doubt, so the same call made again
    (on a new session, or once a reconnecting upstream is back) is sent then.

    Attributes:
        server: the server's name.
    """

    def __init__(self, server: str, cause: str) -> None:
        super().__init__(
            f"MCP server {server!r} is gone ({cause}): the call was not sent; open a new session",
            retryable=True,
        )
        self.server = server


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
class ErrorText:
    """A failure check for servers that report a failed tool as text without ``isError`` (the
    reference ``mcp-server-sqlite`` answers ``Database error: ...``): a result whose text content matches
    ``pattern`` (``re.search``) is a failure, as if it said ``isError: true``.

    Declared as ``changes_world(failed_if=ErrorText(r"^Database error"))``, or ``"failed_if": "^Error:"``
    in the proxy's declarations file; an undo tool takes it as ``UndoTool(failed_if=...)``.
    """

    pattern: str
    """The regular expression searched in the result's text blocks (joined by newlines)."""

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ConfigurationError(f"ErrorText({self.pattern!r}): not a regular expression: {exc}") from exc

    def __call__(self, result: types.CallToolResult) -> bool:
        """Whether ``result`` is a failure."""
        text = "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))
        return re.search(self.pattern, text) is not None


FailureCheck = Callable[[types.CallToolResult], bool]
"""``failed_if(result)``: True when a result the server did not mark ``isError`` is a failure."""


def is_failure(result: types.CallToolResult, failed_if: FailureCheck | None) -> types.CallToolResult | None:
    """``result`` marked ``isError`` when it is a failure (its own flag, or ``failed_if``), else None."""
    if result.is_error:
        return result
    if failed_if is not None and failed_if(result):
        return result.model_copy(update={"is_error": True})
    return None


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
    failed_if: FailureCheck | None = None
    """A failure check for results without ``isError`` (:class:`ErrorText`)."""

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
    failed_if = options.pop("failed_if", None)
    if failed_if is not None and not callable(failed_if):
        raise ConfigurationError(f"changes_world(failed_if={failed_if!r}): a check such as ErrorText(...)")
    if lookup is not None and not isinstance(lookup, LookupTool):
        raise ConfigurationError(f"changes_world(lookup={lookup!r}): a LookupTool")
    if lookup is not None and "reconciler" in options:
        raise ConfigurationError("changes_world(lookup=..., reconciler=...): one way to ask, not two")
    resend = bool(options.get("provider_idempotent"))
    mode = Mode.RESEND if resend else Mode.AT_MOST_ONCE
    kept = MappingProxyType(options)
    return ToolPolicy(
        mode, "declared changes_world", kept, on_error, declaration.undo, declaration.pivot, lookup,
        failed_if,
    )  # fmt: skip


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
