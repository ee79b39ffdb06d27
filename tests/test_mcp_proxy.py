"""MCP clients through ``sagaguard mcp proxy`` (stdio and streamable HTTP) in front of the payments
server; the proxy SIGKILLed after the server charged and before it recorded the answer. Counted at
the fakes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _mcpkit import CLI, SERVER, TESTS, counts, in_loop, serve_http, server_env, sink_fixture, stripe_fixture
from mcp import ClientSession, types
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from sagaguard.connectors.mcp import IDEMPOTENCY_META_KEY, http_session
from sagaguard.connectors.testing import LocalStripe
from sagaguard.connectors.testing.smtp import SmtpSink

__all__ = ["sink_fixture", "stripe_fixture"]  # the fixtures `sink` and `stripe`, re-used
pytestmark = pytest.mark.timeout(300)

CHARGE = {"amount": 420, "customer": "pm_card_visa"}


@pytest.fixture
def env(stripe: LocalStripe, sink: SmtpSink, tmp_path: Path) -> dict[str, str]:
    stripe.reset()
    sink.reset()
    return {**server_env(stripe, sink, tmp_path), "SAGAGUARD_STORE": f"sqlite:///{tmp_path / 'proxy.db'}"}


def proxy_command(env: dict[str, str], *extra: str) -> list[str]:
    return [sys.executable, "-c", CLI, "mcp", "proxy", "--server", "payments", *extra, "--",
            sys.executable, str(SERVER)]  # fmt: skip


async def through(
    params: StdioServerParameters, calls: list[tuple[str, dict[str, Any], str | None]]
) -> list[Any]:
    """Make ``calls`` (tool, arguments, idempotency key) through one client session to the proxy."""
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        found = []
        for name, arguments, key in calls:
            meta: Any = {IDEMPOTENCY_META_KEY: key} if key else None
            found.append(await session.call_tool(name, arguments, meta=meta))
        return found


def test_the_tools_command_says_how_each_tool_is_treated(env: dict[str, str]) -> None:
    tools = [sys.executable, "-c", CLI, "mcp", "tools", "--json"]
    with serve_http(env) as url:
        listed = [
            subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
            for argv in ([*tools, "--", sys.executable, str(SERVER)], [*tools, "--url", url])
        ]
    expected = {"find_charge": "pass_through", "charge": "at_most_once", "refund": "resend",
                "send_email": "at_most_once", "balance": "pass_through"}  # fmt: skip
    for done in listed:
        assert done.returncode == 0, done.stderr
        assert {row["name"]: row["mode"] for row in json.loads(done.stdout)["tools"]} == expected


def test_a_client_key_makes_a_retry_replay_and_no_key_never_swallows_a_repeat(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink
) -> None:
    command = proxy_command(env)
    params = StdioServerParameters(command=command[0], args=command[1:], env=env)
    calls = [("charge", CHARGE, "order-7"), ("charge", CHARGE, "order-7"), ("charge", CHARGE, None),
             ("charge", CHARGE, None)]  # fmt: skip
    first = in_loop(lambda: through(params, calls))
    assert first[0].structured_content == first[1].structured_content  # one key: one call
    assert first[2].structured_content["id"] != first[3].structured_content["id"]  # no key: two calls
    (again,) = in_loop(lambda: through(params, [("charge", CHARGE, "order-7")]))  # another proxy process
    assert again.structured_content == first[0].structured_content
    assert counts(stripe, sink)["charges"] == 3


def test_the_proxy_over_http_serves_many_clients_with_the_same_rules(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink
) -> None:
    with serve_http(env, proxy_command(env, "--http", "127.0.0.1:{port}")) as url:

        async def call() -> types.CallToolResult:
            async with http_session(url) as session:
                meta: Any = {IDEMPOTENCY_META_KEY: "order-8"}
                return await session.call_tool(
                    "send_email", {"to": "ana@example.com", "subject": "hi"}, meta=meta
                )

        first, second = in_loop(call), in_loop(call)  # two clients, one key

        async def reused() -> types.CallToolResult:
            async with http_session(url) as session:
                meta: Any = {IDEMPOTENCY_META_KEY: "order-8"}
                return await session.call_tool(
                    "send_email", {"to": "bob@example.com", "subject": "hi"}, meta=meta
                )

        with pytest.raises(MCPError) as refused:  # the same key with other arguments
            in_loop(reused)
        assert refused.value.code == types.INVALID_PARAMS
    assert first.structured_content == second.structured_content == {"sent": True, "to": "ana@example.com"}
    assert counts(stripe, sink)["emails"] == 1


SLOW = [
    pytest.mark.slow,
    pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow"),
]


@pytest.mark.parametrize(
    ("point", "charged"),
    [
        ("before_complete", 1),  # the server charged and answered; the proxy had not recorded it
        pytest.param("after_claim", 0, marks=SLOW),  # the proxy claimed the call, never sent it
    ],
)
def test_the_proxy_killed_mid_call_never_charges_again(
    point: str, charged: int, env: dict[str, str], stripe: LocalStripe, sink: SmtpSink
) -> None:
    crashing = StdioServerParameters(
        command=sys.executable, args=[str(TESTS / "_mcpproxychild.py"), env["SAGAGUARD_STORE"]],
        env={**env, "SAGAGUARD_CRASH_AT": point},
    )  # fmt: skip
    with pytest.raises(Exception):  # the proxy died: the client's call fails
        in_loop(lambda: through(crashing, [("charge", CHARGE, "order-9")]))
    assert counts(stripe, sink)["charges"] == charged
    command = proxy_command(env)
    params = StdioServerParameters(command=command[0], args=command[1:], env=env)
    (told,) = in_loop(lambda: through(params, [("charge", CHARGE, "order-9")]))  # the client retries
    assert told.is_error and told.structured_content["status"] == "pending"  # parked, not re-sent
    assert counts(stripe, sink)["charges"] == charged
