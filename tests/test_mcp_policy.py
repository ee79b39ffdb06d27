"""The pure parts of sagaguard.connectors.mcp, table-tested: a tool's mode from its annotations and from a
declaration, the guard options of each mode, how an ``isError`` result and a protocol error are
classified, the undo's arguments, the proxy's call key, the text a model reads; and the public API.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
from mcp import types
from mcp.shared.exceptions import MCPError

import sagaguard.connectors.mcp
from sagaguard.connectors.declare import changes_world, read_only
from sagaguard.connectors.mcp import (
    LookupTool,
    Mode,
    OnToolError,
    ToolFailed,
    ToolFailedAmbiguous,
    ToolPolicy,
    UndoTool,
    guard_options,
    policy_for,
    policy_from_annotations,
    undo_arguments,
)
from sagaguard.connectors.mcp.proxy import call_key
from sagaguard.connectors.mcp.tools import result_text
from sagaguard.idempotency.effect import Policy, classify
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.records import Disposition


def tool(**hints: Any) -> types.Tool:
    annotations = types.ToolAnnotations(**hints) if hints else None
    return types.Tool(name="t", input_schema={"type": "object"}, annotations=annotations)


@pytest.mark.parametrize(
    ("hints", "mode"),
    [
        ({"read_only_hint": True}, Mode.PASS_THROUGH),
        ({"read_only_hint": True, "destructive_hint": True}, Mode.PASS_THROUGH),
        ({"idempotent_hint": True}, Mode.RESEND),
        ({"idempotent_hint": True, "destructive_hint": True}, Mode.RESEND),
        ({"destructive_hint": True}, Mode.AT_MOST_ONCE),
        ({"destructive_hint": False, "open_world_hint": False}, Mode.AT_MOST_ONCE),
        ({"open_world_hint": True}, Mode.AT_MOST_ONCE),
        ({"read_only_hint": False, "idempotent_hint": False}, Mode.AT_MOST_ONCE),
        ({}, Mode.AT_MOST_ONCE),  # no annotations: the spec's defaults (destructive, open world)
    ],
)
def test_the_annotations_decide_the_default_mode(hints: dict[str, Any], mode: Mode) -> None:
    assert policy_from_annotations(tool(**hints)).mode is mode


def test_a_tool_the_server_never_listed_is_at_most_once() -> None:
    assert policy_from_annotations(None).mode is Mode.AT_MOST_ONCE


def test_a_declaration_wins_over_the_annotations() -> None:
    listed = tool(read_only_hint=True)
    assert policy_for("t", listed, {"t": changes_world()}).mode is Mode.AT_MOST_ONCE
    assert policy_for("t", tool(destructive_hint=True), {"t": read_only}).mode is Mode.PASS_THROUGH
    resend = policy_for("t", None, {"t": changes_world(provider_idempotent=True)})
    assert resend.mode is Mode.RESEND
    undone = policy_for("t", None, {"t": changes_world(undo="refund", on_error="ambiguous")})
    assert (undone.undo, undone.on_error) == ("refund", OnToolError.AMBIGUOUS)
    assert "on_error" not in undone.options  # ours, not a Guard option
    mine = ToolPolicy(Mode.RESEND, "mine")
    assert policy_for("t", listed, {"t": mine}) is mine
    assert policy_for("other", listed, {"t": mine}).mode is Mode.PASS_THROUGH  # its own annotations


def test_a_bad_on_error_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="on_error"):
        policy_for("t", None, {"t": changes_world(on_error="maybe")})


def test_a_lookup_is_the_calls_one_way_to_ask_the_server() -> None:
    lookup = LookupTool("find_charge")
    assert policy_for("t", None, {"t": changes_world(lookup=lookup)}).lookup is lookup
    with pytest.raises(ConfigurationError, match="LookupTool"):
        policy_for("t", None, {"t": changes_world(lookup="find_charge")})
    with pytest.raises(ConfigurationError, match="not two"):
        policy_for("t", None, {"t": changes_world(lookup=lookup, reconciler=print)})


def test_the_guard_options_of_each_mode() -> None:
    once = guard_options(ToolPolicy(Mode.AT_MOST_ONCE, ""))
    assert once["policy"] is Policy.AT_MOST_ONCE and once["provider_idempotent"] is False
    assert guard_options(ToolPolicy(Mode.RESEND, ""))["provider_idempotent"] is True
    reconciler = object()
    assert (
        guard_options(ToolPolicy(Mode.AT_MOST_ONCE, "", {"reconciler": reconciler}))["reconciler"]
        is reconciler
    )


def _disposition(exc: BaseException) -> Disposition:
    options = guard_options(ToolPolicy(Mode.AT_MOST_ONCE, ""))
    return classify(exc, options["classify"], options["permanent"], ())


ERROR = types.CallToolResult(content=[types.TextContent(type="text", text="card declined")], is_error=True)


@pytest.mark.parametrize(
    ("exc", "disposition"),
    [
        (ToolFailed(ERROR), Disposition.PERMANENT),  # isError, not applied: recorded FAILED
        (ToolFailedAmbiguous(ERROR), Disposition.AMBIGUOUS),  # isError, declared ambiguous
        (MCPError(types.INVALID_PARAMS, "bad arguments"), Disposition.PERMANENT),
        (MCPError(types.METHOD_NOT_FOUND, "no such tool"), Disposition.PERMANENT),
        (MCPError(types.INTERNAL_ERROR, "crashed"), Disposition.AMBIGUOUS),
        (ConnectionResetError(), Disposition.AMBIGUOUS),
        (TimeoutError(), Disposition.AMBIGUOUS),
    ],
)
def test_how_failures_are_classified(exc: BaseException, disposition: Disposition) -> None:
    assert _disposition(exc) is disposition


def test_a_tool_failure_is_rebuilt_from_its_one_argument() -> None:
    failed = ToolFailed(ERROR)
    again = ToolFailed(*failed.args)  # what a replay of the FAILED record does
    assert again.result == ERROR


def test_the_undo_arguments_are_read_from_the_recorded_call() -> None:
    undo = UndoTool("refund", arguments={"payment_intent": "result.structuredContent.id",
                                         "charge_key": "idempotency_key", "amount": "arguments.amount",
                                         "first": "result.content.0.text"})  # fmt: skip
    call = {"tool": "charge", "arguments": {"amount": 420}, "idempotency_key": "k"}
    result = {"content": [{"type": "text", "text": "ok"}], "structuredContent": {"id": "pi_1"}}
    assert undo_arguments(undo, call, result) == {"payment_intent": "pi_1", "charge_key": "k", "amount": 420,
                                                  "first": "ok"}  # fmt: skip
    # The call's outcome unknown (no result): what the result would say is left out.
    assert undo_arguments(undo, call, None) == {"charge_key": "k", "amount": 420}
    built = UndoTool("close_issue", arguments=lambda c, r: {"number": r["structuredContent"]["n"]})
    assert undo_arguments(built, call, {"structuredContent": {"n": 7}}) == {"number": 7}


def test_the_proxy_keys_a_call_on_the_clients_key_else_on_its_session_and_request() -> None:
    assert call_key("k-1", "s1", 3) == call_key("k-1", "s2", 9)  # the client's key names the call
    assert call_key(None, "s1", 3) != call_key(None, "s1", 4)  # two requests: two calls
    assert call_key(None, "s1", 3) != call_key(None, "s2", 3)  # two sessions: two calls
    assert call_key(None, "s1", 3) != call_key("s1", "x", 3)


def test_what_the_model_reads_of_a_result() -> None:
    assert (
        result_text(types.CallToolResult(content=[], structured_content={"b": 1, "a": 2}))
        == '{"a": 2, "b": 1}'
    )
    assert result_text(ERROR) == "Error: card declined"


def test_exported_members() -> None:
    """The public API of sagaguard.connectors.mcp, locked: a name added or dropped is a decision."""
    assert sorted(sagaguard.connectors.mcp.__all__) == sorted([
        "IDEMPOTENCY_META_KEY", "ErrorText", "GuardedSession", "InvalidArguments", "InvalidKey",
        "LookupTool", "McpServers", "McpUndos", "Mode", "OnToolError", "ServerGone",
        "ToolFailed", "ToolFailedAmbiguous", "ToolPolicy", "ToolSession", "UndoFailed", "UndoTool",
        "guard_options", "http_session", "pending_result", "policy_for", "policy_from_annotations",
        "stdio_session", "undo_arguments",
    ])  # fmt: skip
    for module in ("policy", "session", "undo", "proxy", "tools", "cli"):
        found = importlib.import_module(f"sagaguard.connectors.mcp.{module}")
        assert found.__doc__, module
        for name in found.__all__:
            member = getattr(found, name)
            assert isinstance(member, str) or member.__doc__, f"{module}.{name}"
    json.dumps(sagaguard.connectors.mcp.IDEMPOTENCY_META_KEY)
