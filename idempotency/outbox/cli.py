"""The outbox commands of the ``sagaguard`` CLI.

::

    sagaguard outbox status  [--db URL] [--table T] [--json]
    sagaguard outbox dead    [--limit N] [--after ID] [--json]
    sagaguard outbox show    ID [--json]
    sagaguard outbox replay  (ID | --all) [--actor NAME]
    sagaguard outbox discard ID [--actor NAME]
    sagaguard outbox purge   [--retention SECONDS] [--page N]
    sagaguard outbox migrate
    sagaguard relay --app MODULE:ATTR [--batch N] [--concurrency N] [--lease S] [--poll S]
                    [--until-idle] [--no-listen] [--quiet]

The database is ``--db``, else ``$SAGAGUARD_OUTBOX_DB``, else the effect store's ``--store`` /
``$SAGAGUARD_STORE``, else ``sqlite:///sagaguard.db``. ``--app`` names the :class:`Outbox` (or a
mapping of message type to handler) whose handlers the relay runs, as ``package.module:name``.

:func:`add_commands` adds these to the ``sagaguard`` parser; each sets ``sagaguard_run`` (see
:func:`run`) as its handler. Exit status: 0 done; 1 the database refused or failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, TextIO

import sqlalchemy as sa

from sagaguard.idempotency.audit import default_actor, open_audit
from sagaguard.idempotency.cliutil import duration, piped, positive
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.outbox.control import DEFAULT_RETENTION, OutboxControl
from sagaguard.idempotency.outbox.model import DEFAULT_TABLE, check_schema, migrate
from sagaguard.idempotency.outbox.operator import discard_dead, replay_all_dead, replay_dead
from sagaguard.idempotency.outbox.records import OutboxStatus
from sagaguard.idempotency.outbox.relay import Relay, RelaySettings, RelayStats

__all__ = ["add_commands", "main", "run", "status_line"]

ENV_DB = "SAGAGUARD_OUTBOX_DB"
ENV_STORE = "SAGAGUARD_STORE"
DEFAULT_URL = "sqlite:///sagaguard.db"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_commands(subparsers: Any) -> None:
    """Add ``outbox ...`` and ``relay`` to a ``sagaguard`` sub-parser collection.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--db", metavar="URL", help=f"the outbox database (default: ${ENV_DB}, else the store)"
    )
    common.add_argument("--table", default=DEFAULT_TABLE, help=f"the outbox table (default {DEFAULT_TABLE})")

    outbox = subparsers.add_parser("outbox", help="inspect and operate the transactional outbox")
    outbox.set_defaults(sagaguard_run=run, outbox_action=None, outbox_parser=outbox)
    actions = outbox.add_subparsers(dest="outbox_action", metavar="ACTION")

    status = actions.add_parser("status", parents=[common], help="depth, oldest pending age, in flight, dead")
    status.add_argument("--json", action="store_true")
    dead = actions.add_parser("dead", parents=[common], help="list dead letters with their last error")
    dead.add_argument("--limit", type=positive(int), default=50, metavar="N")
    dead.add_argument("--after", metavar="ID", help="the page after this message id")
    dead.add_argument("--json", action="store_true")
    show = actions.add_parser("show", parents=[common], help="one message in full")
    show.add_argument("id", metavar="ID")
    show.add_argument("--json", action="store_true")
    who = argparse.ArgumentParser(add_help=False)
    who.add_argument("--actor", metavar="NAME", help="who acts, for the audit trail (default: the OS user)")
    replay = actions.add_parser("replay", parents=[common, who], help="give dead letters back to the relays")
    which = replay.add_mutually_exclusive_group(required=True)
    which.add_argument("id", nargs="?", metavar="ID")
    which.add_argument("--all", action="store_true", help="every dead letter")
    discard = actions.add_parser("discard", parents=[common, who], help="give up on a dead letter for good")
    discard.add_argument("id", metavar="ID")
    purge = actions.add_parser("purge", parents=[common], help="delete old delivered messages, in pages")
    purge.add_argument("--retention", type=positive(float), default=DEFAULT_RETENTION, metavar="SECONDS")
    purge.add_argument("--page", type=positive(int), default=1000, metavar="N")
    actions.add_parser("migrate", parents=[common], help="create or upgrade the outbox table")

    relay = subparsers.add_parser(
        "relay",
        parents=[common],
        help="run an outbox relay worker",
        description="Deliver outbox messages with the handlers of --app until SIGTERM/SIGINT (a second "
        "one exits at once). Prints a live status line.",
    )
    relay.set_defaults(sagaguard_run=run, outbox_action="relay")
    relay.add_argument("--app", required=True, metavar="MODULE:ATTR", help="the Outbox with the handlers")
    relay.add_argument("--batch", type=positive(int), default=100, metavar="N")
    relay.add_argument("--concurrency", type=positive(int), default=1, metavar="N")
    relay.add_argument("--lease", type=positive(float), default=30.0, metavar="SECONDS")
    relay.add_argument("--poll", type=positive(float), default=1.0, metavar="SECONDS")
    relay.add_argument("--no-listen", action="store_true", help="poll only (no LISTEN/NOTIFY)")
    relay.add_argument("--until-idle", action="store_true", help="stop once nothing is claimable")
    relay.add_argument("--quiet", action="store_true", help="no status line")


