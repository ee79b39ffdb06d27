"""``sagaguard``: the operator's command line.

::

    sagaguard [--store URL] effects list [--state STATE ...] [--namespace NS] [--limit N] [--json]
    sagaguard [--store URL] effects show KEY [--json]
    sagaguard [--store URL] effects resolve KEY (--applied --result JSON | --not-applied) [--force]
    sagaguard [--store URL] effects purge [--page N]
    sagaguard demo [ARGS ...]

The store is ``--store``, else ``$SAGAGUARD_STORE``, else ``sqlite:///sagaguard.db``. A KEY may be
given in full or as any unique prefix (the table prints 16 characters).

Exit status: 0 done; 1 the store refused or failed (no such record, lost ownership, store
unreachable); 2 bad usage or configuration (unknown URL scheme, ``--applied`` without ``--result``,
bad ``--result`` JSON or a result of another shape than the effect's). Expected
errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import Any, TextIO

from sagaguard.idempotency.audit import default_actor, open_audit
from sagaguard.idempotency.audit_cli import add_audit_command, cmd_audit
from sagaguard.idempotency.backends.urls import masked
from sagaguard.idempotency.cliutil import duration, install_hint, open_existing_store, piped, positive
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.keys import provider_key
from sagaguard.idempotency.operator import AmbiguousKey, EffectBusy, find_effect, resolve_effect, result_json
from sagaguard.idempotency.records import Record, State
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores import DEFAULT_URL

__all__ = ["main"]

PROG = "sagaguard"
ENV_STORE = "SAGAGUARD_STORE"
"""Environment variable naming the store when ``--store`` is not given."""

DAY = 86_400.0
ORDER = (State.IN_DOUBT, State.IN_PROGRESS, State.FAILED, State.SUCCEEDED)
"""The listing order: what needs an operator first."""
_LIVE = (State.IN_DOUBT, State.IN_PROGRESS)
_SHORT_KEY = 16
_PAGE = 500

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """An expected failure of a command: printed as one line, exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------------- parsing


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    return _build(_plugins())[0]


PLUGIN_GROUP = "sagaguard.commands"
"""Entry-point group of modules that add commands (``sagaguard.saga.cli``, ``sagaguard.connectors.cli``, the
outbox's).

Each such module has ``add_commands(subparsers)`` and ``run(args) -> int``. They are found through
the installed distribution's entry points, so this package never imports the packages above it
(imports flow connectors -> saga -> idempotency)."""


RESULT_SHAPES = "RESULT_SHAPES"
"""The attribute of a command module (:data:`PLUGIN_GROUP`) that declares the result shapes of
its connector's effects: a mapping of an effect-name prefix (``"mcp."``) to a check that raises
``ValueError`` (saying what is expected) for a ``--result`` value of another shape."""


def _result_check(name: str) -> Any:
    """The check of ``effects resolve --result`` for the effect ``name``, or None."""
    for plugin in _plugins():
        for prefix, check in (getattr(plugin, RESULT_SHAPES, None) or {}).items():
            if name.startswith(prefix):
                return check
    return None


def _plugins() -> list[Any]:
    """The command modules registered under :data:`PLUGIN_GROUP` that import here."""
    found = []
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        try:
            found.append(entry.load())
        except ImportError:  # an optional extra is not installed: its commands are absent
            continue
    return found


