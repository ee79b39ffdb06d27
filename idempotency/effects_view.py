"""How ``sagaguard effects`` shows records: the table, one record in full, and as JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import click

from sagaguard.idempotency.cliopts import PROG, rfc3339
from sagaguard.idempotency.cliutil import duration, pretty_json, table_lines
from sagaguard.idempotency.keys import provider_key
from sagaguard.idempotency.records import Record, State

__all__ = ["SHORT_KEY", "record_json", "show_record", "table"]

SHORT_KEY = 16
"""The characters of a key the table prints."""
_LIVE = (State.IN_DOUBT, State.IN_PROGRESS)


def _lease_left(record: Record, now: float) -> str:
    if record.state not in _LIVE or record.lease_until <= 0:
        return "-"
    if record.lease_live(now):
        return duration(record.lease_until - now)
    return "expired"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _nested(text: str | None) -> Any:
    """The JSON text a record holds as a nested value (text that is not JSON stays text)."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def record_json(record: Record) -> dict[str, Any]:
    """A record as JSON types: times as RFC 3339 text (None for no lease or no expiry), ``result``
    and ``error`` as nested values."""
    data = dataclasses.asdict(record)
    data["state"] = record.state.value
    for name in ("created_at", "updated_at"):
        data[name] = rfc3339(data[name])
    data["lease_until"] = rfc3339(record.lease_until) if record.lease_until > 0 else None
    data["expires_at"] = None if record.expires_at is None else rfc3339(record.expires_at)
    data["result"], data["error"] = _nested(record.result), _nested(record.error)
    return data


def table(records: Sequence[Record], now: float) -> None:
    """Print ``records`` as the listing's table."""
    header = ("KEY", "NAME", "SCOPE", "ORD", "STATE", "TOKEN", "ATT", "AGE", "LEASE LEFT")
    rows = [
        (
            record.key[:SHORT_KEY],
            _clip(record.name, 32),
            _clip(record.scope, 28),
            str(record.ordinal),
            record.state.value,
            str(record.token),
            str(record.attempts),
            duration(now - record.created_at),
            _lease_left(record, now),
        )
        for record in records
    ]
    for line in table_lines(header, rows):
        click.echo(line)


def show_record(record: Record, now: float, ledger: str) -> None:
    """Print one record in full, with what to run when it needs an operator; ``ledger`` is the
    store's ledger id, part of the provider key."""
    fields: list[tuple[str, str]] = [
        ("key", record.key),
        ("namespace", record.namespace),
        ("scope", record.scope),
        ("name", record.name),
        ("ordinal", str(record.ordinal)),
        ("fingerprint", f"{record.fingerprint} (the arguments' digest)"),
        ("provider key", f"{provider_key(record.key, ledger)} (the key sent to the provider or server)"),
        ("state", record.state.value),
        ("token", str(record.token)),
        ("attempts", str(record.attempts)),
        ("created", f"{duration(now - record.created_at)} ago"),
        ("updated", f"{duration(now - record.updated_at)} ago"),
        ("lease left", _lease_left(record, now)),
        (
            "expires",
            "-"
            if record.expires_at is None
            else (f"in {duration(record.expires_at - now)}" if record.expires_at > now else "expired"),
        ),
    ]
    if record.result_type is not None:  # what `resolve --applied --result` must decode as
        fields.insert(4, ("result type", f"{record.result_type} (what --result is checked against)"))
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        click.echo(f"{name.ljust(width)}  {value}")
    for name, text in (("result", record.result), ("error", record.error)):
        if text is not None:
            click.echo(f"{name}:")
            for line in pretty_json(text).splitlines():
                click.echo(f"  {line}")
    if record.state is State.IN_DOUBT or (record.state is State.IN_PROGRESS and not record.lease_live(now)):
        click.echo(
            f"\nthis effect may or may not have happened: check the outside world, then run\n"
            f"  {PROG} effects resolve {record.key[:SHORT_KEY]} --applied --result JSON\n"
            f"  {PROG} effects resolve {record.key[:SHORT_KEY]} --not-applied",
        )
