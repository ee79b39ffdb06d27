"""``sagaguard llm``: what the model-call journal holds, and what replaying it saves.

::

    sagaguard llm savings [--store URL] [--namespace NS] [--prefix llm.] [--json]

Reads the recorded responses of journaled model calls (effects whose name starts with ``--prefix``)
and totals their token usage by effect and model: what a resumed run that replays them does not pay
for, per replay. How often replays actually happened is counted in the running processes, by the
metrics ``sagaguard.llm.calls`` and ``sagaguard.llm.tokens`` with ``sagaguard.llm.source=journal``
(see :mod:`sagaguard.connectors.telemetry`); the store does not count replays.

:func:`add_commands` adds ``llm`` to another CLI's sub-parsers (the ``sagaguard`` command); the
parsed namespace carries ``connector_command``, which :func:`run` dispatches. :func:`main` runs the
commands on their own (``python -m sagaguard.connectors.cli``).

Exit status: 0 done; 1 the store failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from sagaguard.connectors.telemetry import usage_of
from sagaguard.idempotency.cliutil import open_existing_store, piped
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.records import Record, State
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores import DEFAULT_URL

__all__ = ["Savings", "add_commands", "main", "run", "savings"]

PROG = "sagaguard"
ENV_STORE = "SAGAGUARD_STORE"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
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


def add_commands(subparsers: Any) -> None:
    """Add the ``llm`` command (``savings``) to ``subparsers``.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    llm = subparsers.add_parser("llm", help="journaled model calls: what replays save")
    llm.set_defaults(connector_command=None, connector_parser=llm)
    actions = llm.add_subparsers(dest="llm_action", metavar="ACTION")
    show = actions.add_parser(
        "savings",
        help="calls and tokens recorded per effect and model (what a replay does not pay)",
        description="Totals the token usage recorded with each journaled model call. A resumed run "
        "that replays them pays none of it; the metrics sagaguard.llm.calls and sagaguard.llm.tokens "
        "(source=journal) count the replays that happened.",
    )
    show.add_argument("--store", metavar="URL", default=argparse.SUPPRESS,
                      help=f"the effect store (default: ${ENV_STORE}, else {DEFAULT_URL})")  # fmt: skip
    show.add_argument("--namespace", help="only this namespace (tenant)")
    show.add_argument("--prefix", default="llm.", help="effect names of model calls start with this")
    show.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    show.set_defaults(connector_command=_cmd_savings)


def _cmd_savings(store: IdempotencyStore, args: argparse.Namespace, out: TextIO) -> int:
    rows = savings(store, prefix=args.prefix, namespace=args.namespace)
    total = Savings("total", "", sum(r.calls for r in rows), sum(r.input_tokens for r in rows),
                    sum(r.output_tokens for r in rows))  # fmt: skip
    if args.json:
        data = {"rows": [asdict(r) for r in rows], "total": asdict(total)}
        print(json.dumps(data, indent=2), file=out)
        return EXIT_OK
    if not rows:
        print(f"no journaled model calls (effects named {args.prefix}*) in the store", file=out)
        return EXIT_OK
    header = ("effect", "model", "calls", "input tokens", "output tokens")
    lines = [(r.effect, r.model, str(r.calls), str(r.input_tokens), str(r.output_tokens)) for r in rows]
    lines.append(("total", "", str(total.calls), str(total.input_tokens), str(total.output_tokens)))
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    print("Journaled model calls: a replay of each returns its recorded response and pays nothing.", file=out)
    for line in [header, *lines]:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in
                        enumerate(zip(line, widths, strict=True))).rstrip(), file=out)  # fmt: skip
    calls = f"{total.calls} call{'' if total.calls == 1 else 's'}"
    print(f"A full replay saves {calls} and {total.tokens} tokens; replays that happened are "
          "counted by the metric sagaguard.llm.tokens{sagaguard.llm.source=journal}.", file=out)  # fmt: skip
    return EXIT_OK


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the ``llm`` command that ``args`` (parsed with :func:`add_commands`) names."""
    command: Callable[[IdempotencyStore, argparse.Namespace, TextIO], int] | None = getattr(
        args, "connector_command", None
    )
    if command is None:
        parser = getattr(args, "connector_parser", None)
        if parser is not None:
            parser.print_help(sys.stderr)
        return EXIT_USAGE
    store: IdempotencyStore | None = None
    try:
        # A read command: it never creates a SQLite file or a table (a typo must not look fine).
        store = open_existing_store(getattr(args, "store", None) or os.environ.get(ENV_STORE) or DEFAULT_URL)
        return command(store, args, out or sys.stdout)
    except ConfigurationError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except IdempotencyError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if store is not None:
            with contextlib.suppress(IdempotencyError):
                store.close()


def main(argv: list[str] | None = None) -> int:
    """Run ``llm ...`` on its own; returns the exit status."""
    parser = argparse.ArgumentParser(prog=PROG)
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND"))
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return piped(lambda: run(args), gone=EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