def _build(
    plugins: Sequence[Any] = (),
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, dict[str, Any]]:
    """The parser, its ``effects`` sub-parser, and which plugin owns each other command."""
    # --store is accepted before the command and after it; SUPPRESS keeps the later one from
    # overwriting the earlier one with a default.
    store_option = argparse.ArgumentParser(add_help=False)
    store_option.add_argument(
        "--store",
        metavar="URL",
        default=argparse.SUPPRESS,
        help=f"the effect store (default: ${ENV_STORE}, else {DEFAULT_URL})",
    )

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Operate sagaguard's effect ledger: list, inspect, resolve and purge effects.",
        parents=[store_option],
        epilog="Exit status: 0 done, 1 the store refused or failed, 2 bad usage or configuration.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    effects = commands.add_parser("effects", help="list, show, resolve and purge effect records")
    actions = effects.add_subparsers(dest="action", metavar="ACTION")

    listing = actions.add_parser(
        "list",
        parents=[store_option],
        help="list records, in-doubt first",
        description="List records: in-doubt first, then in-progress, failed, succeeded. In-doubt and "
        "in-progress records are listed oldest first; finished ones by key.",
    )
    listing.add_argument(
        "--state",
        dest="states",
        action="extend",
        nargs="+",
        choices=[s.value for s in ORDER],
        metavar="STATE",
        help="only these states (in_doubt, in_progress, succeeded, failed); repeatable",
    )
    listing.add_argument("--namespace", metavar="NS", help="only this namespace (tenant)")
    listing.add_argument(
        "--limit", type=positive(int), default=100, metavar="N", help="at most N records (default 100)"
    )
    listing.add_argument("--json", action="store_true", help="full records as a JSON array")

    show = actions.add_parser("show", parents=[store_option], help="one record in full")
    show.add_argument("key", metavar="KEY", help="the effect key or a unique prefix of it")
    show.add_argument("--json", action="store_true", help="the record as a JSON object")

    resolve = actions.add_parser(
        "resolve",
        parents=[store_option],
        help="settle an in-doubt effect by hand",
        description="Settle an IN_DOUBT record (or an IN_PROGRESS one whose lease ran out) after "
        "checking the outside world. --applied records it as SUCCEEDED with --result, which every "
        "later run replays; --not-applied removes it, so the next run executes the effect.",
    )
    resolve.add_argument("key", metavar="KEY", help="the effect key or a unique prefix of it")
    verdict = resolve.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--applied", action="store_true", help="the effect happened")
    verdict.add_argument("--not-applied", action="store_true", help="the effect did not happen")
    resolve.add_argument(
        "--result",
        metavar="JSON",
        help="with --applied (required): the effect's result as JSON, as its return type stores it "
        "(null for an effect that returns nothing); checked against the effect's shape where its "
        "connector declares one",
    )
    resolve.add_argument(
        "--retention",
        type=positive(float),
        default=7 * DAY,
        metavar="SECONDS",
        help="with --applied: how long the result is kept and replayed (default: 7 days)",
    )
    resolve.add_argument(
        "--force", action="store_true", help="resolve even though a worker's lease is still live"
    )
    resolve.add_argument(
        "--actor", metavar="NAME", help="who resolves it, as the audit trail records (default: the OS user)"
    )

    purge = actions.add_parser(
        "purge",
        parents=[store_option],
        help="delete finished records past their retention, in pages",
        description="Delete SUCCEEDED and FAILED records whose retention has passed, page by page. "
        "IN_PROGRESS and IN_DOUBT records are never deleted.",
    )
    purge.add_argument(
        "--page", type=positive(int), default=1000, metavar="N", help="records per page (default 1000)"
    )

    add_audit_command(commands, store_option)

    commands.add_parser(
        "demo",
        add_help=False,
        help="run the demo (arguments go to the demo; try: sagaguard demo --help)",
    )
    owners: dict[str, Any] = {}
    for plugin in plugins:
        before = set(commands.choices)
        plugin.add_commands(commands)
        owners.update(dict.fromkeys(set(commands.choices) - before, plugin))
    return parser, effects, owners


def _split_demo(argv: Sequence[str]) -> list[str] | None:
    """The demo's own arguments when the command is ``demo``, else None.

    The demo parses its arguments itself, so everything after ``demo`` is handed over untouched; a
    ``--store`` given before ``demo`` is passed on as the demo's ``--store``.
    """
    store: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--store" and i + 1 < len(argv):
            store = ["--store", argv[i + 1]]
            i += 2
        elif arg.startswith("--store="):
            store = ["--store", arg.split("=", 1)[1]]
            i += 1
        elif arg == "demo":
            rest = list(argv[i + 1 :])
            has_store = any(a == "--store" or a.startswith("--store=") for a in rest)
            return rest if has_store or not store else [*store, *rest]
        else:
            return None
    return None


# ------------------------------------------------------------------------------------ output


def _lease_left(record: Record, now: float) -> str:
    if record.state not in _LIVE or record.lease_until <= 0:
        return "-"
    if record.lease_live(now):
        return duration(record.lease_until - now)
    return "expired"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def record_json(record: Record) -> dict[str, Any]:
    """A record as plain JSON types (``result`` and ``error`` stay the JSON text the store holds)."""
    data = dataclasses.asdict(record)
    data["state"] = record.state.value
    return data


