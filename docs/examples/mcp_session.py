"""An MCP tool call that changes the world happens once: a re-run returns the recorded result
without calling the server, and a read-only tool is sent every time.
"""

import asyncio
import os
from typing import Any

from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

from sagaguard.connectors.mcp import GuardedSession
from sagaguard.idempotency import Guard, open_store, scope

server = MCPServer("payments")  # any MCP server; this one runs in-process
charges: list[str] = []


@server.tool(annotations=ToolAnnotations(destructive_hint=True))
def charge(order: str, amount: int) -> dict[str, Any]:
    """Charge the order's card."""
    charges.append(order)
    return {"charge": f"ch_{len(charges)}", "order": order, "amount": amount}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def balance() -> int:
    """The number of charges made."""
    return len(charges)


async def main() -> None:
    guard = Guard(open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///mcp.db")))
    async with Client(server) as client:
        payments = GuardedSession(client, guard, server="payments")
        for _run in range(2):  # the second run is the framework re-running after a crash
            with scope("order-42"):  # the run (an adapter sets it, with the tool call id)
                paid = await payments.call_tool("charge", {"order": "42", "amount": 420}, call_id="call_1")
                print(paid.structured_content)
        print("balance:", (await payments.call_tool("balance")).structured_content)
    assert len(charges) <= 1, charges  # charged once (not at all when an earlier run of this file did)


asyncio.run(main())
