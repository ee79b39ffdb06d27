"""The guarded MCP session on the one tool-call pipeline, where MCP's own naming meets it: a call
made with no call id (its scope's next call of the effect) keeps its key on every attempt, the one
after an operator's resolution included. The server is a real MCP server in this process (the
SDK's in-memory transport); its calls are counted at the server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from _mcpkit import in_loop
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.types import TextContent, ToolAnnotations

from sagaguard.connectors.in_doubt import WaitForOperator
from sagaguard.connectors.mcp import GuardedSession
from sagaguard.idempotency import Guard, open_store, scope
from sagaguard.idempotency.cli import main as cli
from sagaguard.idempotency.records import State

pytestmark = pytest.mark.timeout(60)


class LosesTheFirstAnswer:
    """The connection drops after the server did the work, before its answer arrives."""

    def __init__(self, client: Client) -> None:
        self.client, self.lost = client, False

    async def list_tools(self) -> Any:
        return await self.client.list_tools()

    async def call_tool(
        self, name: str, arguments: Any = None, timeout: Any = None, *, meta: Any = None
    ) -> Any:
        result = await self.client.call_tool(name, arguments, timeout, meta=meta)
        if not self.lost:
            self.lost = True
            raise ConnectionResetError("the answer was lost")
        return result


def test_a_call_without_an_id_keeps_its_key_when_it_runs_again_after_the_resolution(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'effects.db'}"
    guard = Guard(open_store(url))
    server = MCPServer("payments")
    charges: list[str] = []

    @server.tool(annotations=ToolAnnotations(destructive_hint=True))
    def charge(order: str) -> str:
        """Charge the order."""
        charges.append(order)
        return f"charged {order}"

    async def operator(_seconds: float) -> None:  # the operator checked the server: it charged
        (key,) = [r.key for r in guard.store.list() if r.state is State.IN_DOUBT]
        answer = {"content": [{"type": "text", "text": "charged 7"}], "isError": False}
        argv = ["--store", url, "effects", "resolve", key, "--applied", "--result", json.dumps(answer)]
        assert await asyncio.to_thread(cli, argv) == 0

    async def main() -> list[str]:
        waiting = WaitForOperator(timeout=60.0, interval=1.0, async_sleep=operator, clock=lambda: 0.0)
        async with Client(server) as client:
            payments = GuardedSession(LosesTheFirstAnswer(client), guard, server="payments", on_doubt=waiting)
            with scope("order-7"):  # no call id: the scope's first call of mcp.payments.charge
                first = await payments.call_tool("charge", {"order": "7"})
            with scope("order-7"):  # the run again: the same call, replayed
                again = await payments.call_tool("charge", {"order": "7"})
        return [b.text for r in (first, again) for b in r.content if isinstance(b, TextContent)]

    assert in_loop(main) == ["charged 7", "charged 7"]
    assert charges == ["7"]  # the attempt after the resolution replayed it under the same key
    guard.close()
