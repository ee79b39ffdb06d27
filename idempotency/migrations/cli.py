"""The ``db`` commands of the ``sagaguard`` CLI: where a database's schema stands, and upgrading it.

::

    sagaguard db status  [--store URL] [--only SET ...] [--effects-table T] [--journal-prefix P]
                         [--outbox-table T] [--json]
    sagaguard db upgrade [--store URL] [--only SET ...] [--effects-table T] [--journal-prefix P]
                         [--outbox-table T]

The group :data:`db` is registered under the entry-point group ``sagaguard.commands``. The
database is ``--store``, else ``$SAGAGUARD_STORE``, else ``sqlite:///sagaguard.db``. The table
sets are those registered under the ``sagaguard.schemas`` entry points (effects, journal, outbox,
...); each takes its configured table name or prefix as ``--{set}-{table|prefix}``.

Exit status: 0 every table set is up to date (``status``) or now is (``upgrade``); 1 the database
cannot be reached or failed; 2 bad usage or configuration (a Redis URL, a bad table name);
3 (``status``) a table set is empty or behind: run ``sagaguard db upgrade``; 4 a table set is
newer than this sagaguard (``upgrade`` leaves it alone and upgrades the others).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from sagaguard.idempotency.backends.urls import check_url, masked
from sagaguard.idempotency.cliopts import (
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CliError,
    echo_json,
    json_option,
    run,
    store_url,
)
from sagaguard.idempotency.cliutil import install_hint, sqlite_file, table_lines
from sagaguard.idempotency.errors import ConfigurationError, SchemaVersionMismatch
from sagaguard.idempotency.migrations.runner import SchemaState, SchemaStatus, schema_status, upgrade_schema
from sagaguard.idempotency.migrations.tableset import TableSet, table_sets

__all__ = ["EXIT_AHEAD", "EXIT_BEHIND", "db"]

EXIT_BEHIND = 3
"""``db status``: a table set is empty or behind (``sagaguard db upgrade`` fixes it)."""
EXIT_AHEAD = 4
"""A table set is at a revision newer than this sagaguard (a newer sagaguard wrote it)."""

F = TypeVar("F", bound=Callable[..., Any])


def _common(f: F) -> F:
    """``--store``, ``--only`` and each table set's ``--{set}-{table|prefix}``."""
    sets = table_sets()
    for ts in sets:
        f = click.option(
            ts.option(),
            f"name_{ts.name}",
            metavar=ts.parameter.upper(),
            default=ts.default,
            help=f"the {ts.what}'s {ts.parameter} (default {ts.default})",
        )(f)
    f = click.option(
        "--only",
        multiple=True,
        type=click.Choice([ts.name for ts in sets]),
        metavar="SET",
        help=f"only these table sets ({', '.join(ts.name for ts in sets)}; default: all); repeatable",
    )(f)
    return click.option(
        "--store", metavar="URL", default=None, help="the database (default: $SAGAGUARD_STORE)"
    )(f)


@click.group(no_args_is_help=True)
def db() -> None:
    """The SQL schema: status and upgrade (Alembic)."""


@db.command(
    epilog="Exit status: 0 all up to date, 1 database failed, 2 bad usage, 3 a table set is empty "
    "or behind, 4 a table set is newer than this sagaguard."
)
@json_option
@_common
def status(*, as_json: bool, store: str | None, only: tuple[str, ...], **names: str) -> None:
    """Where each table set stands: current revision, head, up to date / behind / ahead / empty."""
    run(lambda: _run("status", store, only, names, as_json=as_json))


@db.command(
    epilog="Exit status: 0 all up to date now, 1 database failed, 2 bad usage, 4 a table set is "
    "newer than this sagaguard (left alone)."
)
@_common
def upgrade(*, store: str | None, only: tuple[str, ...], **names: str) -> None:
    """Create or migrate the tables to this sagaguard's revision (safe to run again)."""
    run(lambda: _run("upgrade", store, only, names, as_json=False))


def _run(
    action: str, store: str | None, only: tuple[str, ...], given: dict[str, str], *, as_json: bool
) -> int:
    url = store_url(store)
    try:
        return _act(action, url, only, given, as_json=as_json)
    except ModuleNotFoundError as exc:
        raise CliError(
            f"the database {masked(url)!r} needs the {exc.name!r} package{install_hint(exc)}", EXIT_USAGE
        ) from exc


def _act(action: str, url: str, only: tuple[str, ...], given: dict[str, str], *, as_json: bool) -> int:
    scheme = check_url(url, what="store")
    if scheme not in ("sqlite", "postgresql"):
        raise ConfigurationError(f"`sagaguard db` serves SQLite and Postgres databases, not {scheme}")
    chosen = [ts for ts in table_sets() if not only or ts.name in only]
    names = {ts.name: given.get(f"name_{ts.name}", ts.default) for ts in chosen}
    for ts in chosen:
        ts.tables(names[ts.name])  # a bad name: ConfigurationError before any I/O
    file = sqlite_file(url)
    if action == "status" and file is not None and not file.exists():
        # Looking must not create the file: nothing is there.
        return _report([_nothing(ts, names[ts.name]) for ts in chosen], as_json)
    from sagaguard.idempotency.backends.sql_engine import make_engine

    engine = make_engine(url)
    try:
        if action == "status":
            return _report(schema_status(engine, chosen, names), as_json)
        return _upgrade(engine, chosen, names)
    finally:
        engine.dispose()


def _nothing(ts: TableSet, name: str) -> SchemaStatus:
    return SchemaStatus(ts.name, name, ts.version_table_for(name), None, ts.head, SchemaState.EMPTY)


def _report(statuses: list[SchemaStatus], as_json: bool) -> int:
    if as_json:
        echo_json([status.as_json() for status in statuses])
    else:
        rows = [("TABLE SET", "NAME", "CURRENT", "HEAD", "STATE")]
        for s in statuses:
            current = s.current or ("unversioned" if s.unversioned else "-")
            rows.append((s.table_set, s.name, current, s.head, s.state.value))
        for line in table_lines(rows[0], rows[1:]):
            click.echo(line)
    states = {status.state for status in statuses}
    if SchemaState.AHEAD in states:
        return EXIT_AHEAD
    return EXIT_OK if states <= {SchemaState.UP_TO_DATE} else EXIT_BEHIND


def _upgrade(engine: Any, chosen: list[TableSet], names: dict[str, str]) -> int:
    code = EXIT_OK
    for ts in chosen:
        name = names[ts.name]
        try:
            before = upgrade_schema(engine, ts, name)
        except SchemaVersionMismatch as exc:
            click.echo(f"{PROG}: {exc}", err=True)
            code = EXIT_AHEAD
            continue
        if before.state is SchemaState.UP_TO_DATE:
            done = f"already at {ts.head}"
        elif before.state is SchemaState.EMPTY:
            done = f"created at {ts.head}"
        else:
            done = f"upgraded from {before.current or 'unversioned'} to {ts.head}"
        click.echo(f"{ts.name} ({name}): {done}")
    return code
