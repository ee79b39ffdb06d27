"""A charge whose answer was lost is settled by asking the server, through a lookup tool, by the
idempotency key the charge was sent under: recorded as made, never charged twice, never parked.
"""

import asyncio
import os
from typing import Any

from mcp import Client
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.mcp import GuardedSession, LookupTool
from sagaguard.idempotency import Guard, open_store, scope
from sagaguard.idempotency.errors import OutcomeUnknown

server = MCPServer("payments")  # any server that keeps the key it was sent (Stripe: in metadata)
charges: dict[str, dict[str, Any]] = {}  # by the idempotency key each charge was made under


@server.tool(annotations=ToolAnnotations(destructive_hint=True))
def charge(order: str, amount: int, ctx: Context) -> dict[str, Any]:
    """Charge the order's card."""
    key = str((ctx.request_context.meta or {}).get("io.sagaguard/idempotency-key"))
    charges.setdefault(key, {"id": f"ch_{len(charges) + 1}", "order": order, "amount": amount})
    return charges[key]


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def find_charge(charge_key: str) -> dict[str, Any]:
    """Whether a charge was made under this idempotency key."""
    found = charges.get(charge_key)
    return {"found": False} if found is None else {"found": True, **found}


DECLARE = {  # the first thing to declare for a tool that changes the world: how to ask about it
    "charge": changes_world(lookup=LookupTool("find_charge", arguments={"charge_key": "idempotency_key"}))
}


class LosesTheFirstAnswer:
    """The connection drops after the server charged, before its answer arrives (a crash, a
    network cut): the call is in doubt."""

    def __init__(self, client: Client) -> None:
        self.client, self.lost = client, False

    async def list_tools(self) -> Any:
        return await self.client.list_tools()

    async def call_tool(
        self, name: str, arguments: Any = None, timeout: Any = None, *, meta: Any = None
    ) -> Any:
        result = await self.client.call_tool(name, arguments, timeout, meta=meta)
        if name == "charge" and not self.lost:
            self.lost = True
            raise ConnectionResetError("the answer was lost")
        return result


async def main() -> None:
    guard = Guard(open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///mcp.db")))
    async with Client(server) as client:
        payments = GuardedSession(LosesTheFirstAnswer(client), guard, server="payments", declare=DECLARE)
        for _run in range(2):  # the second run is the agent resumed after the first one failed
            with scope("order-7"):
                try:
                    paid = await payments.call_tool("charge", {"order": "7", "amount": 420}, call_id="call_1")
                except OutcomeUnknown:
                    print("in doubt: the charge may have been made")
                    continue
                print("settled by asking the server:", paid.structured_content)
    assert len(charges) <= 1, charges  # charged once (not at all when an earlier run of this file did)


asyncio.run(main())
