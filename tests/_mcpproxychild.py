"""The MCP proxy (stdio, in front of the payments server) on a store that SIGKILLs it at
``$SAGAGUARD_CRASH_AT`` (``before_complete``: the server answered, the proxy had not recorded it).

``python tests/_mcpproxychild.py STORE_URL [DECLARE_FILE]``: with a declarations file that names
undos, each connection is an agent run in the store's journal (``proxy_main``'s ``journal=``); the
proxy then says its pid on stderr (``proxy pid N``), for a test that SIGKILLs it from outside.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from _mcpkit import server_params

from sagaguard.connectors.mcp.cli import load_declarations, proxy_main
from sagaguard.connectors.mcp.session import stdio_session
from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.testing import CrashingStore
from sagaguard.saga.journals import open_journal

if __name__ == "__main__":
    guard = Guard(CrashingStore(open_store(sys.argv[1])))  # the defaults, as the CLI has them
    declared = load_declarations(Path(sys.argv[2])) if len(sys.argv) > 2 else None
    journal = open_journal(sys.argv[1]) if declared is not None else None
    print(f"proxy pid {os.getpid()}", file=sys.stderr, flush=True)
    asyncio.run(
        proxy_main(
            lambda: stdio_session(server_params(dict(os.environ))), guard, "payments",
            declare=declared, journal=journal, interval=0.1,
        )
    )  # fmt: skip
