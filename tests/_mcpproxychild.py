"""The MCP proxy (stdio, in front of the payments server) on a store that SIGKILLs it at
``$SAGAGUARD_CRASH_AT`` (``before_complete``: the server answered, the proxy had not recorded it).

``python tests/_mcpproxychild.py STORE_URL``.
"""

from __future__ import annotations

import asyncio
import os
import sys

from _mcpkit import server_params

from sagaguard.connectors.mcp.cli import proxy_main
from sagaguard.connectors.mcp.session import stdio_session
from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.testing import CrashingStore

if __name__ == "__main__":
    guard = Guard(CrashingStore(open_store(sys.argv[1])))  # the defaults, as the CLI has them
    asyncio.run(proxy_main(lambda: stdio_session(server_params(dict(os.environ))), guard, "payments"))
