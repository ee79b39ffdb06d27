"""An HTTP client of ``sagaguard mcp proxy --http`` that vanishes without ending its session
(no ``DELETE``): once the session sat idle for ``--session-idle`` seconds the proxy ends it, and
its run with it, as a ``DELETE`` would: COMPLETED, or undone when an operator's cancel is pending.
A client still connected (its ``GET`` stream open) is never taken for an idle one. A client
process SIGKILLed with its session open (its ``GET`` stream open, no ``DELETE`` ever sent) is a
vanished one too. Real processes (the proxy, the payments server, the killed client), the real MCP
SDK client, counted at the fake Stripe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from _mcpkit import CLI, SERVER, TESTS, counts, in_loop, serve_http, sink_fixture, stripe_fixture
from click.testing import CliRunner
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from test_mcp_proxy_undo import CHARGE, auntil, cli, env, journal_runs, refunded, snapshot_of, until

from sagaguard.connectors.mcp import http_session
from sagaguard.connectors.mcp.cli import mcp as mcp_command
from sagaguard.connectors.testing import LocalStripe
from sagaguard.connectors.testing.smtp import SmtpSink

__all__ = ["env", "sink_fixture", "stripe_fixture"]  # the fixtures `env`, `sink` and `stripe`, re-used
pytestmark = pytest.mark.timeout(300)

IDLE = "2"
"""The proxy's ``--session-idle``: short, so a vanished client's session ends within the test. A
connected client holds its session with its open ``GET`` stream, so this is no race with it."""

CONNECTION = re.compile(r"connection http:[0-9a-f]+:([0-9a-f]+): agent run (mcp-proxy\.payments\.[0-9a-f]+)")


def proxy_argv(tmp_path: Path, *more: str) -> list[str]:
    return [sys.executable, "-c", CLI, "mcp", "proxy", "--server", "payments", "--http", "127.0.0.1:{port}",
            "--declare", str(tmp_path / "declare.json"), "--session-idle", IDLE, *more,
            "--", sys.executable, str(SERVER)]  # fmt: skip


KILLED_CLIENT = TESTS / "_mcpidleclient.py"


def runs_told(errlog: Path) -> dict[str, str]:
    """The runs the proxy told on stderr: the HTTP session id to its run's id."""
    return dict(CONNECTION.findall(errlog.read_text()))


@contextlib.asynccontextmanager
async def vanishing(url: str) -> AsyncIterator[ClientSession]:
    """A session whose client goes away without ending it: no ``DELETE`` on leaving
    (``terminate_on_close=False``), its connections closed as a process that dies leaves them."""
    async with (
        streamable_http_client(url, terminate_on_close=False) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def answered(url: str, session_id: str, method: str = "POST", **headers: str) -> int:
    """The HTTP status the proxy answers a request on ``session_id`` with (a ``tools/list``, or a
    ``DELETE``), with ``headers`` added (``host``)."""
    body = b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}' if method == "POST" else None
    request = urllib.request.Request(
        url, method=method, data=body,
        headers={"content-type": "application/json", "accept": "application/json, text/event-stream",
                 "mcp-session-id": session_id, **headers},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status)
    except urllib.error.HTTPError as refused:
        return refused.code


