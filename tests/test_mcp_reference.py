"""The guarded session against the reference MCP servers from the package index, each run from a
venv of its own (``make test`` builds them): ``mcp-server-git`` (the 2.x SDK) and
``mcp-server-sqlite`` (which needs the 1.x SDK, so it cannot run beside the ``mcp`` extra). Effects
are counted in the git repository and the SQLite database the servers write.

Without those venvs the tests skip, saying why; under ``CI=true`` they fail instead.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _mcpkit import ROOT, in_loop
from mcp import types
from mcp.client.stdio import StdioServerParameters

from sagaguard.connectors.declare import changes_world, read_only
from sagaguard.connectors.mcp import (
    ErrorText,
    GuardedSession,
    McpServers,
    McpUndos,
    UndoFailed,
    UndoTool,
    stdio_session,
)
from sagaguard.idempotency import Guard, open_store, scope
from sagaguard.idempotency.records import State
from sagaguard.saga.agent import UndoRegistry

pytestmark = pytest.mark.timeout(180)

GIT_SERVER = ROOT / ".venv-mcp-git" / "bin" / "mcp-server-git"
SQLITE_SERVER = ROOT / ".venv-mcp-sqlite" / "bin" / "mcp-server-sqlite"


def need(server: Path) -> None:
    if server.exists():
        return
    why = f"{server.relative_to(ROOT)} is not installed (make {server.parent.parent.name}/.installed)"
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[Guard]:
    g = Guard(open_store(f"sqlite:///{tmp_path / 'effects.db'}"), lease=1.0)
    yield g
    g.close()


def git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True, check=True).stdout


def test_a_git_commit_through_the_guarded_session_is_made_once(tmp_path: Path, guard: Guard) -> None:
    need(GIT_SERVER)
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "agent@example.com")
    git(repo, "config", "user.name", "agent")
    (repo / "notes.txt").write_text("hello\n")
    params = StdioServerParameters(command=str(GIT_SERVER), args=["--repository", str(repo)])

    async def run() -> list[types.CallToolResult]:
        async with stdio_session(params) as session:
            tools = GuardedSession(session, guard, server="git")
            with scope("change-1"):
                added = await tools.call_tool(
                    "git_add", {"repo_path": str(repo), "files": ["notes.txt"]}, call_id="add"
                )
                made = await tools.call_tool(
                    "git_commit", {"repo_path": str(repo), "message": "notes"}, call_id="commit"
                )
                status = await tools.call_tool("git_status", {"repo_path": str(repo)})
                return [added, made, status]

    first = in_loop(run)
    again = in_loop(run)  # the agent re-run: a new server process, the same ledger
    assert not any(r.is_error for r in first), first
    assert again[1].content == first[1].content  # the recorded commit, not a new one
    assert git(repo, "rev-list", "--count", "HEAD").strip() == "1"
    modes = {r.name: r.state for r in guard.store.list()}
    assert modes == {
        "mcp.git.git_add": State.SUCCEEDED,
        "mcp.git.git_commit": State.SUCCEEDED,
    }  # status: read-only


def sqlite_params(db: Path) -> StdioServerParameters:
    return StdioServerParameters(command=str(SQLITE_SERVER), args=["--db-path", str(db)])


def test_the_sqlite_server_declared_reads_are_fresh_and_text_errors_are_failures(
    tmp_path: Path, guard: Guard
) -> None:
    need(SQLITE_SERVER)
    db = tmp_path / "shop.db"
    with sqlite3.connect(db) as connection:
        connection.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)")
    declare: dict[str, Any] = {
        "read_query": read_only,  # no annotations: without this, a read is guarded and replayed
        "write_query": changes_world(failed_if=ErrorText(r"^Database error")),
    }

    async def run() -> list[types.CallToolResult]:
        async with stdio_session(sqlite_params(db)) as session:
            sql = GuardedSession(session, guard, server="sqlite", declare=declare)
            count = {"query": "SELECT count(*) AS n FROM orders"}
            with scope("shop-1"):
                return [
                    await sql.call_tool("write_query", {"query": "INSERT INTO orders (item) VALUES ('a')"},
                                        call_id="w1"),
                    await sql.call_tool("read_query", count),
                    await sql.call_tool("write_query", {"query": "INSERT INTO orders (item) VALUES ('b')"},
                                        call_id="w2"),
                    await sql.call_tool("read_query", count),
                    await sql.call_tool("write_query", {"query": "INSERT INTO nowhere VALUES (1)"},
                                        call_id="w3"),
                ]  # fmt: skip

    first = in_loop(run)
    again = in_loop(run)
    assert [r.is_error for r in first] == [False, False, False, False, True]
    counted = [r.content[0].text for r in (first[1], first[3], again[1], again[3])]  # type: ignore[union-attr]
    assert ["1" in counted[0], "2" in counted[1], "2" in counted[2], "2" in counted[3]] == [True] * 4
    with sqlite3.connect(db) as connection:
        assert connection.execute("SELECT count(*) FROM orders").fetchone()[0] == 2  # each insert once
    states = {r.key: r.state for r in guard.store.list()}
    assert sorted(states.values()) == sorted([State.SUCCEEDED, State.SUCCEEDED, State.FAILED])


def test_a_refused_undo_on_the_sqlite_server_is_a_failure_not_a_compensation(tmp_path: Path) -> None:
    need(SQLITE_SERVER)
    db = tmp_path / "shop.db"
    with sqlite3.connect(db) as connection:
        connection.executescript(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT);"
            "INSERT INTO orders (item) VALUES ('a');"
            "CREATE TRIGGER keep BEFORE DELETE ON orders BEGIN SELECT RAISE(ABORT, 'orders are kept'); END;"
        )
    servers = McpServers()
    servers.register("sqlite", lambda: stdio_session(sqlite_params(db)))
    undos = UndoRegistry()
    delete = UndoTool(
        "write_query",
        arguments=lambda call, result: {"query": "DELETE FROM orders"},
        failed_if=ErrorText("^Database error"),
    )
    McpUndos(undos, servers).undo("sqlite", "write_query", delete)
    undo = undos.get("mcp.sqlite.write_query.undo")
    assert undo is not None
    with pytest.raises(UndoFailed, match="orders are kept"):
        undo({"arguments": {}}, None)
    with sqlite3.connect(db) as connection:
        assert connection.execute("SELECT count(*) FROM orders").fetchone()[0] == 1
