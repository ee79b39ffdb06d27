"""An MCP client over streamable HTTP that the idle-session crash tests SIGKILL: run as a real
process by ``tests/test_mcp_proxy_idle.py``.

``python tests/_mcpidleclient.py URL`` opens a session with the server at ``URL`` (the real MCP SDK
client, through :func:`sagaguard.connectors.mcp.http_session`), calls ``charge`` once (420, a
card), and waits until its ``GET`` stream is open: the server has answered it ``200`` and holds
it. Then it prints one JSON line, ``{"session": ID, "charge": PAYMENT_INTENT}``, and waits forever
with its session open, its ``GET`` stream included. It never ends its session (no ``DELETE``):
only the SIGKILL that ends the process ends its connections.
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx2

from sagaguard.connectors.mcp import http_session

CHARGE = {"amount": 420, "customer": "pm_card_visa"}


async def main(url: str) -> None:
    streaming = asyncio.Event()
    session_id = ""

    async def opened(response: httpx2.Response) -> None:
        """The SDK's ``GET`` stream answered 200: the server holds it open from now on."""
        nonlocal session_id
        if response.request.method == "GET" and response.status_code == 200:
            session_id = response.request.headers["mcp-session-id"]
            streaming.set()

    async with http_session(url, event_hooks={"response": [opened]}) as session:
        charged = await session.call_tool("charge", CHARGE)
        assert not charged.is_error and charged.structured_content is not None, charged
        await streaming.wait()
        print(json.dumps({"session": session_id, "charge": charged.structured_content["id"]}), flush=True)
        await asyncio.Event().wait()  # until SIGKILLed: never leaves the session (no DELETE)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
