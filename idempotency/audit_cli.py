"""``sagaguard audit``: the operator actions recorded in the ledger, newest first.

::

    sagaguard audit [--target ID] [--prefix P] [--actor NAME] [--action A] [--since SECONDS]
                    [--limit N] [--json] [--store URL]

Read-only: a SQLite file that does not exist is an error naming it; a ledger nobody acted on yet
lists nothing. Exit status: 0 done; 1 the ledger failed or the file does not exist; 2 bad usage.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import click

from sagaguard.idempotency.audit import AuditEntry, AuditFilter, open_audit
from sagaguard.idempotency.cliopts import (
    Positive,
    echo_json,
    json_option,
    rfc3339,
    run,
    store_option,
    store_url,
)
from sagaguard.idempotency.cliutil import (
    SchemaMissing,
    duration,
    open_existing_store,
    sqlite_file,
    table_lines,
)
from sagaguard.idempotency.errors import SchemaVersionMismatch

__all__ = ["audit", "entry_json", "rfc3339"]


def entry_json(entry: AuditEntry) -> dict[str, Any]:
    """An entry as JSON types, its time ``at`` as RFC 3339 text (``time``: the same, as before)."""
    at = rfc3339(entry.at)
    return {**entry.to_json(), "at": at, "time": at}


def _table(entries: Sequence[AuditEntry], now: float) -> None:
    header = ("TIME", "AGE", "ACTOR", "SOURCE", "ACTION", "TARGET", "OUTCOME", "ARGS")
    rows = [
        (
            rfc3339(e.at)[:19] + "Z",
            duration(max(0.0, now - e.at)),
            e.actor,
            e.source,
            e.action,
            e.target if len(e.target) <= 36 else e.target[:33] + "...",
            e.outcome.value + (f" ({e.error})" if e.error else ""),
            json.dumps(dict(e.args), separators=(",", ":")),
        )
        for e in entries
    ]
    for line in table_lines(header, rows):
        click.echo(line)


@click.command()
@click.option("--target", metavar="ID", help="only actions on this effect key, saga id or message id")
@click.option("--prefix", metavar="P", help="only actions on targets starting with P")
@click.option("--actor", metavar="NAME", help="only actions by NAME")
@click.option("--action", metavar="A", help="only this action (saga.cancel) or layer (saga.: a trailing dot)")
@click.option(
    "--since", type=Positive(float), metavar="SECONDS", help="only the last SECONDS (by the ledger's clock)"
)
@click.option("--limit", type=Positive(int), default=100, metavar="N", help="at most N (100)")
@json_option
@store_option
def audit(
    *,
    target: str | None,
    prefix: str | None,
    actor: str | None,
    action: str | None,
    since: float | None,
    limit: int,
    as_json: bool,
    store: str | None,
) -> None:
    """Who resolved, retried, cancelled what: the audit trail, newest first.

    The operator actions recorded in the ledger (from the CLI, the console and the Python API):
    when, who, what, on which target, and whether it was done or refused.
    """

    def body() -> None:
        url = store_url(store)
        file = sqlite_file(url)
        if file is not None and not file.exists():
            raise SchemaMissing(f"no SQLite database at {file} (the file does not exist): check --store")
        try:
            opened = open_existing_store(url)  # the ledger's clock
        except SchemaMissing:  # a database with the outbox alone: this machine's clock
            now = time.time()
        else:
            try:
                now = opened.now()
            finally:
                opened.close()
        try:
            log = open_audit(url, create=False)
        except SchemaVersionMismatch as exc:
            if exc.state != "empty":
                raise  # older or newer tables: the error names `sagaguard db upgrade`
            log = None  # nobody has acted on this ledger yet: its audit table is made on first use
        entries: Sequence[AuditEntry] = []
        if log is not None:
            try:
                where = AuditFilter(
                    target=target,
                    target_prefix=prefix,
                    actor=actor,
                    action=action,
                    since=None if since is None else now - since,
                )
                entries = log.list(where, limit=limit)
            finally:
                log.close()
        if as_json:
            echo_json([entry_json(e) for e in entries])
        elif not entries:
            filtered = any(v is not None for v in (target, prefix, actor, action, since))
            click.echo("no audit entries" + (" matching" if filtered else ""))
        else:
            _table(entries, now)

    run(body)
