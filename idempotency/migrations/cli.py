"""The ``db`` commands of the ``sagaguard`` CLI: where a database's schema stands, and upgrading it.

::

    sagaguard db status  [--store URL] [--only SET ...] [--effects-table T] [--journal-prefix P]
                         [--outbox-table T] [--json]
    sagaguard db upgrade [--store URL] [--only SET ...] [--effects-table T] [--journal-prefix P]
                         [--outbox-table T]

The database is ``--store``, else ``$SAGAGUARD_STORE``, else ``sqlite:///sagaguard.db``. The table
sets are those registered under the ``sagaguard.schemas`` entry points (effects, journal, outbox,
...); each takes its configured table name or prefix as ``--{set}-{table|prefix}``.

Exit status: 0 every table set is up to date (``status``) or now is (``upgrade``); 1 the database
cannot be reached or failed; 2 bad usage or configuration (a Redis URL, a bad table name);
3 (``status``) a table set is empty or behind: run ``sagaguard db upgrade``; 4 a table set is
newer than this sagaguard (``upgrade`` leaves it alone and upgrades the others).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from sagaguard.idempotency.backends.urls import check_url, masked
from sagaguard.idempotency.cliutil import install_hint, sqlite_file
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError, SchemaVersionMismatch
from sagaguard.idempotency.migrations.runner import SchemaState, SchemaStatus, schema_status, upgrade_schema
from sagaguard.idempotency.migrations.tableset import TableSet, table_sets

__all__ = ["EXIT_AHEAD", "EXIT_BEHIND", "add_commands", "run"]

PROG = "sagaguard"
ENV_STORE = "SAGAGUARD_STORE"
DEFAULT_URL = "sqlite:///sagaguard.db"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_BEHIND = 3
"""``db status``: a table set is empty or behind (``sagaguard db upgrade`` fixes it)."""
EXIT_AHEAD = 4
"""A table set is at a revision newer than this sagaguard (a newer sagaguard wrote it)."""


def add_commands(subparsers: Any) -> None:
    """Add ``db status`` and ``db upgrade`` to a ``sagaguard`` sub-parser collection.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    sets = table_sets()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--store",
        metavar="URL",
        default=argparse.SUPPRESS,
        help=f"the database (default: ${ENV_STORE}, else {DEFAULT_URL})",
    )
    common.add_argument(
        "--only",
        action="extend",
        nargs="+",
        choices=[ts.name for ts in sets],
        metavar="SET",
        help=f"only these table sets ({', '.join(ts.name for ts in sets)}; default: all)",
    )
    for ts in sets:
        common.add_argument(
            ts.option(),
            dest=f"name_{ts.name}",
            metavar=ts.parameter.upper(),
            default=ts.default,
            help=f"the {ts.what}'s {ts.parameter} (default {ts.default})",
        )
    db = subparsers.add_parser("db", help="the SQL schema: status and upgrade (Alembic)")
    db.set_defaults(sagaguard_db=None, db_parser=db)
    actions = db.add_subparsers(dest="sagaguard_db", metavar="ACTION")
    status = actions.add_parser(
        "status",
        parents=[common],
        help="where each table set stands: current revision, head, up to date / behind / ahead / empty",
        epilog="Exit status: 0 all up to date, 1 database failed, 2 bad usage, 3 a table set is empty "
        "or behind, 4 a table set is newer than this sagaguard.",
    )
    status.add_argument("--json", action="store_true", help="the table sets as a JSON array")
    actions.add_parser(
        "upgrade",
        parents=[common],
        help="create or migrate the tables to this sagaguard's revision (safe to run again)",
        epilog="Exit status: 0 all up to date now, 1 database failed, 2 bad usage, 4 a table set is "
        "newer than this sagaguard (left alone).",
    )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the ``db`` command that ``args`` (parsed with :func:`add_commands`) names."""
    action = getattr(args, "sagaguard_db", None)
    if action is None:
        args.db_parser.print_help(sys.stderr)
        return EXIT_USAGE
    out = out or sys.stdout
    url = getattr(args, "store", None) or os.environ.get(ENV_STORE) or DEFAULT_URL
    try:
        return _run(action, args, url, out)
    except ModuleNotFoundError as exc:
        print(f"{PROG}: the database {masked(url)!r} needs the {exc.name!r} package{install_hint(exc)}",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    except ConfigurationError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except IdempotencyError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _run(action: str, args: argparse.Namespace, url: str, out: TextIO) -> int:
    scheme = check_url(url, what="store")
    if scheme not in ("sqlite", "postgresql"):
        raise ConfigurationError(f"`sagaguard db` serves SQLite and Postgres databases, not {scheme}")
    chosen = [ts for ts in table_sets() if not args.only or ts.name in args.only]
    names = {ts.name: getattr(args, f"name_{ts.name}", ts.default) for ts in chosen}
    for ts in chosen:
        ts.tables(names[ts.name])  # a bad name: ConfigurationError before any I/O
    file = sqlite_file(url)
    if action == "status" and file is not None and not file.exists():
        # Looking must not create the file: nothing is there.
        return _report([_nothing(ts, names[ts.name]) for ts in chosen], args.json, out)
    from sagaguard.idempotency.backends.sql_engine import make_engine

    engine = make_engine(url)
    try:
        if action == "status":
            return _report(schema_status(engine, chosen, names), args.json, out)
        return _upgrade(engine, chosen, names, out)
    finally:
        engine.dispose()


def _nothing(ts: TableSet, name: str) -> SchemaStatus:
    return SchemaStatus(ts.name, name, ts.version_table_for(name), None, ts.head, SchemaState.EMPTY)


def _report(statuses: list[SchemaStatus], as_json: bool, out: TextIO) -> int:
    if as_json:
        print(json.dumps([status.as_json() for status in statuses], indent=2), file=out)
    else:
        rows = [("TABLE SET", "NAME", "CURRENT", "HEAD", "STATE")]
        for s in statuses:
            current = s.current or ("unversioned" if s.unversioned else "-")
            rows.append((s.table_set, s.name, current, s.head, s.state.value))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print(
                "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(),
                file=out,
            )
    states = {status.state for status in statuses}
    if SchemaState.AHEAD in states:
        return EXIT_AHEAD
    return EXIT_OK if states <= {SchemaState.UP_TO_DATE} else EXIT_BEHIND


def _upgrade(engine: Any, chosen: list[TableSet], names: dict[str, str], out: TextIO) -> int:
    code = EXIT_OK
    for ts in chosen:
        name = names[ts.name]
        try:
            before = upgrade_schema(engine, ts, name)
        except SchemaVersionMismatch as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            code = EXIT_AHEAD
            continue
        if before.state is SchemaState.UP_TO_DATE:
            done = f"already at {ts.head}"
        elif before.state is SchemaState.EMPTY:
            done = f"created at {ts.head}"
        else:
            done = f"upgraded from {before.current or 'unversioned'} to {ts.head}"
        print(f"{ts.name} ({name}): {done}", file=out)
    return code
