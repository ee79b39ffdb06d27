"""Small pieces every ``sagaguard`` command shares that are not click's: durations, aligned tables,
JSON shown to a person, a closed pipe, and opening a store or a journal without creating anything
(:mod:`sagaguard.idempotency.cliopts` has the click side)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sagaguard.idempotency.backends.urls import check_url, driver_hint, masked
from sagaguard.idempotency.errors import IdempotencyError, StoreUnavailable
from sagaguard.idempotency.store import IdempotencyStore

__all__ = [
    "SchemaMissing",
    "duration",
    "install_hint",
    "open_existing_store",
    "piped",
    "pretty_json",
    "require_schema",
    "sqlite_file",
    "table_lines",
]


def duration(seconds: float) -> str:
    """A short human duration: ``42s``, ``3m05s``, ``2h10m``, ``4d03h``."""
    s = int(max(seconds, 0.0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86_400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86_400}d{s % 86_400 // 3600:02d}h"


def table_lines(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``header`` and ``rows`` as lines of left-aligned columns two spaces apart, trailing blanks cut."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]


def pretty_json(text: str | None) -> str:
    """Stored JSON text indented for a person; ``-`` for None, and text that is not JSON as it is."""
    if text is None:
        return "-"
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def install_hint(exc: ImportError) -> str:
    """``: pip install 'sagaguard[redis]'`` for a backend driver that is missing, else ``""``."""
    hint = driver_hint(exc)
    return f": {hint}" if hint else ""


def piped(command: Callable[[], int], *, gone: int = 1) -> int:
    """Run a command whose output may be piped (``sagaguard sagas list | head``), and flush it.

    A reader that goes away (``head`` has its lines) ends the command quietly with ``gone``
    instead of a ``BrokenPipeError`` traceback, here or when Python flushes stdout at exit. The
    output is flushed inside, so a broken pipe is met here and not at exit.
    """
    try:
        code = command()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Point stdout at /dev/null, so the flush at exit does not complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return gone


def sqlite_file(url: str) -> Path | None:
    """The file a ``sqlite:///path`` URL names; None for in-memory SQLite or another scheme."""
    parts = urlsplit(url)
    if not parts.scheme.lower().startswith("sqlite"):
        return None
    path = unquote(parts.path)
    if path.startswith("/"):
        path = path[1:]  # sqlite:///rel.db -> rel.db, sqlite:////abs.db -> /abs.db
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    return Path(path)


class SchemaMissing(IdempotencyError, LookupError):
    """An operator's command found no database, or no sagaguard table, at the URL it was given."""


def require_schema(url: str, tables: Sequence[str], *, what: str, option: str = "--store") -> None:
    """Check that the SQL database at ``url`` holds ``tables``, creating nothing.

    A SQLite file that does not exist is reported, not opened (opening would create it), and the
    tables are looked up, never created. Operators' commands call it before opening a store or
    journal with ``create=False``, so a typo in a URL fails naming the URL (password masked) instead
    of creating an empty database that lists nothing.

    Args:
        url: a ``sqlite://`` or ``postgresql://`` URL.
        tables: the tables that must exist.
        what: what they hold ("effect records", "sagas"), for the message.
        option: the option that names the URL, for the message.

    Raises:
        SchemaMissing: the SQLite file or a table does not exist.
        ConfigurationError: the URL cannot be used.
        StoreUnavailable: the database cannot be reached.
    """
    import sqlalchemy as sa

    from sagaguard.idempotency.stores.sql import make_engine

    file = sqlite_file(url)
    if file is not None and not file.exists():
        raise SchemaMissing(
            f"no SQLite database at {file} (the file does not exist): check {option} or $SAGAGUARD_STORE"
        )
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            found = set(sa.inspect(conn).get_table_names())
    except sa.exc.OperationalError as exc:
        raise StoreUnavailable(f"cannot reach {masked(url)}: {type(exc.orig or exc).__name__}") from exc
    finally:
        engine.dispose()
    absent = [t for t in tables if t not in found]
    if absent:
        raise SchemaMissing(
            f"no {what} at {masked(url)} (no table {', '.join(absent)}): check {option} or "
            "$SAGAGUARD_STORE; the application creates the schema when it first runs"
        )


def open_existing_store(url: str) -> IdempotencyStore:
    """The effect store at ``url``, opened without creating a file or a table.

    Raises:
        SchemaMissing: a SQL URL names no database file or no effects table.
        ConfigurationError: the URL cannot be used.
        StoreUnavailable: the store cannot be reached.
    """
    from sagaguard.idempotency.stores import open_store
    from sagaguard.idempotency.stores.sql import DEFAULT_TABLE, SqlStore

    if check_url(url, what="store") not in ("sqlite", "postgresql"):
        return open_store(url)
    require_schema(url, [DEFAULT_TABLE], what="effect records")
    return SqlStore(url, create=False)