def test_a_vanished_http_client_s_run_completes_once_its_session_sat_idle_and_a_connected_one_goes_on(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    """Two clients, one run each. One charges and vanishes: once idle its session is ended (its id
    answers 404, as after a ``DELETE``) and its run COMPLETED, nothing undone. The other stays
    connected all along, idle between its calls for longer than the limit, and a forged ``DELETE``
    of its session is refused: its next call is made in the same session and run, which completes
    when the client ends its session."""
    errlog = tmp_path / "proxy.err"
    with serve_http(env, proxy_argv(tmp_path), errlog) as url:

        async def clients() -> tuple[str, str, str, str]:
            async with http_session(url) as staying:  # ends its session (DELETE) on leaving
                await staying.call_tool("charge", CHARGE)
                ((kept, kept_run),) = runs_told(errlog).items()
                async with vanishing(url) as leaving:
                    await leaving.call_tool("charge", {**CHARGE, "amount": 430})
                    told = runs_told(errlog)
                    assert len(told) == 2 and set(journal_runs(env).values()) == {"running"}, told
                    ((gone, gone_run),) = ((s, r) for s, r in told.items() if s != kept)
                await auntil(
                    lambda: journal_runs(env)[gone_run] == "completed", "the vanished client's run completed"
                )
                # A DELETE the SDK refuses (a foreign Host: DNS rebinding) ends neither the session
                # nor its run.
                refused = await asyncio.to_thread(answered, url, kept, "DELETE", host="evil.example")
                assert refused == 421, refused
                again = await staying.call_tool("charge", {**CHARGE, "amount": 440})
                assert not again.is_error
                assert journal_runs(env)[kept_run] == "running" and len(runs_told(errlog)) == 2  # no new run
            return kept, kept_run, gone, gone_run

        kept, kept_run, gone, gone_run = in_loop(clients)
        until(lambda: journal_runs(env)[kept_run] == "completed", "the connected client's run completed")
        assert answered(url, gone) == 404  # the vanished client's session is over for it too
        assert answered(url, kept) == 404  # as the one its client ended
    steps = {r: [row.name for row in snapshot_of(env, r).steps if row.name.startswith("tool.")]
             for r in (kept_run, gone_run)}  # fmt: skip
    assert steps == {
        kept_run: ["tool.mcp.payments.charge.0", "tool.mcp.payments.charge.1"],
        gone_run: ["tool.mcp.payments.charge.0"],
    }
    assert counts(stripe, sink) == {"charges": 3, "refunds": 0, "emails": 0}


def test_a_vanished_http_client_s_run_cancelled_before_its_session_sat_idle_is_undone_once(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    """An operator cancels the run while its client is still connected, and no sweep sees it
    (``--interval 3600``); the client vanishes. The session's idle end sees the pending cancel in
    the run's completion commit: the run is undone (COMPENSATED), its charge refunded once."""
    errlog = tmp_path / "proxy.err"
    with serve_http(env, proxy_argv(tmp_path, "--interval", "3600"), errlog) as url:

        async def client() -> tuple[str, str]:
            async with vanishing(url) as leaving:
                charged = await leaving.call_tool("charge", CHARGE)
                ((_, run_id),) = runs_told(errlog).items()
                done = await asyncio.to_thread(cli, env, "sagas", "cancel", run_id)
                assert done.returncode == 0, done.stderr
                assert journal_runs(env)[run_id] == "running"  # no sweep: pending until the session ends
                assert charged.structured_content is not None
                return run_id, charged.structured_content["id"]

        run_id, charge = in_loop(client)
        until(lambda: journal_runs(env)[run_id] == "compensated", "the run undone at the session's idle end")
    assert counts(stripe, sink) == {"charges": 1, "refunds": 1, "emails": 0}
    assert refunded(stripe) == [charge]


def sigkilled_client(env: dict[str, str], url: str, errlog: Path, *, cancel: bool) -> tuple[str, str, str]:
    """Start ``_mcpidleclient.py`` on ``url``: it charges once and says so once its ``GET`` stream
    is open. The operator cancels the run then when ``cancel`` (its client connected: the run stays
    RUNNING). The client is SIGKILLed with its session open, the run still RUNNING. Returns the
    session's id, its run's id and the charge's PaymentIntent."""
    with (errlog.parent / "client.err").open("w") as err:
        client = subprocess.Popen([sys.executable, str(KILLED_CLIENT), url], env=env, text=True,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)  # fmt: skip
    try:
        assert client.stdout is not None
        line = client.stdout.readline()  # once charged and streaming (or "" if it died)
        assert line, (errlog.parent / "client.err").read_text()
        said = json.loads(line)
        session_id, charge = str(said["session"]), str(said["charge"])
        told = runs_told(errlog)
        assert list(told) == [session_id], told  # the client's session, and one run
        run_id = told[session_id]
        if cancel:
            done = cli(env, "sagas", "cancel", run_id)
            assert done.returncode == 0, done.stderr
        # Held by the open GET stream: neither ended nor, with no sweep, undone.
        assert journal_runs(env) == {run_id: "running"}
    finally:
        os.kill(client.pid, signal.SIGKILL)  # its session open: no DELETE, ever
        client.wait()
        if client.stdout is not None:
            client.stdout.close()
    assert client.returncode == -signal.SIGKILL
    return session_id, run_id, charge


def test_a_sigkilled_http_client_s_run_completes_once_its_session_sat_idle_and_its_id_answers_404(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    """A client process charges, holds its session (its ``GET`` stream open) and is SIGKILLed: no
    ``DELETE``. Once its session sat idle the proxy ends it (its id answers 404) and completes its
    run, nothing undone: one charge, no refund."""
    errlog = tmp_path / "proxy.err"
    with serve_http(env, proxy_argv(tmp_path), errlog) as url:
        session_id, run_id, _ = sigkilled_client(env, url, errlog, cancel=False)
        until(lambda: journal_runs(env)[run_id] == "completed", "the killed client's run completed")
        assert answered(url, session_id) == 404
        assert journal_runs(env) == {run_id: "completed"}
    steps = [row.name for row in snapshot_of(env, run_id).steps if row.name.startswith("tool.")]
    assert steps == ["tool.mcp.payments.charge.0"]
    assert counts(stripe, sink) == {"charges": 1, "refunds": 0, "emails": 0}


def test_a_sigkilled_http_client_s_run_cancelled_before_the_kill_is_undone_once_when_its_session_sat_idle(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    """An operator cancels the run while its client process is connected, and no sweep sees it
    (``--interval 3600``); the client is SIGKILLed with its session open. The session's idle end
    sees the pending cancel: the run is undone (COMPENSATED), its charge refunded once, and the
    session's id answers 404."""
    errlog = tmp_path / "proxy.err"
    with serve_http(env, proxy_argv(tmp_path, "--interval", "3600"), errlog) as url:
        session_id, run_id, charge = sigkilled_client(env, url, errlog, cancel=True)
        until(lambda: journal_runs(env)[run_id] == "compensated", "the killed client's run undone")
        assert answered(url, session_id) == 404
    assert counts(stripe, sink) == {"charges": 1, "refunds": 1, "emails": 0}
    assert refunded(stripe) == [charge]


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_bad_session_idle_is_refused_naming_the_option(value: str) -> None:
    done = CliRunner().invoke(
        mcp_command,
        ["proxy", "--http", "127.0.0.1:0", "--session-idle", value, "--", sys.executable, str(SERVER)],
    )
    assert done.exit_code == 2 and "Invalid value for '--session-idle'" in done.output, done.output
