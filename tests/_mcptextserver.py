"""A SQL MCP server that answers its errors as text, without ``isError`` (as the reference
``mcp-server-sqlite`` does), for the failure-check tests.

Tools (no annotations, as the reference server has none): ``write_query(query)`` runs one
statement and answers ``rows affected: N``, or ``Error: ...`` as plain text when SQLite refuses it;
``count(table)`` answers the number of rows. A trigger refuses every DELETE from ``locked``.

``python tests/_mcptextserver.py DB_PATH`` serves stdio.
"""

from __future__ import annotations

import sqlite3
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("sqltext")
DB = sys.argv[1] if len(sys.argv) > 1 else ":memory:"


def _connect() -> sqlite3.Connection:
    connection = sqlite3.connect(DB, isolation_level=None)
    connection.executescript(
        "CREATE TABLE IF NOT EXISTS items (name TEXT);"
        "CREATE TABLE IF NOT EXISTS locked (name TEXT);"
        "CREATE TRIGGER IF NOT EXISTS keep BEFORE DELETE ON locked "
        "BEGIN SELECT RAISE(ABORT, 'rows of locked are kept'); END;"
    )
    return connection


@server.tool()
def write_query(query: str) -> str:
    """Run one INSERT, UPDATE or DELETE."""
    try:
        with _connect() as connection:
            cursor = connection.execute(query)
            return f"rows affected: {cursor.rowcount}"
    except sqlite3.Error as exc:
        return f"Error: {exc}"  # as text, no isError: what the reference server does


@server.tool()
def count(table: str) -> int:
    """The number of rows in ``table`` (items or locked)."""
    if table not in {"items", "locked"}:
        raise ValueError(table)
    with _connect() as connection:
        return int(connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


if __name__ == "__main__":
    server.run("stdio")
