"""The guarded MCP session against a real MCP server (the SDK's server API, over stdio), whose tools
charge the local Stripe through the real ``stripe`` SDK and mail through the SMTP sink. Counts are
read at the fakes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import stripe as stripe_sdk
from _mcpkit import counts, in_loop, serve_http, server_env, server_params, sink_fixture, stripe_fixture
from mcp import types

from sagaguard.connectors.declare import changes_world, read_only
from sagaguard.connectors.in_doubt import ReturnPending
from sagaguard.connectors.mcp import (
    IDEMPOTENCY_META_KEY,
    GuardedSession,
    LookupTool,
    Mode,
    http_session,
    stdio_session,
)
from sagaguard.connectors.testing import LocalStripe
from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency import Guard, open_store, scope
from sagaguard.idempotency.errors import KeyConflict, NoScope, OutcomeUnknown
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import State

__all__ = ["sink_fixture", "stripe_fixture"]  # the fixtures `sink` and `stripe`, re-used
pytestmark = pytest.mark.timeout(120)

CHARGE = {"amount": 420, "customer": "pm_card_visa"}


@pytest.fixture(scope="module")
def http_server(
    stripe: LocalStripe, sink: SmtpSink, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One payments server over streamable HTTP for the module (the kill tests start their own)."""
    with serve_http(server_env(stripe, sink, tmp_path_factory.mktemp("marks"))) as url:
        yield url


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[Guard]:
    g = Guard(open_store(f"sqlite:///{tmp_path / 'effects.db'}"), lease=1.0)
    yield g
    g.close()


Body = Callable[[Any], Awaitable[Any]]


@dataclass
class World:
    """The fakes, and ways to reach the payments server."""

    stripe: LocalStripe
    sink: SmtpSink
    marks: Path
    url: str

    def counts(self) -> dict[str, int]:
        return counts(self.stripe, self.sink)

    def http(self, body: Body) -> Any:
        """Run ``body(session)`` against the module's HTTP server."""
        return in_loop(lambda: self._run(http_session(self.url), body))

    def stdio(self, body: Body, kill: str = "") -> Any:
        """Run ``body(session)`` against a freshly started stdio server (SIGKILLed at ``kill``)."""
        params = server_params(server_env(self.stripe, self.sink, self.marks, kill))
        return in_loop(lambda: self._run(stdio_session(params), body))

    @staticmethod
    async def _run(opened: Any, body: Body) -> Any:
        async with opened as session:
            return await body(session)


@pytest.fixture
def world(stripe: LocalStripe, sink: SmtpSink, tmp_path: Path, http_server: str) -> World:
    stripe.reset()
    sink.reset()
    return World(stripe, sink, tmp_path, http_server)


def test_the_tools_modes_come_from_their_annotations(world: World, guard: Guard) -> None:
    async def body(session: Any) -> dict[str, Mode]:
        guarded = GuardedSession(session, guard, server="payments")
        listed = await guarded.list_tools()
        return {tool.name: (await guarded.policy(tool.name)).mode for tool in listed.tools}

    modes = world.http(body)
    assert modes == {
        "find_charge": Mode.PASS_THROUGH,
        "charge": Mode.AT_MOST_ONCE, "refund": Mode.RESEND, "send_email": Mode.AT_MOST_ONCE,
        "balance": Mode.PASS_THROUGH,
    }  # fmt: skip


def test_a_rerun_returns_the_recorded_result_without_calling_the_server(world: World, guard: Guard) -> None:
    async def body(session: Any) -> list[types.CallToolResult]:
        guarded = GuardedSession(session, guard, server="payments")
        with scope("order-1"):
            return [
                await guarded.call_tool("charge", CHARGE, call_id="call_1"),
                await guarded.call_tool(
                    "send_email", {"to": "ana@example.com", "subject": "paid"}, call_id="call_2"
                ),
            ]

    first = world.http(body)
    again = world.http(body)  # a re-run: another process of the server, same ledger
    assert [r.structured_content for r in again] == [r.structured_content for r in first]
    assert isinstance(again[0], types.CallToolResult) and not again[0].is_error
    assert world.counts() == {"charges": 1, "refunds": 0, "emails": 1}


def test_the_idempotency_key_reaches_the_server_in_meta(world: World, guard: Guard) -> None:
    async def body(session: Any) -> types.CallToolResult:
        return await GuardedSession(session, guard, server="payments").call_tool("charge", CHARGE, key="k-1")

    result = world.http(body)
    sent = guard.provider_key(EffectIdentity.explicit(guard.namespace, "k-1", "mcp.payments.charge"))
    client = stripe_sdk.StripeClient("sk_test", base_addresses={"api": world.stripe.url})
    intent = client.v1.payment_intents.retrieve(result.structured_content["id"])
    assert intent.metadata["mcp_key"] == sent  # and Stripe got it as its Idempotency-Key
    assert IDEMPOTENCY_META_KEY == "io.sagaguard/idempotency-key"


def test_two_ledgers_calling_one_server_under_one_key_each_charge(world: World, tmp_path: Path) -> None:
    """Two ledgers (two SQLite files: staging and production) call the same tool under the same
    key: their MCP keys differ by the ledger id, so the server charges each once (before ledger ids
    the second call got the first one's PaymentIntent back)."""
    ids = []
    for name in ("staging", "production"):
        ledger = Guard(open_store(f"sqlite:///{tmp_path / name}.db"), lease=1.0)

        async def body(session: Any, ledger: Guard = ledger) -> types.CallToolResult:
            return await GuardedSession(session, ledger, server="payments").call_tool(
                "charge", CHARGE, key="k-9"
            )

        try:
            ids.append(world.http(body).structured_content["id"])
        finally:
            ledger.close()
            ledger.store.close()
    assert ids[0] != ids[1] and world.counts()["charges"] == 2