# --------------------------------------------------------------------------------- formatting


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else duration(seconds)


def status_line(stats: RelayStats, rate: float) -> str:
    """The relay's one-line live status."""
    parts = [
        f"relay {stats.worker_id}",
        f"delivered {stats.delivered:,} ({rate:,.0f}/s)",
        f"failed {stats.failed:,}",
        f"dead {stats.dead:,}",
    ]
    if stats.depth is not None:
        parts.append(f"depth {stats.depth:,}")
        parts.append(f"oldest {_age(stats.oldest_age)}")
    if stats.lost:
        parts.append(f"lost {stats.lost:,}")
    parts.append(stats.wake_mode)
    return " | ".join(parts)


def _print_status(status: OutboxStatus, out: TextIO) -> None:
    rows = [
        ("depth", f"{status.depth:,}"),
        ("pending", f"{status.pending:,}"),
        ("in flight", f"{status.in_flight:,}"),
        ("dead", f"{status.dead:,}"),
        ("oldest pending", _age(status.oldest_pending_age)),
    ]
    for name, value in rows:
        print(f"{name.ljust(14)}  {value}", file=out)
    if status.blocked:
        # Not in the depth: no relay delivers them until the dead letter is replayed or discarded.
        print(f"blocked behind a dead letter: {status.blocked:,}", file=out)
        for agg in status.blocked_aggregates:
            print(f"  {agg.aggregatetype}/{agg.aggregateid}: {agg.blocked:,}", file=out)
        if sum(a.blocked for a in status.blocked_aggregates) < status.blocked:
            print("  ...", file=out)
        print("  (sagaguard outbox dead lists them; replay or discard to let the rest go)", file=out)


# ----------------------------------------------------------------------------------- commands


def _url(args: argparse.Namespace) -> str:
    return str(
        getattr(args, "db", None)
        or os.environ.get(ENV_DB)
        or getattr(args, "store", None)
        or os.environ.get(ENV_STORE)
        or DEFAULT_URL
    )


def _engine(url: str, action: str) -> sa.Engine:
    from sagaguard.idempotency.backends.urls import check_url
    from sagaguard.idempotency.stores.sql import make_engine

    scheme = check_url(url, what="outbox database")
    if scheme not in ("sqlite", "postgresql"):
        raise ConfigurationError(f"the outbox lives in SQLite or Postgres, not {scheme}: pass --db")

    engine = make_engine(url)
    database = engine.url.database
    if (
        action != "migrate"
        and engine.dialect.name == "sqlite"
        and database not in (None, "", ":memory:")
        and not os.path.exists(database)
    ):
        engine.dispose()  # a typo must not create an empty database that shows nothing
        hint = "check --db (or run `sagaguard db upgrade`)"
        raise ConfigurationError(f"no SQLite database at {database}: {hint}")
    return engine


def _load_app(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"--app takes MODULE:ATTR, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load --app {spec!r}: {exc}") from exc
    if not isinstance(getattr(target, "handlers", target), Mapping):
        raise ConfigurationError(f"--app {spec!r} is neither an Outbox nor a mapping of handlers")
    return target


