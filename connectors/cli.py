"""``sagaguard llm``: what the model-call journal holds, and what replaying it saves.

::

    sagaguard llm savings [--store URL] [--namespace NS] [--prefix llm.] [--json]

Reads the recorded responses of journaled model calls (effects whose name starts with ``--prefix``)
and totals their token usage by effect and model: what a resumed run that replays them does not pay
for, per replay. How often replays actually happened is counted in the running processes, by the
metrics ``sagaguard.llm.calls`` and ``sagaguard.llm.tokens`` with ``sagaguard.llm.source=journal``
(see :mod:`sagaguard.connectors.telemetry`); the store does not count replays.

The click group :data:`llm` is registered under the entry-point group ``sagaguard.commands``, where
the ``sagaguard`` root finds it; :func:`main` runs the command line (``python -m sagaguard.connectors.cli``).

Exit status: 0 done; 1 the store failed; 2 bad usage.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import click

from sagaguard.connectors.telemetry import usage_of
from sagaguard.idempotency.cliopts import echo_json, json_option, run, store_option, store_url
from sagaguard.idempotency.cliutil import open_existing_store
from sagaguard.idempotency.errors import IdempotencyError
from sagaguard.idempotency.records import Record, State
from sagaguard.idempotency.store import IdempotencyStore

__all__ = ["Savings", "llm", "main", "savings"]

_PAGE = 500


@dataclass
class Savings:
    """The journaled calls of one effect and model, and their recorded token usage."""

    effect: str
    model: str
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def _records(store: IdempotencyStore, namespace: str | None) -> Iterator[Record]:
    after: str | None = None
    while True:
        page = store.list(states=[State.SUCCEEDED], namespace=namespace, limit=_PAGE, after=after)
        yield from page
        if len(page) < _PAGE:
            return
        after = page[-1].key


def savings(store: IdempotencyStore, *, prefix: str = "llm.", namespace: str | None = None) -> list[Savings]:
    """Totals per (effect, model) of the succeeded model calls in ``store``, largest first."""
    rows: dict[tuple[str, str], Savings] = {}
    for record in _records(store, namespace):
        if not record.name.startswith(prefix):
            continue
        try:
            result: Any = json.loads(record.result or "null")
        except ValueError:
            result = None
        model = str(result.get("model", "")) if isinstance(result, dict) else ""
        row = rows.setdefault((record.name, model), Savings(record.name, model or "-"))
        tokens_in, tokens_out = usage_of(result) if isinstance(result, dict) else (0, 0)
        row.calls += 1
        row.input_tokens += tokens_in
        row.output_tokens += tokens_out
    return sorted(rows.values(), key=lambda r: (-r.tokens, r.effect, r.model))


@click.group(no_args_is_help=True)
def llm() -> None:
    """Journaled model calls: what replays save."""


@llm.command("savings")
@click.option("--namespace", help="only this namespace (tenant)")
@click.option("--prefix", default="llm.", help="effect names of model calls start with this")
@json_option
@store_option
def savings_command(*, namespace: str | None, prefix: str, as_json: bool, store: str | None) -> None:
    """Calls and tokens recorded per effect and model (what a replay does not pay).

    Totals the token usage recorded with each journaled model call. A resumed run that replays them
    pays none of it; the metrics sagaguard.llm.calls and sagaguard.llm.tokens (source=journal) count
    the replays that happened.
    """

    def body() -> None:
        # A read command: it never creates a SQLite file or a table (a typo must not look fine).
        opened = open_existing_store(store_url(store))
        try:
            rows = savings(opened, prefix=prefix, namespace=namespace)
        finally:
            with contextlib.suppress(IdempotencyError):
                opened.close()
        _print(rows, prefix, as_json)

    run(body)


def _print(rows: list[Savings], prefix: str, as_json: bool) -> None:
    total = Savings("total", "", sum(r.calls for r in rows), sum(r.input_tokens for r in rows),
                    sum(r.output_tokens for r in rows))  # fmt: skip
    if as_json:
        echo_json({"rows": [asdict(r) for r in rows], "total": asdict(total)})
        return
    if not rows:
        click.echo(f"no journaled model calls (effects named {prefix}*) in the store")
        return
    header = ("effect", "model", "calls", "input tokens", "output tokens")
    lines = [(r.effect, r.model, str(r.calls), str(r.input_tokens), str(r.output_tokens)) for r in rows]
    lines.append(("total", "", str(total.calls), str(total.input_tokens), str(total.output_tokens)))
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    click.echo("Journaled model calls: a replay of each returns its recorded response and pays nothing.")
    for line in [header, *lines]:
        click.echo("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in
                             enumerate(zip(line, widths, strict=True))).rstrip())  # fmt: skip
    calls = f"{total.calls} call{'' if total.calls == 1 else 's'}"
    click.echo(f"A full replay saves {calls} and {total.tokens} tokens; replays that happened are "
               "counted by the metric sagaguard.llm.tokens{sagaguard.llm.source=journal}.")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the ``sagaguard`` command line (``llm ...`` and the rest); returns the exit status."""
    from sagaguard.idempotency.cli import main as root

    return root(argv)


if __name__ == "__main__":
    sys.exit(main())
