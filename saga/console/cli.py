"""``sagaguard ui``: start the operator's web console.

::

    sagaguard ui [--store URL] [--journal URL] [--outbox URL] [--host 127.0.0.1] [--port 8089]
                 [--token TOKEN] [--read-only] [--show-payloads] [--trace-url TEMPLATE]

Safe by default: it binds 127.0.0.1, and nobody acts without the token. The token is ``--token``,
else ``$SAGAGUARD_UI_TOKEN``, else one made at start and printed once; ``--read-only`` takes none
and refuses every action. Arguments, results and payloads are shown only with ``--show-payloads``.

:func:`add_commands` adds ``ui`` to the ``sagaguard`` parser (entry-point group
``sagaguard.commands``); Starlette and uvicorn are imported only when it runs, so the command is
listed without the ``ui`` extra and says how to install it.

Exit status: 0 stopped; 1 the store failed; 2 bad usage, or the ``ui`` extra is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
from typing import Any

from sagaguard.idempotency.audit import open_audit
from sagaguard.idempotency.backends.urls import check_url, masked
from sagaguard.idempotency.cliutil import SchemaMissing, open_existing_store, require_schema
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.outbox.model import DEFAULT_TABLE as OUTBOX_TABLE
from sagaguard.idempotency.stores import DEFAULT_URL
from sagaguard.saga.errors import SagaError
from sagaguard.saga.journal import SagaJournal

__all__ = ["ENV_TOKEN", "add_commands", "run"]

PROG = "sagaguard"
ENV_STORE = "SAGAGUARD_STORE"
ENV_TOKEN = "SAGAGUARD_UI_TOKEN"
"""The environment variable holding the console's token when ``--token`` is not given."""
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_commands(subparsers: Any) -> None:
    """Add ``ui`` to ``subparsers``.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    ui = subparsers.add_parser(
        "ui",
        help="the operator's web console (the ui extra)",
        description="Serve the web console: effects in doubt, sagas that need attention, a saga's "
        "timeline, and the operator actions (audited). Binds 127.0.0.1 unless told otherwise.",
    )
    ui.add_argument("--store", metavar="URL", default=argparse.SUPPRESS,
                    help=f"the ledger (default: ${ENV_STORE}, else {DEFAULT_URL})")  # fmt: skip
    ui.add_argument("--journal", metavar="URL", help="the saga journal (default: the store)")
    ui.add_argument(
        "--outbox", metavar="URL", help="the outbox's database (default: the store's, if it has one)"
    )
    ui.add_argument("--outbox-table", default=OUTBOX_TABLE, metavar="T", help="the outbox table")
    ui.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1)")
    ui.add_argument("--port", type=int, default=8089, help="the port (default 8089)")
    ui.add_argument(
        "--token", help=f"the operators' token (default: ${ENV_TOKEN}, else one made and printed)"
    )
    ui.add_argument("--read-only", action="store_true", help="no token, no actions: the console only shows")
    ui.add_argument("--show-payloads", action="store_true",
                    help="show arguments, results and payloads (they may hold personal data)")  # fmt: skip
    ui.add_argument("--trace-url", metavar="TEMPLATE",
                    help="a trace viewer's URL with {trace_id} in it")  # fmt: skip
    ui.add_argument(
        "--refresh", type=int, default=15, metavar="S", help="pages reload every S seconds (15; 0: never)"
    )


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


def run(args: argparse.Namespace) -> int:
    """Run ``sagaguard ui`` as ``args`` says; returns the exit status."""
    try:
        import uvicorn

        from sagaguard.saga.console.app import create_app
        from sagaguard.saga.console.settings import ConsoleSettings
    except ImportError as exc:
        print(
            f"{PROG}: the console needs the ui extra ({exc.name}): pip install 'sagaguard[ui]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    url = str(getattr(args, "store", None) or os.environ.get(ENV_STORE) or DEFAULT_URL)
    token = None if args.read_only else (args.token or os.environ.get(ENV_TOKEN) or None)
    made = token is None and not args.read_only
    if made:
        token = secrets.token_urlsafe(24)
    opened: list[Any] = []
    try:
        settings = ConsoleSettings(
            url, journal_url=args.journal, token=token, read_only=args.read_only,
            show_payloads=args.show_payloads, trace_url=args.trace_url, refresh=args.refresh,
        )  # fmt: skip
        store = open_existing_store(url)
        opened.append(store)
        journal = _journal(args.journal or url)
        opened.append(journal)
        audit = open_audit(url)
        opened.append(audit)
        outbox = _outbox(args.outbox or url, args.outbox_table, args.outbox is not None)
    except (ConfigurationError, IdempotencyError, SagaError) as exc:
        for thing in reversed(opened):
            with contextlib.suppress(Exception):
                thing.close()
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigurationError) else EXIT_FAILED
    app = create_app(settings, store=store, journal=journal, audit=audit, outbox=outbox, close=True)
    print(f"{PROG} ui: {masked(url)} at http://{args.host}:{args.port}/", flush=True)
    if args.read_only:
        print(f"{PROG} ui: read-only (no actions)", flush=True)
    elif made:
        print(f"{PROG} ui: log in with the token {token} (or set ${ENV_TOKEN})", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"{PROG} ui: warning: listening on {args.host}, not only this machine", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        if outbox is not None:
            outbox.db.engine.dispose()
    return EXIT_OK