def test_read_only_tools_pass_through_and_declarations_win(world: World, guard: Guard) -> None:
    async def body(session: Any) -> list[Any]:
        plain = GuardedSession(session, guard, server="payments")
        declared = GuardedSession(session, guard, server="payments", declare={"balance": changes_world()})
        with scope("order-2"):
            seen = [(await plain.call_tool("balance")).structured_content["calls"] for _ in range(2)]
            seen += [(await declared.call_tool("balance", call_id="b")).structured_content["calls"]
                     for _ in range(2)]  # fmt: skip
        return seen

    assert world.http(body) == [1, 2, 3, 3]  # the declared one is guarded: replayed


def test_an_error_result_is_not_applied_and_replayed(world: World, guard: Guard) -> None:
    declined = {"amount": 420, "customer": "pm_card_chargeDeclined"}

    async def body(session: Any) -> list[types.CallToolResult]:
        guarded = GuardedSession(session, guard, server="payments")
        with scope("order-3"):
            return [await guarded.call_tool("charge", declined, call_id="call_1") for _ in range(2)]

    results = world.http(body)
    assert all(r.is_error for r in results)
    assert results[0].content == results[1].content
    assert world.stripe.counters()["declines"] == 1  # the second was the recorded error
    (record,) = guard.store.list(states=[State.FAILED])
    assert record.name == "mcp.payments.charge"


def test_the_same_call_with_other_arguments_is_a_conflict(world: World, guard: Guard) -> None:
    async def body(session: Any) -> None:
        guarded = GuardedSession(session, guard, server="payments")
        with scope("order-4"):
            await guarded.call_tool("charge", CHARGE, call_id="call_1")
            await guarded.call_tool("charge", {**CHARGE, "amount": 1}, call_id="call_1")

    with pytest.raises(KeyConflict):
        world.http(body)
    assert world.counts()["charges"] == 1


def test_a_guarded_call_needs_a_scope_or_a_key(world: World, guard: Guard) -> None:
    async def body(session: Any) -> None:
        await GuardedSession(session, guard, server="payments").call_tool("charge", CHARGE)

    with pytest.raises(NoScope):
        world.http(body)
    assert world.counts()["charges"] == 0


def test_server_killed_after_charging_leaves_the_charge_in_doubt_never_repeated(
    world: World, guard: Guard
) -> None:
    async def charge(session: Any) -> types.CallToolResult:
        with scope("order-5"):
            return await GuardedSession(session, guard, server="payments").call_tool(
                "charge", CHARGE, call_id="call_1", read_timeout_seconds=30
            )

    with pytest.raises(OutcomeUnknown):
        world.stdio(charge, kill="after_charge")  # charged, then SIGKILL: no answer
    assert world.counts()["charges"] == 1
    with pytest.raises(OutcomeUnknown):
        world.http(charge)  # the rerun: parked, not re-sent
    assert world.counts()["charges"] == 1

    async def pending(session: Any) -> types.CallToolResult:
        with scope("order-5"):
            return await GuardedSession(
                session, guard, server="payments", on_doubt=ReturnPending()
            ).call_tool("charge", CHARGE, call_id="call_1")

    told = world.http(pending)
    assert told.is_error and told.structured_content["status"] == "pending"
    assert world.counts()["charges"] == 1


def test_server_killed_after_an_idempotent_refund_is_resent_under_the_same_key(
    world: World, guard: Guard
) -> None:
    async def pay(session: Any) -> types.CallToolResult:
        with scope("order-6"):
            return await GuardedSession(session, guard, server="payments").call_tool(
                "charge", CHARGE, call_id="c"
            )

    paid = world.http(pay).structured_content["id"]

    async def refund(session: Any) -> types.CallToolResult:
        with scope("order-6"):
            return await GuardedSession(session, guard, server="payments").call_tool(
                "refund", {"payment_intent": paid}, call_id="r"
            )

    with pytest.raises(Exception):  # the server died in the refund; the resend in the claim failed too
        world.stdio(refund, kill="in_refund")
    done = world.http(refund)  # in doubt: re-sent under the same key, Stripe replays
    assert done.structured_content["refunded"] is True
    assert world.counts() == {"charges": 1, "refunds": 1, "emails": 0}


def test_a_declared_read_only_tool_is_never_guarded(world: World, guard: Guard) -> None:
    async def body(session: Any) -> Mode:
        return (await GuardedSession(session, guard, server="payments", declare={"charge": read_only})
                .policy("charge")).mode  # fmt: skip

    assert world.http(body) is Mode.PASS_THROUGH


LOOKUP = {
    "charge": changes_world(lookup=LookupTool("find_charge", arguments={"charge_key": "idempotency_key"}))
}


@pytest.mark.parametrize(("kill", "found"), [("after_charge", True), ("before_charge", False)])
def test_a_lookup_tool_resolves_a_charge_left_in_doubt(
    kill: str, found: bool, world: World, guard: Guard
) -> None:
    async def charge(session: Any) -> types.CallToolResult:
        with scope("order-7"):
            return await GuardedSession(session, guard, server="payments", declare=LOOKUP).call_tool(
                "charge", CHARGE, call_id="call_1", read_timeout_seconds=30
            )

    with pytest.raises(OutcomeUnknown):
        world.stdio(charge, kill=kill)  # the server died: no answer
    assert world.counts()["charges"] == int(found)
    resolved = world.http(charge)  # in doubt: the server is asked by the key the call was sent under
    assert world.counts()["charges"] == 1  # found: recorded as made; not found: sent now, once
    assert resolved.structured_content["id"].startswith("pi_")
    assert world.http(charge).structured_content == resolved.structured_content  # then replayed
