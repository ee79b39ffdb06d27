"""``sagaguard audit``: the operator actions recorded in the ledger, newest first.

::

    sagaguard audit [--target ID] [--prefix P] [--actor NAME] [--action A] [--since SECONDS]
                    [--limit N] [--json]

Read-only: a SQLite file that does not exist is an error naming it; a ledger nobody acted on yet
lists nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Sequence
from typing import Any, TextIO

from sagaguard.idempotency.audit import AuditEntry, AuditFilter, open_audit
from sagaguard.idempotency.cliutil import SchemaMissing, duration, open_existing_store, positive, sqlite_file

__all__ = ["add_audit_command", "cmd_audit", "entry_json", "rfc3339"]


def rfc3339(at: float) -> str:
    """``at`` (seconds since the epoch) as an RFC 3339 UTC time."""
    return datetime.datetime.fromtimestamp(at, tz=datetime.UTC).isoformat().replace("+00:00", "Z")


def entry_json(entry: AuditEntry) -> dict[str, Any]:
    """An entry as JSON types, with its time as RFC 3339 text beside the epoch seconds."""
    return {**entry.to_json(), "time": rfc3339(entry.at)}


def add_audit_command(commands: Any, store_option: argparse.ArgumentParser) -> None:
    """Add ``audit`` to the ``sagaguard`` sub-parsers.

    Args:
        commands: what ``ArgumentParser.add_subparsers()`` returned.
        store_option: the parent parser that carries ``--store``.
    """
    audit = commands.add_parser(
        "audit",
        parents=[store_option],
        help="who resolved, retried, cancelled what: the audit trail, newest first",
        description="List the operator actions recorded in the ledger (from the CLI, the console and "
        "the Python API): when, who, what, on which target, and whether it was done or refused.",
    )
    audit.add_argument(
        "--target", metavar="ID", help="only actions on this effect key, saga id or message id"
    )
    audit.add_argument("--prefix", metavar="P", help="only actions on targets starting with P")
    audit.add_argument("--actor", metavar="NAME", help="only actions by NAME")
    audit.add_argument(
        "--action", metavar="A", help="only this action (saga.cancel) or layer (saga.: a trailing dot)"
    )
    audit.add_argument(
        "--since",
        type=positive(float),
        metavar="SECONDS",
        help="only the last SECONDS (by the ledger's clock)",
    )
    audit.add_argument("--limit", type=positive(int), default=100, metavar="N", help="at most N (100)")
    audit.add_argument("--json", action="store_true", help="the entries as a JSON array")


def _table(entries: Sequence[AuditEntry], now: float, out: TextIO) -> None:
    header = ("TIME", "AGE", "ACTOR", "SOURCE", "ACTION", "TARGET", "OUTCOME", "ARGS")
    rows = [
        (
            rfc3339(e.at)[:19] + "Z", duration(max(0.0, now - e.at)), e.actor, e.source, e.action,
            e.target if len(e.target) <= 36 else e.target[:33] + "...",
            e.outcome.value + (f" ({e.error})" if e.error else ""),
            json.dumps(dict(e.args), separators=(",", ":")),
        )
        for e in entries
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)


def cmd_audit(url: str, args: argparse.Namespace, out: TextIO) -> int:
    """``sagaguard audit``: list the entries ``args`` filters; returns the exit status.

    Raises:
        SchemaMissing: the SQLite file does not exist.
        StoreError: the ledger failed.
    """
    file = sqlite_file(url)
    if file is not None and not file.exists():
        raise SchemaMissing(f"no SQLite database at {file} (the file does not exist): check --store")
    try:
        store = open_existing_store(url)  # the ledger's clock
    except SchemaMissing:  # a database with the outbox alone: this machine's clock
        now = time.time()
    else:
        try:
            now = store.now()
        finally:
            store.close()
    log = open_audit(url, create=False)
    try:
        where = AuditFilter(
            target=args.target, target_prefix=args.prefix, actor=args.actor, action=args.action,
            since=None if args.since is None else now - args.since,
        )  # fmt: skip
        entries = log.list(where, limit=args.limit)
    finally:
        log.close()
    if args.json:
        json.dump([entry_json(e) for e in entries], out, indent=2, ensure_ascii=False)
        print(file=out)
    elif not entries:
        filtered = any(getattr(args, k) is not None for k in ("target", "prefix", "actor", "action", "since"))
        print("no audit entries" + (" matching" if filtered else ""), file=out)
    else:
        _table(entries, now, out)
    return 0
