"""MCP sessions that recover, and the bad input they refuse: a server SIGKILLed under a session,
keys and arguments that are not what the wire carries, a server's environment, a failure check for
servers that answer their errors as text, an agent run's tools without a scope of their own, and
the operator resolving an MCP call. Real servers in their own processes; counted at the fakes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from _mcpkit import (
    CLI,
    SERVER,
    TESTS,
    counts,
    in_loop,
    server_env,
    server_params,
    sink_fixture,
    stripe_fixture,
)
from mcp import types
from mcp.client.stdio import StdioServerParameters

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.mcp import (
    ErrorText,
    GuardedSession,
    InvalidArguments,
    InvalidKey,
    McpServers,
    McpUndos,
    ServerGone,
    UndoFailed,
    UndoTool,
    stdio_session,
)
from sagaguard.connectors.testing import LocalStripe
from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency import Guard, open_store, scope
from sagaguard.idempotency.errors import OutcomeUnknown
from sagaguard.idempotency.records import State
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal

__all__ = ["sink_fixture", "stripe_fixture"]  # the fixtures `sink` and `stripe`, re-used
pytestmark = pytest.mark.timeout(180)

CHARGE = {"amount": 420, "customer": "pm_card_visa"}
TEXT_SERVER = TESTS / "_mcptextserver.py"


@pytest.fixture
def env(stripe: LocalStripe, sink: SmtpSink, tmp_path: Path) -> dict[str, str]:
    stripe.reset()
    sink.reset()
    return server_env(stripe, sink, tmp_path)


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[Guard]:
    g = Guard(open_store(f"sqlite:///{tmp_path / 'effects.db'}"), lease=1.0)
    yield g
    g.close()


def charges(stripe: LocalStripe) -> int:
    return stripe.counters().get("charges", 0)


# ------------------------------------------------------------------------- a server that died


def test_a_call_after_the_server_died_is_not_sent_and_not_parked(
    env: dict[str, str], guard: Guard, stripe: LocalStripe
) -> None:
    async def body() -> tuple[BaseException | None, BaseException | None, bool]:
        params = server_params({**env, "MCP_KILL": "after_charge"})
        async with stdio_session(params) as session:
            payments = GuardedSession(session, guard, server="payments")
            first = second = None
            with scope("order-1"):
                try:  # the server charges, then is SIGKILLed before it answers
                    await payments.call_tool("charge", CHARGE, call_id="c1", read_timeout_seconds=30)
                except OutcomeUnknown as exc:
                    first = exc
                try:  # made after the server died: never sent, so never in doubt
                    await payments.call_tool("charge", CHARGE, call_id="c2")
                except ServerGone as exc:
                    second = exc
            return first, second, payments.gone

    first, second, gone = in_loop(body)
    assert isinstance(first, OutcomeUnknown)  # the request had left: in doubt, rightly
    assert isinstance(second, ServerGone) and gone
    assert charges(stripe) == 1
    parked = guard.store.list(states=[State.IN_DOUBT, State.IN_PROGRESS])
    assert len(parked) == 1  # only the call that was sent; c2 left no record

    async def retry() -> types.CallToolResult:
        async with stdio_session(server_params(env)) as session:  # a new server (the kill was once)
            with scope("order-1"):
                return await GuardedSession(session, guard, server="payments").call_tool(
                    "charge", CHARGE, call_id="c2"
                )

    done = in_loop(retry)
    assert not done.is_error and done.structured_content["id"].startswith("pi_")
    assert charges(stripe) == 2  # c2 sent once, on the new session


def test_over_http_a_call_to_a_server_that_died_idle_is_not_sent_and_not_parked(
    env: dict[str, str], guard: Guard, stripe: LocalStripe
) -> None:
    """Over streamable HTTP the SDK ends the whole session on a POST that cannot connect, which
    cancelled the waiting call and left it in doubt although nothing was sent (before
    :mod:`sagaguard.connectors.mcp.transport`: the call in doubt, 0 charges). Now it is not sent,
    its record is released, and the same call on a new server is sent once."""
    from _mcpkit import serve_http

    from sagaguard.connectors.mcp import http_session

    server = serve_http(env)
    url = server.__enter__()

    async def body() -> BaseException | None:
        async with http_session(url) as session:
            payments = GuardedSession(session, guard, server="payments")
            await payments.list_tools()
            server.__exit__(None, None, None)  # SIGKILL, while no call is in flight
            with scope("order-1"):
                try:
                    await payments.call_tool("charge", CHARGE, call_id="c1")
                except ServerGone as exc:
                    return exc
        return None

    try:
        gone = in_loop(body)
    finally:
        server.__exit__(None, None, None)
    assert isinstance(gone, ServerGone) and "unreachable" in str(gone)
    assert charges(stripe) == 0 and guard.store.list() == []  # not sent, nothing parked

    async def retry(url: str) -> types.CallToolResult:
        async with http_session(url) as session:
            with scope("order-1"):
                return await GuardedSession(session, guard, server="payments").call_tool(
                    "charge", CHARGE, call_id="c1"
                )

    with serve_http(env) as new_url:  # a new server
        done = in_loop(lambda: retry(new_url))
    assert not done.is_error and done.structured_content["id"].startswith("pi_")
    assert charges(stripe) == 1  # sent once, on the new session


def proxy_argv(*extra: str) -> list[str]:
    return [sys.executable, "-c", CLI, "mcp", "proxy", "--server", "payments", *extra, "--",
            sys.executable, str(SERVER)]  # fmt: skip


async def calls_through(
    argv: list[str], env: dict[str, str], calls: list[tuple[str, dict[str, Any], Any]]
) -> list[types.CallToolResult | Exception]:
    """Make ``calls`` (tool, arguments, the ``_meta`` idempotency key or None) through one client
    session to the proxy; an error answer is returned, not raised."""
    from mcp import ClientSession
    from mcp.client.stdio import stdio_client

    from sagaguard.connectors.mcp import IDEMPOTENCY_META_KEY

    params = StdioServerParameters(command=argv[0], args=argv[1:], env=env)
    found: list[types.CallToolResult | Exception] = []
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        for name, arguments, key in calls:
            meta: Any = None if key is None else {IDEMPOTENCY_META_KEY: key}
            try:
                found.append(await session.call_tool(name, arguments, meta=meta))
            except Exception as exc:
                found.append(exc)
    return found


def test_the_proxy_reconnects_to_a_server_that_died_and_never_parks_an_unsent_call(
    env: dict[str, str], stripe: LocalStripe, tmp_path: Path
) -> None:
    store = f"sqlite:///{tmp_path / 'proxy.db'}"
    proxy_env = {**env, "SAGAGUARD_STORE": store, "MCP_KILL": "after_charge"}
    first, second, again = in_loop(
        lambda: calls_through(
            proxy_argv(),
            proxy_env,
            [("charge", CHARGE, "k1"), ("charge", CHARGE, "k2"), ("charge", CHARGE, "k2")],
        )
    )
    assert isinstance(first, types.CallToolResult) and first.is_error  # sent, answer lost: pending
    assert json.loads(first.content[0].text)["status"] == "pending"  # type: ignore[union-attr]
    assert isinstance(second, types.CallToolResult) and not second.is_error  # on a new server
    assert isinstance(again, types.CallToolResult) and again.structured_content == second.structured_content
    assert charges(stripe) == 2

    # A new proxy: the key that was sent after the death is recorded, not pending.
    (later,) = in_loop(lambda: calls_through(proxy_argv(), {**env, "SAGAGUARD_STORE": store},
                                             [("charge", CHARGE, "k2")]))  # fmt: skip
    assert isinstance(later, types.CallToolResult) and later.structured_content == second.structured_content
    assert charges(stripe) == 2


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("key", [7, "", {"k": 1}, ["k"], True])
def test_a_client_key_that_is_not_a_non_empty_string_is_refused_at_the_proxy(
    key: Any, env: dict[str, str], stripe: LocalStripe, tmp_path: Path
) -> None:
    proxy_env = {**env, "SAGAGUARD_STORE": f"sqlite:///{tmp_path / 'proxy.db'}"}
    answers = in_loop(lambda: calls_through(proxy_argv(), proxy_env, [("charge", CHARGE, key)] * 2))
    for answer in answers:
        assert isinstance(answer, Exception) and "non-empty string" in str(answer), answer
    assert charges(stripe) == 0


@pytest.mark.parametrize("key", [7, "", b"k", None])
def test_a_session_key_or_call_id_that_is_not_a_non_empty_string_is_refused(
    key: Any, env: dict[str, str], guard: Guard, stripe: LocalStripe
) -> None:
    async def body() -> list[Exception]:
        refused = []
        async with stdio_session(server_params(env)) as session:
            payments = GuardedSession(session, guard, server="payments")
            with scope("order-2"):
                for given in ({"key": key}, {"call_id": key}):
                    if None in given.values():
                        continue
                    try:
                        await payments.call_tool("charge", CHARGE, **given)
                    except InvalidKey as exc:
                        refused.append(exc)
        return refused

    refused = in_loop(body)
    assert len(refused) == (0 if key is None else 2)
    assert charges(stripe) == 0
    assert guard.store.list() == []


@pytest.mark.parametrize(
    "amount",
    [Decimal("4.20"), dt.datetime(2026, 1, 1, tzinfo=dt.UTC), {4, 20}, b"420", (4, 20), float("nan"),
     {1: "a"}, [Decimal(1)], object()],
    ids=["decimal", "datetime", "set", "bytes", "tuple", "nan", "int-key", "nested", "object"],
)  # fmt: skip
def test_an_argument_that_is_not_json_is_refused_before_anything_is_sent(
    amount: Any, env: dict[str, str], guard: Guard, stripe: LocalStripe
) -> None:
    async def body() -> None:
        async with stdio_session(server_params(env)) as session:
            payments = GuardedSession(session, guard, server="payments")
            with scope("order-3"):
                await payments.call_tool(
                    "charge", {"amount": amount, "customer": "pm_card_visa"}, call_id="c"
                )

    with pytest.raises(InvalidArguments) as caught:
        in_loop(body)
    assert caught.value.path.startswith("amount")
    assert charges(stripe) == 0
    assert guard.store.list() == []


def test_the_stdio_session_passes_the_callers_environment(
    env: dict[str, str], guard: Guard, stripe: LocalStripe, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("MCP_STRIPE", "MCP_SMTP"):  # the payments server's settings, as an API key would be
        monkeypatch.setenv(name, env[name])

    async def body() -> types.CallToolResult:
        params = StdioServerParameters(
            command=sys.executable, args=[str(SERVER)]
        )  # no env=: the docs' recipe
        async with stdio_session(params) as session:
            return await GuardedSession(session, guard, server="payments").call_tool(
                "charge", CHARGE, key="e1"
            )

    result = in_loop(body)
    assert not result.is_error, result.content
    assert charges(stripe) == 1


# ------------------------------------------------------------------ server start failures


@pytest.mark.parametrize(
    "server",
    [["/nonexistent/mcp-server"], [sys.executable, "-c", "import sys; sys.exit(3)"],
     [sys.executable, "-c", "print('not json-rpc'); import sys; sys.exit(0)"]],
    ids=["missing", "exits", "garbage"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["tools", "proxy"])
def test_a_server_that_fails_to_start_is_one_line(command: str, server: list[str], tmp_path: Path) -> None:
    argv = [sys.executable, "-c", CLI, "mcp", command, *(["--store", f"sqlite:///{tmp_path / 'p.db'}"]
            if command == "proxy" else []), "--", *server]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sagaguard: "), done.stderr
    assert "Traceback" not in done.stderr


# -------------------------------------------------- a server that answers its errors as text


def text_params(tmp_path: Path) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=[str(TEXT_SERVER), str(tmp_path / "rows.db")])


def test_a_declared_failure_check_classifies_a_text_error_as_a_failure(tmp_path: Path, guard: Guard) -> None:
    bad = {"query": "INSERT INTO nowhere VALUES ('x')"}

    async def body() -> tuple[types.CallToolResult, types.CallToolResult, types.CallToolResult]:
        async with stdio_session(text_params(tmp_path)) as session:
            plain = GuardedSession(session, guard, server="sql")
            checked = GuardedSession(
                session,
                guard,
                server="sql2",
                declare={"write_query": changes_world(failed_if=ErrorText("^Error:"))},
            )
            return (
                await plain.call_tool("write_query", bad, key="w1"),
                await checked.call_tool("write_query", bad, key="w2"),
                await checked.call_tool("write_query", {"query": "INSERT INTO items VALUES ('a')"}, key="w3"),
            )

    plain, checked, fine = in_loop(body)
    assert not plain.is_error  # the server's own answer: no isError, recorded as a success
    assert checked.is_error  # the declared check: a failure, recorded FAILED (not applied)
    assert not fine.is_error
    states = sorted((record.name, record.state.value) for record in guard.store.list())
    assert states == [("mcp.sql.write_query", "succeeded"), ("mcp.sql2.write_query", "failed"),
                      ("mcp.sql2.write_query", "succeeded")]  # fmt: skip


def test_an_undo_answered_as_a_text_error_fails_instead_of_counting_as_done(tmp_path: Path) -> None:
    params = text_params(tmp_path)
    servers = McpServers()
    servers.register("sql", lambda: stdio_session(params))
    undos = UndoRegistry()
    mcp_undos = McpUndos(undos, servers)
    refuse = {"query": "DELETE FROM locked"}
    mcp_undos.undo("sql", "insert_locked", UndoTool("write_query", arguments=lambda call, result: refuse,
                                                    failed_if=ErrorText("^Error:")))  # fmt: skip
    mcp_undos.undo("sql", "insert_plain", UndoTool("write_query", arguments=lambda call, result: refuse))

    async def lock_a_row() -> None:
        async with stdio_session(params) as session:
            await session.call_tool("write_query", {"query": "INSERT INTO locked VALUES ('x')"})

    in_loop(lock_a_row)
    undo = undos.get("mcp.sql.insert_locked.undo")
    assert undo is not None
    with pytest.raises(UndoFailed, match="rows of locked are kept"):
        undo({"arguments": {}}, None)
    plain = undos.get("mcp.sql.insert_plain.undo")
    assert undo is not None and plain is not None
    plain({"arguments": {}}, None)  # unchecked: the refusal is taken for done


# ------------------------------------------------------------- an agent run needs no scope


def test_a_tool_without_undo_in_an_agent_run_needs_no_scope(
    env: dict[str, str], tmp_path: Path, stripe: LocalStripe, sink: SmtpSink
) -> None:
    db = f"sqlite:///{tmp_path / 'agent.db'}"
    agent = AgentSaga("mail_agent", UndoRegistry())

    async def body() -> list[types.CallToolResult]:
        guard = Guard(open_store(db))
        runner = AgentRunner(open_journal(db), guard, sleep=lambda _s: None)
        try:
            async with stdio_session(server_params(env)) as session, runner.run(agent, "run-1"):
                payments = GuardedSession(session, guard, server="payments")
                # No scope(...) around it: the run names the call. Twice: the second is the
                # framework re-running the tool call (the same tool call id), replayed.
                return [await payments.call_tool("send_email", {"to": "ana@example.com", "subject": "hi"},
                                                  call_id="m1") for _ in range(2)]  # fmt: skip
        finally:
            runner.close()
            guard.close()

    first, second = in_loop(body)
    assert not first.is_error and second.structured_content == first.structured_content
    assert counts(stripe, sink)["emails"] == 1


# --------------------------------------------------------- the operator resolving an MCP call


def sagaguard(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI, *argv], capture_output=True, text=True, timeout=120,
                          check=False, env=env)  # fmt: skip


def test_resolving_an_mcp_call_needs_a_result_of_its_shape_and_show_names_what_the_server_saw(
    env: dict[str, str], tmp_path: Path, stripe: LocalStripe
) -> None:
    store = f"sqlite:///{tmp_path / 'effects.db'}"
    guard = Guard(open_store(store), lease=1.0)

    async def charge(kill: str = "") -> types.CallToolResult:
        async with stdio_session(server_params({**env, "MCP_KILL": kill})) as session:
            return await GuardedSession(session, guard, server="payments").call_tool(
                "charge", CHARGE, key="op-1", read_timeout_seconds=30
            )

    try:
        with pytest.raises(OutcomeUnknown):
            in_loop(lambda: charge("after_charge"))
        (record,) = guard.store.list()
        cli_env = {**os.environ, "SAGAGUARD_STORE": store}
        shown = sagaguard("effects", "show", record.key, env=cli_env)
        assert shown.returncode == 0, shown.stderr
        assert record.fingerprint in shown.stdout and "arguments" in shown.stdout
        sent = next(line.split()[2] for line in shown.stdout.splitlines() if line.startswith("provider key"))
        from stripe import StripeClient

        found = StripeClient("sk_test", base_addresses={"api": stripe.url}).v1.payment_intents.search(
            params={"query": f"metadata['mcp_key']:'{sent}'"}
        )
        assert len(found.data) == 1  # the key `effects show` names is the one the server saw

        for bad in ([], ["--result", '{"id": "pi_1"}'], ["--result", "null"], ["--result", '{"content": 7}']):
            refused = sagaguard("effects", "resolve", record.key, "--applied", *bad, env=cli_env)
            assert refused.returncode == 2 and "Traceback" not in refused.stderr, (bad, refused.stderr)
            assert guard.store.get(record.key).state is State.IN_DOUBT  # nothing recorded
        intent = found.data[0]
        result = {"content": [{"type": "text", "text": intent.id}], "structuredContent": {"id": intent.id},
                  "isError": False}  # fmt: skip
        done = sagaguard(
            "effects", "resolve", record.key, "--applied", "--result", json.dumps(result), env=cli_env
        )
        assert done.returncode == 0, done.stderr
        replayed = in_loop(charge)
        assert replayed.structured_content == {"id": intent.id}
        assert charges(stripe) == 1
    finally:
        guard.close()


# ---------------------------------------------------------------------- the proxy's identity


def test_the_proxy_keeps_a_calls_identity_across_the_requests_of_one_connection(
    env: dict[str, str], stripe: LocalStripe, tmp_path: Path
) -> None:
    """No key: the call is its connection and JSON-RPC request id. The same request id sent again on
    the same connection (a client re-sending a request it got no answer to) is the same call."""
    from mcp.types.version import LATEST_HANDSHAKE_VERSION

    proxy_env = {**env, "SAGAGUARD_STORE": f"sqlite:///{tmp_path / 'proxy.db'}"}
    process = subprocess.Popen(
        proxy_argv(), env=proxy_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdin is not None and process.stdout is not None

    def send(message: dict[str, Any]) -> None:
        assert process.stdin is not None
        process.stdin.write(json.dumps({"jsonrpc": "2.0", **message}) + "\n")
        process.stdin.flush()

    def answer(request_id: int) -> dict[str, Any]:
        assert process.stdout is not None
        while True:  # skip the proxy's notifications, if any
            found: dict[str, Any] = json.loads(process.stdout.readline())
            if found.get("id") == request_id:
                return found

    try:
        send({"id": 1, "method": "initialize", "params": {
            "protocolVersion": LATEST_HANDSHAKE_VERSION, "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"}}})  # fmt: skip
        assert "result" in answer(1)
        send({"method": "notifications/initialized"})
        call = {"id": 5, "method": "tools/call", "params": {"name": "charge", "arguments": CHARGE}}
        send(call)
        first = answer(5)
        send(call)  # the same request id on the same connection: the same call
        second = answer(5)
    finally:
        process.stdin.close()
        process.wait(timeout=60)
    assert first["result"]["structuredContent"]["id"].startswith("pi_")
    assert second["result"] == first["result"]
    assert charges(stripe) == 1


def test_the_proxy_reads_per_tool_declarations_from_a_file(env: dict[str, str], tmp_path: Path) -> None:
    declare = tmp_path / "declare.json"
    declare.write_text(json.dumps({"tools": {"balance": {"mode": "changes_world", "failed_if": "^never$"}}}))
    proxy_env = {**env, "SAGAGUARD_STORE": f"sqlite:///{tmp_path / 'proxy.db'}"}
    twice = [("balance", {}, "b-1"), ("balance", {}, "b-1")]
    plain = in_loop(lambda: calls_through(proxy_argv(), proxy_env, twice))
    declared = in_loop(lambda: calls_through(proxy_argv("--declare", str(declare)), proxy_env, twice))
    seen = [r.structured_content["calls"] for r in (*plain, *declared)]  # type: ignore[union-attr]
    assert seen == [1, 2, 1, 1]  # annotated read-only: sent each time; declared: guarded, replayed

    refused: list[Any] = [
        {"tools": {"balance": {"mode": "maybe"}}},
        {"tools": {"charge": {"mode": "changes_world", "undo": "refund"}}},
        [1],
        {"tools": {"x": {"mode": "changes_world", "failed_if": "("}}},
    ]
    for bad in refused:
        declare.write_text(json.dumps(bad))
        done = subprocess.run(proxy_argv("--declare", str(declare)), env=proxy_env, capture_output=True,
                              text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)  # fmt: skip
        assert done.returncode == 2, (bad, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "--declare" in done.stderr, done.stderr


def test_two_http_clients_of_the_proxy_without_keys_are_never_one_call(
    env: dict[str, str], stripe: LocalStripe, tmp_path: Path
) -> None:
    """Each HTTP client numbers its requests from the same start: the connection (its
    ``mcp-session-id``) keeps their calls apart."""
    from _mcpkit import serve_http

    from sagaguard.connectors.mcp import http_session

    proxy_env = {**env, "SAGAGUARD_STORE": f"sqlite:///{tmp_path / 'proxy.db'}"}
    with serve_http(proxy_env, proxy_argv("--http", "127.0.0.1:{port}")) as url:

        async def client() -> types.CallToolResult:
            async with http_session(url) as session:
                return await session.call_tool("charge", CHARGE)

        first, second = in_loop(client), in_loop(client)
    assert first.structured_content["id"] != second.structured_content["id"]  # type: ignore[index]
    assert charges(stripe) == 2