def _table(records: Sequence[Record], now: float, out: TextIO) -> None:
    header = ("KEY", "NAME", "SCOPE", "ORD", "STATE", "TOKEN", "ATT", "AGE", "LEASE LEFT")
    rows = [
        (
            record.key[:_SHORT_KEY],
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
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(), file=out
        )


def _pretty_json_text(text: str | None) -> str:
    if text is None:
        return "-"
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def _show(record: Record, now: float, out: TextIO, ledger: str) -> None:
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
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        print(f"{name.ljust(width)}  {value}", file=out)
    for name, text in (("result", record.result), ("error", record.error)):
        if text is not None:
            print(f"{name}:", file=out)
            for line in _pretty_json_text(text).splitlines():
                print(f"  {line}", file=out)
    if record.state is State.IN_DOUBT or (record.state is State.IN_PROGRESS and not record.lease_live(now)):
        print(
            f"\nthis effect may or may not have happened: check the outside world, then run\n"
            f"  {PROG} effects resolve {record.key[:_SHORT_KEY]} --applied --result JSON\n"
            f"  {PROG} effects resolve {record.key[:_SHORT_KEY]} --not-applied",
            file=out,
        )


# ---------------------------------------------------------------------------------- commands


def _open(url: str) -> IdempotencyStore:
    """Open the store without creating anything: no SQLite file, no table (a typo would list nothing).

    Raises:
        SchemaMissing: the SQLite file or the effects table does not exist (the URL named, password
            masked).
        CliError: the backend's driver is not installed.
    """
    try:
        return open_existing_store(url)
    except ModuleNotFoundError as exc:
        hint = install_hint(exc)
        raise CliError(f"the store {masked(url)!r} needs the {exc.name!r} package{hint}", EXIT_USAGE) from exc


def _find(store: IdempotencyStore, key: str) -> Record:
    """The record under ``key``, or the one record whose key starts with it."""
    try:
        return find_effect(store, key)
    except AmbiguousKey as exc:
        raise CliError(str(exc)) from None


def _collect(
    store: IdempotencyStore, states: Sequence[State], namespace: str | None, limit: int
) -> list[Record]:
    chosen: list[Record] = []
    for state in ORDER:
        if state not in states or len(chosen) >= limit:
            continue
        found: list[Record] = []
        after: str | None = None
        # Live records are few and the oldest matters most: read them all and sort by age.
        # Finished ones can be millions: read only what the limit lets through, in key order.
        want = None if state in _LIVE else limit - len(chosen)
        while want is None or len(found) < want:
            page = store.list(states=[state], namespace=namespace, limit=_PAGE, after=after)
            found.extend(page)
            if len(page) < _PAGE:
                break
            after = page[-1].key
        if state in _LIVE:
            found.sort(key=lambda r: (r.created_at, r.key))
        chosen.extend(found[: limit - len(chosen)])
    return chosen


def cmd_list(store: IdempotencyStore, args: argparse.Namespace, out: TextIO) -> int:
    states = [State(s) for s in args.states] if args.states else list(ORDER)
    records = _collect(store, states, args.namespace, args.limit)
    if args.json:
        json.dump([record_json(r) for r in records], out, indent=2, ensure_ascii=False)
        print(file=out)
        return EXIT_OK
    if not records:
        print("no effect records" + (" in these states" if args.states else ""), file=out)
        return EXIT_OK
    _table(records, store.now(), out)
    if len(records) >= args.limit:
        print(f"(first {args.limit}; raise --limit for more)", file=out)
    return EXIT_OK


def cmd_show(store: IdempotencyStore, args: argparse.Namespace, out: TextIO) -> int:
    record = _find(store, args.key)
    if args.json:
        json.dump(record_json(record), out, indent=2, ensure_ascii=False)
        print(file=out)
    else:
        _show(record, store.now(), out, store.ledger_id())
    return EXIT_OK


def _result_text(text: str | None) -> str:
    """Validate ``--result`` and return it as compact JSON."""
    if text is None:
        raise CliError(
            "--applied needs --result JSON: the effect's result as later runs replay it "
            "(--result null for an effect that returns nothing)",
            EXIT_USAGE,
        )

    try:
        return result_json(text)
    except ConfigurationError as exc:
        raise CliError(f"--result is not valid JSON: {str(exc).split(': ', 1)[-1]}", EXIT_USAGE) from None


def cmd_resolve(store: IdempotencyStore, args: argparse.Namespace, out: TextIO) -> int:
    if args.result is not None and not args.applied:
        raise CliError("--result goes with --applied", EXIT_USAGE)
    result = _result_text(args.result) if args.applied else None
    record = _find(store, args.key)
    short = record.key[:_SHORT_KEY]
    check = None if result is None else _result_check(record.name)
    if check is not None:
        try:
            check(json.loads(result or "null"))
        except ValueError as exc:
            raise CliError(
                f"--result is not the shape effect {record.name!r} records: {exc}", EXIT_USAGE
            ) from None
    audit = open_audit(_url(args))
    try:
        resolve_effect(
            store, record.key, applied=result is not None, result=result, retention=args.retention,
            force=args.force, token=record.token, actor=args.actor or default_actor(), audit=audit,
            source="cli",
        )  # fmt: skip
    except EffectBusy as exc:
        raise CliError(f"{exc} (--force)") from exc
    finally:
        audit.close()
    if result is not None:
        print(
            f"resolved {record.name!r} ({short}) as applied: later runs replay the recorded result", file=out
        )
    else:
        print(
            f"resolved {record.name!r} ({short}) as not applied: the record is removed and the "
            "next run executes the effect",
            file=out,
        )
    return EXIT_OK


def cmd_purge(store: IdempotencyStore, args: argparse.Namespace, out: TextIO) -> int:
    total = 0
    pages = 0
    while True:
        deleted = store.purge(limit=args.page)
        total += deleted
        pages += 1
        if deleted:
            print(f"page {pages}: purged {deleted} (total {total})", file=out, flush=True)
        if deleted < args.page:
            break
    print(f"purged {total} expired record{'' if total == 1 else 's'}", file=out)
    return EXIT_OK


_EFFECT_COMMANDS = {"list": cmd_list, "show": cmd_show, "resolve": cmd_resolve, "purge": cmd_purge}


def _version() -> str:
    """The installed distribution's version (pyproject.toml is its one source)."""
    try:
        return version("sagaguard")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


DEMO_GROUP = "sagaguard.demo"
"""Entry-point group of the demos (``sagaguard.connectors.demo``: the trip-booking saga, and
``sagaguard.connectors.demo.small``), found without importing the packages above this one."""

SMALL_DEMO = "small"
"""The entry point of the small demo (a guarded charge, a SIGKILL, a restart), which needs no extra."""


def _run_demo(args: list[str]) -> int:
    """``sagaguard demo``: the trip-booking demo when installed, else the small demo.

    ``sagaguard demo --small`` (or a ``--store``, which only the small demo takes) runs the small
    one: a guarded charge, a SIGKILL, a restart.
    """
    small = "--small" in args or any(a == "--store" or a.startswith("--store=") for a in args)
    args = [a for a in args if a != "--small"]
    demos = {entry.name: entry for entry in entry_points(group=DEMO_GROUP)}
    if not small:
        for name in sorted(set(demos) - {SMALL_DEMO}):
            try:
                full = demos[name].load()
            except ImportError:  # its extras are not installed: fall back to the small demo
                continue
            return int(full(args) or 0)
    if SMALL_DEMO not in demos:
        print(f"{PROG}: the demo is not part of this installation", file=sys.stderr)
        return EXIT_FAILED
    return int(demos[SMALL_DEMO].load()(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status.

    Args:
        argv: the arguments without the program name (default: ``sys.argv[1:]``).
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    demo_args = _split_demo(args_list)
    if demo_args is not None:
        return _run_demo(demo_args)

    parser, effects, owners = _build(_plugins())
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse exits on --help (0) and on usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command in owners:
        owner = owners[args.command]
        return piped(lambda: int(owner.run(args)), gone=EXIT_FAILED)
    if args.command == "audit":
        return piped(lambda: _audit(args), gone=EXIT_FAILED)
    if args.command != "effects" or args.action is None:
        (parser if args.command is None else effects).print_help(sys.stderr)
        return EXIT_USAGE

    return piped(lambda: _effects(args), gone=EXIT_FAILED)


def _url(args: argparse.Namespace) -> str:
    """The store URL: ``--store``, else ``$SAGAGUARD_STORE``, else the default."""
    return str(getattr(args, "store", None) or os.environ.get(ENV_STORE) or DEFAULT_URL)


def _audit(args: argparse.Namespace) -> int:
    """Run ``sagaguard audit``."""
    return _guarded(lambda: cmd_audit(_url(args), args, sys.stdout))


def _effects(args: argparse.Namespace) -> int:
    """Run the ``effects`` command ``args`` names."""
    store: IdempotencyStore | None = None

    def command() -> int:
        nonlocal store
        store = _open(_url(args))
        return _EFFECT_COMMANDS[args.action](store, args, sys.stdout)

    try:
        return _guarded(command)
    finally:
        if store is not None:
            with contextlib.suppress(IdempotencyError):
                store.close()


def _guarded(command: Callable[[], int]) -> int:
    """Run ``command``, its expected errors as one line on stderr and an exit status."""
    try:
        return command()
    except CliError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.code
    except ConfigurationError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except IdempotencyError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
