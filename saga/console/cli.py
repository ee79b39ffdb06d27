"""``sagaguard ui``: start the operator's web console.

::

    sagaguard ui [--store URL] [--journal URL] [--outbox URL] [--host 127.0.0.1] [--port 8089]
                 [--token TOKEN] [--read-only] [--show-payloads] [--trace-url TEMPLATE]

Safe by default: it binds 127.0.0.1, and nobody acts without the token. The token is ``--token``,
else ``$SAGAGUARD_UI_TOKEN``, else one made at start and printed once; ``--read-only`` takes none
and refuses every action. Arguments, results and payloads are shown only with ``--show-payloads``.

The click command :data:`ui` is registered under the entry-point group ``sagaguard.commands``;
Starlette and uvicorn are imported only when it runs, so the command is listed without the ``ui``
extra and says how to install it.

Exit status: 0 stopped; 1 the store failed; 2 bad usage, or the ``ui`` extra is not installed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from typing import Any

import click

from sagaguard.idempotency.audit import open_audit
from sagaguard.idempotency.backends.urls import check_url, masked
from sagaguard.idempotency.cliopts import EXIT_USAGE, PROG, CliError, run, store_option, store_url
from sagaguard.idempotency.cliutil import SchemaMissing, open_existing_store, require_schema
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.outbox.model import DEFAULT_TABLE as OUTBOX_TABLE
from sagaguard.saga.errors import SagaError
from sagaguard.saga.journal import SagaJournal

__all__ = ["ENV_TOKEN", "ui"]

ENV_TOKEN = "SAGAGUARD_UI_TOKEN"
"""The environment variable holding the console's token when ``--token`` is not given."""


def _journal(url: str) -> SagaJournal:
    """The journal at ``url``, opened without creating anything on SQL."""
    from sagaguard.saga.journals import open_journal

    if check_url(url, what="journal") not in ("sqlite", "postgresql"):
        return open_journal(url)
    from sagaguard.saga.journals.sql import SqlJournal
    from sagaguard.saga.journals.sql_schema import DEFAULT_PREFIX, journal_models

    require_schema(url, [str(m.__tablename__) for m in journal_models(DEFAULT_PREFIX)], what="sagas")
    return SqlJournal(url, create=False)


def _outbox(url: str, table: str, explicit: bool) -> Any:
    """The outbox's control on ``url`` when its table is there; None otherwise (an ``--outbox`` URL
    given explicitly without the table is an error).

    Raises:
        SchemaMissing: ``explicit`` and no outbox table (or no SQLite file) at ``url``.
    """
    if check_url(url, what="outbox") not in ("sqlite", "postgresql"):
        if explicit:
            raise ConfigurationError("the outbox lives in SQLite or Postgres: --outbox needs such a URL")
        return None
    try:
        require_schema(url, [table], what="outbox", option="--outbox")
    except SchemaMissing:
        if explicit:
            raise
        return None
    from sagaguard.idempotency.outbox.control import OutboxControl
    from sagaguard.idempotency.stores.sql import make_engine

    return OutboxControl(make_engine(url), table)


@click.command()
@store_option
@click.option("--journal", metavar="URL", help="the saga journal (default: the store)")
@click.option("--outbox", metavar="URL", help="the outbox's database (default: the store's, if it has one)")
@click.option("--outbox-table", default=OUTBOX_TABLE, metavar="T", help="the outbox table")
@click.option("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1)")
@click.option("--port", type=int, default=8089, help="the port (default 8089)")
@click.option("--token", help=f"the operators' token (default: ${ENV_TOKEN}, else one made and printed)")
@click.option("--read-only", is_flag=True, help="no token, no actions: the console only shows")
@click.option(
    "--show-payloads", is_flag=True, help="show arguments, results and payloads (they may hold personal data)"
)
@click.option("--trace-url", metavar="TEMPLATE", help="a trace viewer's URL with {trace_id} in it")
@click.option(
    "--refresh", type=int, default=15, metavar="S", help="pages reload every S seconds (15; 0: never)"
)
def ui(
    *,
    store: str | None,
    journal: str | None,
    outbox: str | None,
    outbox_table: str,
    host: str,
    port: int,
    token: str | None,
    read_only: bool,
    show_payloads: bool,
    trace_url: str | None,
    refresh: int,
) -> None:
    """The operator's web console (the ui extra).

    Serve the web console: effects in doubt, sagas that need attention, a saga's timeline, and the
    operator actions (audited). Binds 127.0.0.1 unless told otherwise.
    """
    run(lambda: _serve(
        store_url(store), journal=journal, outbox=outbox, outbox_table=outbox_table, host=host, port=port,
        token=token, read_only=read_only, show_payloads=show_payloads, trace_url=trace_url, refresh=refresh,
    ), failed=(SagaError,))  # fmt: skip


def _serve(
    url: str, *, journal: str | None, outbox: str | None, outbox_table: str, host: str, port: int,
    token: str | None, read_only: bool, show_payloads: bool, trace_url: str | None, refresh: int,
) -> None:  # fmt: skip
    """Run ``sagaguard ui`` until it is stopped."""
    try:
        import uvicorn

        from sagaguard.saga.console.app import create_app
        from sagaguard.saga.console.settings import ConsoleSettings
    except ImportError as exc:
        raise CliError(
            f"the console needs the ui extra ({exc.name}): pip install 'sagaguard[ui]'", EXIT_USAGE
        ) from exc
    token = None if read_only else (token or os.environ.get(ENV_TOKEN) or None)
    made = token is None and not read_only
    if made:
        token = secrets.token_urlsafe(24)
    opened: list[Any] = []
    try:
        settings = ConsoleSettings(
            url, journal_url=journal, token=token, read_only=read_only,
            show_payloads=show_payloads, trace_url=trace_url, refresh=refresh,
        )  # fmt: skip
        store = open_existing_store(url)
        opened.append(store)
        saga_journal = _journal(journal or url)
        opened.append(saga_journal)
        audit = open_audit(url)
        opened.append(audit)
        control = _outbox(outbox or url, outbox_table, outbox is not None)
    except (ConfigurationError, IdempotencyError, SagaError):
        for thing in reversed(opened):
            with contextlib.suppress(Exception):
                thing.close()
        raise
    app = create_app(settings, store=store, journal=saga_journal, audit=audit, outbox=control, close=True)
    click.echo(f"{PROG} ui: {masked(url)} at http://{host}:{port}/")
    if read_only:
        click.echo(f"{PROG} ui: read-only (no actions)")
    elif made:
        click.echo(f"{PROG} ui: log in with the token {token} (or set ${ENV_TOKEN})")
    sys.stdout.flush()
    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"{PROG} ui: warning: listening on {host}, not only this machine", err=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        if control is not None:
            control.db.engine.dispose()
