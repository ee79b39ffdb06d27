"""What the MCP tests share: the payments server's command line and environment, and counting.

The fakes (``LocalStripe``, ``SmtpSink``) live in the test's process; the MCP server, the agents and
the proxy are other processes, SIGKILLed at the points that matter. Counts are read at the fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from mcp.client.stdio import StdioServerParameters

from sagaguard.connectors.testing import LocalStripe
from sagaguard.connectors.testing.smtp import SmtpSink

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SERVER = TESTS / "_mcpserver.py"
T = TypeVar("T")
CLI = "import sys; from sagaguard.idempotency.cli import main; sys.exit(main(sys.argv[1:]))"
"""``python -c CLI ...`` is the ``sagaguard`` command, run by this interpreter."""


@pytest.fixture(scope="module", name="stripe")
def stripe_fixture() -> Iterator[LocalStripe]:
    """The local Stripe-compatible server, one per test module (reset it per test)."""
    with LocalStripe() as server:
        yield server


@pytest.fixture(scope="module", name="sink")
def sink_fixture() -> Iterator[SmtpSink]:
    """The SMTP sink, one per test module (reset it per test)."""
    with SmtpSink() as server:
        yield server


def server_env(stripe: LocalStripe, sink: SmtpSink, marks: Path, kill: str = "") -> dict[str, str]:
    """The environment of the payments server (and of the processes that start it)."""
    path = os.pathsep.join(p for p in (str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "MCP_STRIPE": stripe.url,
        "MCP_SMTP": f"{sink.host}:{sink.port}", "MCP_KILL": kill, "MCP_MARKS": str(marks),
    }  # fmt: skip


def server_params(env: dict[str, str]) -> StdioServerParameters:
    """The payments server over stdio, started by this interpreter."""
    return StdioServerParameters(command=sys.executable, args=[str(SERVER)], env=env)


def counts(stripe: LocalStripe, sink: SmtpSink) -> dict[str, int]:
    """What the world saw: charges and refunds at Stripe, messages at the SMTP sink."""
    seen = stripe.counters()
    return {"charges": seen.get("charges", 0), "refunds": seen.get("refunds", 0), "emails": sink.count()}


def in_loop(main: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run(main())``, with the one error an MCP session's task group wraps unwrapped."""
    try:
        return asyncio.run(main())
    except BaseExceptionGroup as group:
        while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
            group = group.exceptions[0]  # type: ignore[assignment]
        raise group from None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def serve_http(
    env: dict[str, str], argv: list[str] | None = None, errlog: Path | None = None
) -> Iterator[str]:
    """The payments server (or ``argv`` serving on ``{port}``) over streamable HTTP; yields its URL
    once it accepts connections. Its stderr goes to ``errlog`` when given."""
    port = free_port()
    command = (
        [a.format(port=port) for a in argv] if argv else [sys.executable, str(SERVER), "http", str(port)]
    )
    with contextlib.ExitStack() as files:
        stderr = subprocess.DEVNULL if errlog is None else files.enter_context(errlog.open("w"))
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            for _ in range(600):  # until it listens (a condition, polled), or it died
                if process.poll() is not None:
                    raise AssertionError(f"{command} exited with {process.returncode}")
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port}/mcp"
        finally:
            process.kill()
            process.wait()
