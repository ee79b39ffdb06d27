"""Undo through ``sagaguard mcp proxy``: a tool declared with an undo in ``--declare FILE`` makes
each client connection an agent run; an operator's ``sagaguard sagas cancel RUN`` undoes its calls
(through the live proxy, a restarted one, or ``sagaguard mcp worker``), a SIGKILLed proxy
included (a worker on another host leaves its run to its ``--lease``); a clean disconnect completes
the run; a stateless HTTP request is a run of its own. Counted at the fake Stripe behind the
payments server.
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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import stripe as stripe_sdk
from _mcpkit import CLI, SERVER, TESTS, counts, in_loop, serve_http, server_env, sink_fixture, stripe_fixture
from click.testing import CliRunner
from mcp import Client, ClientSession, types
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from sagaguard.connectors.declare import read_only
from sagaguard.connectors.mcp import IDEMPOTENCY_META_KEY, ErrorText, UndoTool, http_session
from sagaguard.connectors.mcp.cli import load_declarations
from sagaguard.connectors.mcp.cli import mcp as mcp_command
from sagaguard.connectors.mcp.proxyruns import DeclaredUndo
from sagaguard.connectors.testing import LocalStripe
from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency import holder
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.saga.journals import open_journal
from sagaguard.saga.records import SagaRecord, SagaSnapshot, SagaState

__all__ = ["sink_fixture", "stripe_fixture"]  # the fixtures `sink` and `stripe`, re-used
pytestmark = pytest.mark.timeout(300)

CHARGE = {"amount": 420, "customer": "pm_card_visa"}
UNDO = {
    "tool": "refund",
    "arguments": {"payment_intent": "result.structuredContent.id", "charge_key": "idempotency_key"},
}
DECLARE = {"tools": {"charge": {"mode": "changes_world", "undo": UNDO}, "find_charge": {"mode": "read_only"}}}
RUN = re.compile(r"agent run (mcp-proxy\.payments\.[0-9a-f]+)")


# ------------------------------------------------------------------------------- the file format


def declared(tmp_path: Path, tools: Any) -> Any:
    path = tmp_path / "declare.json"
    path.write_text(json.dumps({"tools": tools}))
    return load_declarations(path)


def test_a_declared_undo_is_read_with_its_paths_and_failure_check(tmp_path: Path) -> None:
    found = declared(tmp_path, {
        "charge": {"mode": "changes_world", "failed_if": "^Error", "undo": {**UNDO, "failed_if": "^No"}},
        "find_charge": {"mode": "read_only"},
        "cancel": {"mode": "changes_world",
                   "undo": {"tool": "uncancel", "arguments": {"id": "arguments.id"}}},
    })  # fmt: skip
    charge = found["charge"]
    assert isinstance(charge, DeclaredUndo)
    assert charge.undo.tool == "refund" and charge.undo.server is None  # the same server
    assert dict(charge.undo.arguments) == UNDO["arguments"]  # type: ignore[call-overload]
    assert isinstance(charge.undo.failed_if, ErrorText) and isinstance(charge.options["failed_if"], ErrorText)
    assert found["find_charge"] is read_only
    assert found["cancel"] == DeclaredUndo(UndoTool("uncancel", arguments={"id": "arguments.id"}), {})


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ({"mode": "read_only", "undo": UNDO}, "nothing to undo"),
        ({"mode": "changes_world", "undo": "refund"}, "undo is an object"),
        ({"mode": "changes_world", "undo": {**UNDO, "server": "other"}}, "not ['server']"),
        ({"mode": "changes_world", "undo": {**UNDO, "tool": ""}}, 'needs a "tool"'),
        ({"mode": "changes_world", "undo": {**UNDO, "tool": "  "}}, 'needs a "tool"'),
        ({"mode": "changes_world", "undo": {**UNDO, "tool": 7}}, 'needs a "tool"'),
        ({"mode": "changes_world", "undo": {"arguments": UNDO["arguments"]}}, 'needs a "tool"'),
        ({"mode": "changes_world", "undo": {**UNDO, "arguments": ["idempotency_key"]}},
         "{name: dotted path}"),
        ({"mode": "changes_world", "undo": {**UNDO, "arguments": {"id": 3}}}, "{name: dotted path}"),
        ({"mode": "changes_world", "undo": {**UNDO, "arguments": {"id": ""}}}, "{name: dotted path}"),
        ({"mode": "changes_world", "undo": {**UNDO, "arguments": {"id": "call.id"}}}, "not ['call']"),
        ({"mode": "changes_world", "undo": {**UNDO, "arguments": {"id": "result.structuredContent.id"}}},
         "only the result"),
        ({"mode": "changes_world", "undo": {"tool": "refund"}}, "only the result"),  # no path at all
        ({"mode": "changes_world", "undo": {**UNDO, "failed_if": "("}}, "undo"),
        ({"mode": "changes_world", "undo": {**UNDO, "failed_if": 1}}, "regular expression"),
        ({"mode": "changes_world", "compensate": UNDO}, "unknown entries ['compensate']"),
    ],
)  # fmt: skip
def test_every_bad_undo_declaration_is_refused_naming_the_tool(tmp_path: Path, entry: Any, said: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(said)) as refused:
        declared(tmp_path, {"charge": entry})
    assert "tool 'charge'" in str(refused.value) and "--declare" in str(refused.value)


# ------------------------------------------------------------------------------ through the proxy


@pytest.fixture
def env(stripe: LocalStripe, sink: SmtpSink, tmp_path: Path) -> dict[str, str]:
    stripe.reset()
    sink.reset()
    (tmp_path / "declare.json").write_text(json.dumps(DECLARE))
    return {**server_env(stripe, sink, tmp_path), "SAGAGUARD_STORE": f"sqlite:///{tmp_path / 'proxy.db'}"}


def proxy(env: dict[str, str], tmp_path: Path, interval: str | None = "0.1") -> StdioServerParameters:
    """``sagaguard mcp proxy --declare FILE`` over stdio, sweeping every 0.1 s (None: the default)."""
    sweeps = [] if interval is None else ["--interval", interval]
    argv = ["-c", CLI, "mcp", "proxy", "--server", "payments", "--declare", str(tmp_path / "declare.json"),
            *sweeps, "--", sys.executable, str(SERVER)]  # fmt: skip
    return StdioServerParameters(command=sys.executable, args=argv, env=env)


def child(env: dict[str, str], tmp_path: Path, crash_at: str = "") -> StdioServerParameters:
    """The same proxy (``proxy_main``) in ``tests/_mcpproxychild.py``, killable from inside."""
    return StdioServerParameters(
        command=sys.executable,
        args=[str(TESTS / "_mcpproxychild.py"), env["SAGAGUARD_STORE"], str(tmp_path / "declare.json")],
        env={**env, "SAGAGUARD_CRASH_AT": crash_at},
    )


def cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI, *argv], env=env, capture_output=True, text=True,
                          timeout=120, check=False, stdin=subprocess.DEVNULL)  # fmt: skip


def worker_once(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return cli(env, "mcp", "worker", "--server", "payments", "--declare", str(tmp_path / "declare.json"),
               "--once", "--", sys.executable, str(SERVER))  # fmt: skip


def state(env: dict[str, str], run_id: str) -> SagaState | None:
    journal = open_journal(env["SAGAGUARD_STORE"])
    try:
        snapshot = journal.load(run_id)
        return None if snapshot is None else snapshot.saga.state
    finally:
        journal.close()


def until(found: Callable[[], Any], what: str, tries: int = 2400) -> Any:
    """Poll a condition on state (not a timing threshold): its first truthy value."""
    for _ in range(tries):
        value = found()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def auntil(found: Callable[[], Any], what: str) -> Any:
    return await asyncio.to_thread(until, found, what)


def run_of(errlog: Path) -> str:
    match = RUN.search(errlog.read_text())
    assert match is not None, errlog.read_text()
    return match.group(1)


def refunded(stripe: LocalStripe) -> list[str]:
    """The PaymentIntents refunded at the fake, in the order the refunds were made."""
    client = stripe_sdk.StripeClient("sk_test_sagaguard_local", base_addresses={"api": stripe.url})
    return [r.payment_intent for r in reversed(client.v1.refunds.list(params={"limit": 100}).data)]  # type: ignore[misc]


def test_an_operator_cancels_a_live_connection_and_its_charges_are_refunded_in_reverse(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    errlog = tmp_path / "proxy.err"

    async def main() -> tuple[list[str], str, MCPError]:
        with errlog.open("w") as err:
            async with (
                stdio_client(proxy(env, tmp_path), errlog=err) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                first = await session.call_tool("charge", CHARGE)
                second = await session.call_tool("charge", {**CHARGE, "amount": 430})
                run_id = run_of(errlog)
                listed = await asyncio.to_thread(cli, env, "sagas", "list", "--json")
                assert listed.returncode == 0 and run_id in listed.stdout, listed.stderr
                done = await asyncio.to_thread(cli, env, "sagas", "cancel", run_id)
                assert done.returncode == 0, done.stderr
                # The live proxy's sweep sees the cancellation and undoes the run now.
                await auntil(lambda: state(env, run_id) is SagaState.COMPENSATED, "the run compensated")
                with pytest.raises(MCPError) as refused:  # what the operator stopped does not go on
                    await session.call_tool("charge", CHARGE)
                ids = [r.structured_content["id"] for r in (first, second)]  # type: ignore[index]
                return ids, run_id, refused.value

    ids, run_id, refused = in_loop(main)
    assert run_id in str(refused) and "compensated" in str(refused) and "not sent" in str(refused)
    assert counts(stripe, sink) == {"charges": 2, "refunds": 2, "emails": 0}
    assert refunded(stripe) == [ids[1], ids[0]]  # undone once each, the last call first
    assert state(env, run_id) is SagaState.COMPENSATED  # the disconnect changed nothing


def test_a_clean_disconnect_completes_the_run_and_undoes_nothing(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    errlog = tmp_path / "proxy.err"

    async def connection(key: str) -> types.CallToolResult:
        with errlog.open("a") as err:
            async with (
                stdio_client(proxy(env, tmp_path), errlog=err) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                await session.call_tool("find_charge", {"charge_key": "none"})  # read-only: no step
                meta: Any = {IDEMPOTENCY_META_KEY: key}
                first = await session.call_tool("charge", CHARGE, meta=meta)
                again = await session.call_tool("charge", CHARGE, meta=meta)  # the same connection: replayed
                assert again.structured_content == first.structured_content
                return first

    charged = in_loop(lambda: connection("order-1"))
    assert not charged.is_error
    run_id = run_of(errlog)
    until(lambda: state(env, run_id) is SagaState.COMPLETED, "the run completed")
    swept = worker_once(env, tmp_path)
    assert swept.returncode == 0, swept.stderr
    late = cli(env, "sagas", "cancel", run_id)
    assert late.returncode == 1  # too late: the run completed
    # The same client key on another connection belongs to the first run: refused, never re-sent.
    with pytest.raises(MCPError) as refused:
        in_loop(lambda: connection("order-1"))
    assert refused.value.code == types.INVALID_PARAMS and run_id in str(refused.value)
    assert state(env, run_id) is SagaState.COMPLETED
    assert counts(stripe, sink) == {"charges": 1, "refunds": 0, "emails": 0}


def _killed_connection(params: StdioServerParameters, errlog: Path, *, kill_after: bool) -> list[Any]:
    """One charge through a proxy that dies: SIGKILLed from here after it answered (``kill_after``),
    or by its own store inside the call. Returns the answers the client got."""
    answers: list[Any] = []

    async def main() -> None:
        with errlog.open("w") as err:
            async with (
                stdio_client(params, errlog=err) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                answers.append(await session.call_tool("charge", CHARGE))
                if kill_after:
                    pid = int(re.findall(r"proxy pid (\d+)", errlog.read_text())[0])
                    os.kill(pid, signal.SIGKILL)

    with contextlib.suppress(Exception, BaseExceptionGroup):  # the proxy died under the client
        in_loop(main)
    return answers


@pytest.mark.parametrize("interval", [None, "0.1"], ids=["the-defaults", "fast-sweeps"])
def test_a_proxy_sigkilled_after_a_call_is_undone_by_a_restarted_proxy(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path, interval: str | None
) -> None:
    errlog = tmp_path / "killed.err"
    (answer,) = _killed_connection(child(env, tmp_path), errlog, kill_after=True)
    run_id = run_of(errlog)
    assert state(env, run_id) is SagaState.RUNNING  # what a SIGKILL leaves: the run, held by nobody
    done = cli(env, "sagas", "cancel", run_id)
    assert done.returncode == 0, done.stderr

    async def restarted() -> None:  # a new proxy: its worker undoes the dead one's cancelled run
        with (tmp_path / "proxy.err").open("w") as err:
            async with (
                stdio_client(proxy(env, tmp_path, interval), errlog=err) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                await auntil(lambda: state(env, run_id) is SagaState.COMPENSATED, "the run compensated")

    in_loop(restarted)
    assert counts(stripe, sink) == {"charges": 1, "refunds": 1, "emails": 0}
    assert refunded(stripe) == [answer.structured_content["id"]]
    assert worker_once(env, tmp_path).returncode == 0  # again: nothing more
    assert counts(stripe, sink)["refunds"] == 1


def test_a_proxy_sigkilled_before_recording_the_charge_is_undone_by_its_key_by_the_worker(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    errlog = tmp_path / "killed.err"
    answers = _killed_connection(child(env, tmp_path, "before_complete"), errlog, kill_after=False)
    assert answers == []  # the server charged; the proxy died before recording (or answering)
    assert counts(stripe, sink)["charges"] == 1
    run_id = run_of(errlog)
    done = cli(env, "sagas", "cancel", run_id)
    assert done.returncode == 0, done.stderr

    def swept() -> bool:  # `sagaguard mcp worker --once`, no proxy up, until the run is undone
        once = worker_once(env, tmp_path)
        assert once.returncode == 0, once.stderr
        return state(env, run_id) is SagaState.COMPENSATED

    until(swept, "the worker undid the run", tries=20)
    assert counts(stripe, sink) == {"charges": 1, "refunds": 1, "emails": 0}  # found by the key
    assert worker_once(env, tmp_path).returncode == 0  # again: nothing more
    assert counts(stripe, sink)["refunds"] == 1


def runs(env: dict[str, str]) -> dict[str, str]:
    """The proxy's runs as ``sagaguard sagas list --json`` shows them: id to state."""
    listed = cli(env, "sagas", "list", "--name", "mcp-proxy.payments", "--json")
    assert listed.returncode == 0, listed.stderr
    return {row["saga_id"]: row["state"] for row in json.loads(listed.stdout)}


