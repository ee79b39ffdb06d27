"""sagaguard.connectors.declare: one declaration of what a tool does to the world, read the same way from a
plain function, a LangChain tool, an Agents SDK function tool or a mapping given to the adapter."""

from __future__ import annotations

import pytest
from agents import function_tool
from langchain_core.tools import tool

from sagaguard.connectors.declare import (
    ToolDeclaration,
    changes_world,
    declaration_of,
    read_only,
    tool_options,
)
from sagaguard.idempotency import ConfigurationError, OutcomeUnknown, Policy
from sagaguard.idempotency.effect import NO_RETRY
from sagaguard.idempotency.records import Disposition


def reconcile(request: object) -> None:
    return None


def test_undeclared_tools_are_read_only() -> None:
    def search(q: str) -> str:
        return q

    assert declaration_of(search, "search") is read_only
    options = tool_options(read_only)
    assert options["policy"] is Policy.AT_LEAST_ONCE
    assert options["classify"](ValueError("x")) is Disposition.RETRYABLE  # an error is not a doubt
    assert options["classify"](KeyboardInterrupt()) is None


def test_the_declaration_is_found_under_every_framework_s_tool() -> None:
    @tool
    @changes_world
    def pay_lc(order: str) -> str:
        """Pay."""
        return order

    @function_tool
    @changes_world(reconciler=reconcile)
    def pay_sdk(order: str) -> str:
        """Pay."""
        return order

    @changes_world
    @function_tool
    def refund_sdk(order: str) -> str:
        """Refund."""
        return order

    @changes_world
    @tool
    def refund_lc(order: str) -> str:
        """Refund."""
        return order

    assert declaration_of(pay_lc, "pay_lc").changes_world
    assert declaration_of(refund_lc, "refund_lc").changes_world  # kept on the pydantic tool object
    found = declaration_of(pay_sdk, "pay_sdk")
    assert found.changes_world and found.options == {"reconciler": reconcile}
    assert declaration_of(refund_sdk, "refund_sdk").changes_world


def test_a_world_changing_tool_is_at_most_once_and_its_options_apply() -> None:
    options = tool_options(changes_world(reconciler=reconcile))
    assert options["policy"] is Policy.AT_MOST_ONCE
    assert options["reconciler"] is reconcile
    # A doubt raised by an effect inside the tool is that effect's: the tool's claim is released.
    assert options["classify"](OutcomeUnknown.__new__(OutcomeUnknown)) is Disposition.RETRYABLE
    assert options["classify"](ConnectionResetError()) is None  # the tool's own doubt: its policy


@pytest.mark.parametrize(
    ("declaration", "policy", "retries"),
    [
        pytest.param(read_only, Policy.AT_LEAST_ONCE, False, id="read-only"),
        pytest.param(changes_world(undo="cancel"), Policy.AT_LEAST_ONCE, False, id="compensatable"),
        pytest.param(changes_world(pivot=True), Policy.AT_MOST_ONCE, True, id="pivot"),
        pytest.param(changes_world(), Policy.AT_MOST_ONCE, True, id="changes-world"),
        pytest.param(
            changes_world(undo="cancel", policy="at_most_once"), "at_most_once", False, id="said-at-most-once"
        ),
    ],
)
def test_the_defaults_by_declaration(
    declaration: ToolDeclaration, policy: Policy | str, retries: bool
) -> None:
    """The shortest declaration is the one that works: a compensatable step is at least once (its
    body re-runs in the same scope after a crash, its guarded effects replay), never retried inside
    its claim; a pivot and a tool without an undo stay at most once; the declaration's own policy wins."""
    options = tool_options(declaration)
    assert options["policy"] == policy
    assert ("retry" not in options) is retries  # absent: the guard's default; NO_RETRY for tools
    if not retries:
        assert options["retry"] is NO_RETRY
    if declaration.changes_world:
        # A doubt raised by an effect inside the tool is that effect's: the tool's claim is released.
        assert options["classify"](OutcomeUnknown.__new__(OutcomeUnknown)) is Disposition.RETRYABLE
        assert options["classify"](ConnectionResetError()) is None  # the tool's own error: default


def test_the_adapter_policy_overrides_a_compensatable_step_s_default() -> None:
    assert tool_options(changes_world(undo="cancel"), "at_most_once")["policy"] is Policy.AT_MOST_ONCE


def test_a_mapping_wins_and_the_adapter_policy_overrides_every_declaration() -> None:
    declared = changes_world(lambda: None)
    assert declaration_of(declared, "x", {"x": read_only}) is read_only
    assert tool_options(read_only, "at_most_once")["policy"] is Policy.AT_MOST_ONCE
    assert tool_options(changes_world(), Policy.AT_LEAST_ONCE)["policy"] is Policy.AT_LEAST_ONCE


# undo= and pivot= are the tool's undo and kind in an agent saga (tests/test_agent_saga_langgraph.py)
@pytest.mark.parametrize("fixed", ["key", "arguments", "result_type", "kind"])
def test_options_the_adapter_sets_are_refused(fixed: str) -> None:
    with pytest.raises(ConfigurationError, match=fixed):
        changes_world(**{fixed: None})


def test_a_declaration_is_a_frozen_value() -> None:
    with pytest.raises(AttributeError):
        read_only.changes_world = True  # type: ignore[misc]
    assert ToolDeclaration() == read_only