def _outbox(args: argparse.Namespace, engine: sa.Engine, out: TextIO) -> int:
    control = OutboxControl(engine, args.table)
    action = args.outbox_action
    if action != "migrate":
        check_schema(engine, args.table)
    if action == "migrate":
        version = migrate(engine, args.table)
        print(f"outbox table {args.table} is at schema version {version}", file=out)
    elif action == "status":
        status = control.status()
        if args.json:
            print(json.dumps({**asdict(status), "depth": status.depth}), file=out)
        else:
            _print_status(status, out)
    elif action == "dead":
        letters = control.dead_letters(limit=args.limit, after=args.after)
        if args.json:
            print(json.dumps([asdict(d) for d in letters], indent=2), file=out)
        elif not letters:
            print("no dead letters", file=out)
        for d in [] if args.json else letters:
            print(f"{d.id}  {d.type}  {d.aggregatetype}/{d.aggregateid}  attempts {d.attempts}", file=out)
            print(f"    {d.last_error or '-'}", file=out)
    elif action == "show":
        info = control.get(args.id)
        if args.json:
            print(json.dumps(info, indent=2, default=str), file=out)
        else:
            for name, value in info.items():
                print(f"{name.ljust(14)}  {'-' if value is None else value}", file=out)
    elif action in ("replay", "discard"):
        _act(args, control, out)
    elif action == "purge":
        print(f"purged {control.purge(args.retention, page=args.page):,} messages", file=out)
    return EXIT_OK


def _act(args: argparse.Namespace, control: OutboxControl, out: TextIO) -> None:
    """``outbox replay`` and ``outbox discard``, through the audited operator API."""
    log = open_audit(_url(args))
    who: dict[str, Any] = {"actor": args.actor or default_actor(), "audit": log, "source": "cli"}
    try:
        if args.outbox_action == "discard":
            discard_dead(control, args.id, **who)
            print(f"discarded {args.id}", file=out)
        elif args.all:
            print(f"replayed {replay_all_dead(control, **who)} dead letters", file=out)
        else:
            replay_dead(control, args.id, **who)
            print(f"replayed {args.id}", file=out)
    finally:
        log.close()


def _relay(args: argparse.Namespace, engine: sa.Engine, out: TextIO) -> int:
    app = _load_app(args.app)
    settings = RelaySettings(
        batch_size=args.batch,
        concurrency=args.concurrency,
        lease=args.lease,
        poll_interval=args.poll,
        listen=not args.no_listen,
    )
    relay = Relay(app, engine, settings, table_name=args.table)
    signals = {"count": 0}

    def on_signal(signum: int, frame: Any) -> None:
        signals["count"] += 1
        if signals["count"] > 1:
            raise KeyboardInterrupt
        relay.request_stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    done = threading.Event()
    printer = None if args.quiet else threading.Thread(target=_show, args=(relay, done, out), daemon=True)
    try:
        if printer is not None:
            printer.start()
        stats = relay.run(until_idle=args.until_idle)
    finally:
        done.set()
        if printer is not None:
            printer.join(timeout=2)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        relay.close()
    print(
        f"relay {stats.worker_id} stopped: delivered {stats.delivered:,}, failed {stats.failed:,}, "
        f"dead {stats.dead:,}, released {stats.released:,}",
        file=out,
    )
    return EXIT_OK


def _show(relay: Relay, done: threading.Event, out: TextIO) -> None:
    """Refresh the status line: in place on a terminal, a line every 10 s otherwise."""
    tty = out.isatty()
    every = 1.0 if tty else 10.0
    last_count, last_time = 0, time.monotonic()
    while not done.wait(every):
        stats = relay.stats()
        now = time.monotonic()
        rate = (stats.delivered - last_count) / max(now - last_time, 1e-9)
        last_count, last_time = stats.delivered, now
        line = status_line(stats, rate)
        with contextlib.suppress(OSError, ValueError):
            if tty:
                out.write("\r\x1b[2K" + line)
            else:
                out.write(line + "\n")
            out.flush()
    if tty:
        with contextlib.suppress(OSError, ValueError):
            out.write("\n")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a parsed ``outbox`` or ``relay`` command; returns the exit status.

    Expected errors are one line on stderr, never a traceback.
    """
    out = out or sys.stdout
    if args.outbox_action is None:
        args.outbox_parser.print_help(sys.stderr)
        return EXIT_USAGE
    engine: sa.Engine | None = None
    try:
        engine = _engine(_url(args), args.outbox_action)
        if args.outbox_action == "relay":
            return _relay(args, engine, out)
        return _outbox(args, engine, out)
    except ConfigurationError as exc:
        print(f"sagaguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except IdempotencyError as exc:
        print(f"sagaguard: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("sagaguard: interrupted", file=sys.stderr)
        return 130
    finally:
        if engine is not None:
            engine.dispose()


def main(argv: list[str] | None = None) -> int:
    """``python -m sagaguard.idempotency.outbox.cli outbox status`` etc.: these commands on their own."""
    parser = argparse.ArgumentParser(prog="sagaguard", description="The outbox commands of sagaguard.")
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND"))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if getattr(args, "sagaguard_run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return piped(lambda: run(args), gone=EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