def test_an_http_client_that_ends_its_session_completes_its_run(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    argv = [sys.executable, "-c", CLI, "mcp", "proxy", "--server", "payments", "--http", "127.0.0.1:{port}",
            "--declare", str(tmp_path / "declare.json"), "--", sys.executable, str(SERVER)]  # fmt: skip
    with serve_http(env, argv) as url:

        async def client() -> None:
            async with http_session(url) as session:  # closing it DELETEs the session
                await session.call_tool("charge", CHARGE)
                listed = await asyncio.to_thread(runs, env)
                assert list(listed.values()) == ["running"]  # one run, open while connected

        in_loop(client)
        (run_id,) = until(lambda: [r for r, s in runs(env).items() if s == "completed"], "the run completed")
    assert state(env, run_id) is SagaState.COMPLETED
    assert counts(stripe, sink) == {"charges": 1, "refunds": 0, "emails": 0}


def test_a_failed_call_parks_its_run_for_an_operator_and_the_next_call_opens_a_new_one(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    errlog = tmp_path / "proxy.err"

    async def main() -> tuple[types.CallToolResult, types.CallToolResult]:
        with errlog.open("w") as err:
            async with (
                stdio_client(proxy(env, tmp_path), errlog=err) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                await session.call_tool("charge", CHARGE)
                declined = await session.call_tool("charge", {**CHARGE, "customer": "pm_card_chargeDeclined"})
                went_on = await session.call_tool("charge", CHARGE)  # the client goes on: a new run
                return declined, went_on

    declined, went_on = in_loop(main)
    assert declined.is_error and not went_on.is_error
    runs_told = list(dict.fromkeys(RUN.findall(errlog.read_text())))  # each run's id, in order
    assert len(runs_told) == 2, errlog.read_text()
    first, second = runs_told
    # The failed run is parked for an operator at once; the new one completes at the disconnect.
    until(lambda: state(env, first) is SagaState.NEEDS_ATTENTION, "the failed run parked")
    until(lambda: state(env, second) is SagaState.COMPLETED, "the new run completed")
    assert counts(stripe, sink) == {"charges": 2, "refunds": 0, "emails": 0}
    retried = cli(env, "sagas", "retry", first)  # the operator's way out: undo the failed run
    assert retried.returncode == 0, retried.stderr

    def swept() -> bool:
        assert worker_once(env, tmp_path).returncode == 0
        return state(env, first) is SagaState.COMPENSATED

    until(swept, "the worker undid the failed run", tries=20)
    # Its one charge refunded (the declined one made nothing); the new run's charge stays.
    assert counts(stripe, sink) == {"charges": 2, "refunds": 1, "emails": 0}
    assert state(env, second) is SagaState.COMPLETED


def test_the_worker_command_refuses_declarations_without_an_undo(env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "declare.json").write_text(json.dumps({"tools": {"charge": {"mode": "changes_world"}}}))
    done = worker_once(env, tmp_path)
    assert done.returncode == 2 and "declares no undo" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# -------------------------------------------------------------- a stateless HTTP request, a run


STATELESS = "2026-07-28"
"""The protocol revision without sessions: each request a self-contained POST, no ``mcp-session-id``
(the SDK's ``mcp.Client`` negotiates it by default with a server that offers it, as the proxy does)."""


def snapshot_of(env: dict[str, str], run_id: str) -> SagaSnapshot:
    journal = open_journal(env["SAGAGUARD_STORE"])
    try:
        found = journal.load(run_id)
        assert found is not None, run_id
        return found
    finally:
        journal.close()


def journal_runs(env: dict[str, str]) -> dict[str, str]:
    """The proxy's runs in the journal: id to state (``runs`` without a ``sagas list`` process)."""
    journal = open_journal(env["SAGAGUARD_STORE"])
    try:
        return {r.saga_id: r.state.value for r in journal.list() if r.name == "mcp-proxy.payments"}
    finally:
        journal.close()


def test_each_stateless_http_request_is_a_run_of_its_own_and_one_cancelled_in_flight_is_undone_alone(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    """One client, two stateless requests: two runs. The first is answered, its run completed with
    it (too late to cancel); the second's charge is made and held at the server when the operator
    cancels its run: once it is answered, its charge alone is refunded. ``--interval 3600``: no
    sweep sees the cancel, the end of the request must."""
    argv = [sys.executable, "-c", CLI, "mcp", "proxy", "--server", "payments", "--http", "127.0.0.1:{port}",
            "--declare", str(tmp_path / "declare.json"), "--interval", "3600",
            "--", sys.executable, str(SERVER)]  # fmt: skip
    with serve_http({**env, "MCP_HOLD": "777"}, argv) as url:

        async def client() -> tuple[types.CallToolResult, types.CallToolResult, str, str]:
            async with Client(url, mode=STATELESS) as session:
                first = await session.call_tool("charge", CHARGE)
                (completed,) = journal_runs(env)
                in_flight = asyncio.ensure_future(session.call_tool("charge", {**CHARGE, "amount": 777}))
                await auntil((tmp_path / "held-777").exists, "the second charge made, held")
                listed = journal_runs(env)
                assert len(listed) == 2 and listed[completed] == "completed", listed
                (running,) = (r for r, s in listed.items() if s == "running")
                late, done = await asyncio.gather(
                    asyncio.to_thread(cli, env, "sagas", "cancel", completed),
                    asyncio.to_thread(cli, env, "sagas", "cancel", running),
                )
                assert late.returncode == 1, late.stdout + late.stderr  # answered: its run is over
                assert done.returncode == 0, done.stderr
                (tmp_path / "release-777").write_text("go")
                return first, await in_flight, completed, running

        first, second, completed, running = in_loop(client)
        # Answered once its run had ended: the states are final, nothing to poll for.
        assert state(env, running) is SagaState.COMPENSATED
        assert state(env, completed) is SagaState.COMPLETED
    calls = {r: [row.name for row in snapshot_of(env, r).steps if row.name.startswith("tool.")]
             for r in (completed, running)}  # fmt: skip
    one_call = ["tool.mcp.payments.charge.0"]
    assert calls == {completed: one_call, running: one_call}  # each request's call, in its own run
    assert not first.is_error and not second.is_error  # the client saw both charges made
    assert counts(stripe, sink) == {"charges": 2, "refunds": 1, "emails": 0}
    assert refunded(stripe) == [second.structured_content["id"]]  # type: ignore[index]


# ---------------------------------------------------- another host: the dead proxy's lease first


LEASE = 8.0
"""The dead proxy's ``--lease`` (renewed every third of it while the proxy lives)."""


@contextlib.contextmanager
def worker_running(env: dict[str, str], tmp_path: Path) -> Iterator[Callable[[], bool]]:
    """``sagaguard mcp worker --interval 0.1`` until SIGTERM; yields whether it is sweeping yet (it
    says so on stderr, ``worker.err``, before its first sweep)."""
    argv = [sys.executable, "-c", CLI, "mcp", "worker", "--server", "payments",
            "--declare", str(tmp_path / "declare.json"), "--interval", "0.1",
            "--", sys.executable, str(SERVER)]  # fmt: skip
    errlog = tmp_path / "worker.err"
    with errlog.open("w") as err:
        process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        try:
            yield lambda: process.poll() is None and "mcp worker running" in errlog.read_text()
        finally:
            process.terminate()
            process.wait(timeout=60)


def test_a_sigkilled_proxy_is_parked_by_a_worker_on_another_host_once_its_lease_ran_out_then_undone(
    env: dict[str, str], stripe: LocalStripe, sink: SmtpSink, tmp_path: Path
) -> None:
    """The proxy (``--lease 8``) SIGKILLed after a charge, while ``sagaguard mcp worker`` sweeps
    every 0.1 s on "another host" (``$SAGAGUARD_HOST_ID``), which cannot prove the proxy dead: the
    run is left as the proxy left it for as long as its lease lasts, parked WAITING once the lease
    ran out, and undone (one refund) once an operator cancels it."""
    here = {k: v for k, v in env.items() if k != holder.HOST_ENV}
    elsewhere = {**here, holder.HOST_ENV: "another-host"}
    argv = ["-c", CLI, "mcp", "proxy", "--server", "payments", "--declare", str(tmp_path / "declare.json"),
            "--lease", str(LEASE), "--", sys.executable, str(SERVER)]  # fmt: skip
    errlog = tmp_path / "killed.err"
    answers: list[types.CallToolResult] = []
    journal = open_journal(env["SAGAGUARD_STORE"])

    def row() -> SagaRecord:
        found = journal.load(run_of(errlog))
        assert found is not None
        return found.saga

    try:
        with worker_running(elsewhere, tmp_path) as sweeping:  # sweeping from before the kill

            async def killed() -> None:
                with errlog.open("w") as err:
                    params = StdioServerParameters(command=sys.executable, args=argv, env=here)
                    async with (
                        stdio_client(params, errlog=err) as (read, write),
                        ClientSession(read, write) as session,
                    ):
                        await session.initialize()
                        answers.append(await session.call_tool("charge", CHARGE))
                        await auntil(sweeping, "the worker elsewhere sweeping")
                        # The proxy's pid, as the journal names its run's holder (on this host).
                        dead = holder.parse(row().holder or "")
                        assert dead is not None and dead.host == holder.parse(holder.current()).host  # type: ignore[union-attr]
                        os.kill(dead.pid, signal.SIGKILL)

            with contextlib.suppress(Exception, BaseExceptionGroup):  # the proxy died under the client
                in_loop(killed)
            (answer,) = answers
            left = row()  # as the dead proxy last renewed it
            assert left.state is SagaState.RUNNING
            assert 0 < left.lease_until - left.updated_at <= LEASE  # held under --lease, not 30 s
            inside: list[float] = []

            def parked() -> bool:
                now = row()
                if now.state is SagaState.WAITING:
                    return True
                at = journal.now()  # read after the row: the row was read before this
                if at < left.lease_until:
                    assert now == left, now  # inside the lease: not touched (state, token, holder)
                    inside.append(at)
                return False

            until(parked, "the worker elsewhere parked the run")
            assert inside  # seen untouched inside the lease, the worker sweeping all along
            assert row().updated_at >= left.lease_until  # parked once the lease had run out
            assert counts(stripe, sink) == {"charges": 1, "refunds": 0, "emails": 0}  # parking undoes nothing
            done = cli(here, "sagas", "cancel", left.saga_id)
            assert done.returncode == 0, done.stderr
            until(lambda: row().state is SagaState.COMPENSATED, "the worker elsewhere undid the run")
    finally:
        journal.close()
    assert counts(stripe, sink) == {"charges": 1, "refunds": 1, "emails": 0}
    assert refunded(stripe) == [answer.structured_content["id"]]  # type: ignore[index]
    assert worker_once(elsewhere, tmp_path).returncode == 0  # again: nothing more
    assert counts(stripe, sink)["refunds"] == 1


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_bad_lease_is_refused_naming_the_option(value: str) -> None:
    done = CliRunner().invoke(mcp_command, ["proxy", "--lease", value, "--", sys.executable, str(SERVER)])
    assert done.exit_code == 2 and "Invalid value for '--lease'" in done.output, done.output
