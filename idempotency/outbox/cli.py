"""The outbox commands of the ``sagaguard`` CLI (click): ``outbox ...`` and ``relay``.

::

    sagaguard outbox status  [--json]
    sagaguard outbox dead    [--limit N] [--after ID] [--json]
    sagaguard outbox show    ID [--json]
    sagaguard outbox replay  (ID | --all [--prefix P] [--dry-run] [--yes] [--action-id ID]) [--actor NAME]
    sagaguard outbox discard ID [--actor NAME]
    sagaguard outbox purge   [--retention SECONDS] [--page N]
    sagaguard outbox migrate
    sagaguard relay --app MODULE:ATTR [--batch N] [--concurrency N] [--lease S] [--poll S]
                    [--until-idle] [--no-listen] [--quiet]

Each takes ``--store URL`` and ``--table T``. The database is ``--db``, else
``$SAGAGUARD_OUTBOX_DB`` (an outbox kept apart from the store), else ``--store`` /
``$SAGAGUARD_STORE``, else ``sqlite:///sagaguard.db``. ``--app`` names the :class:`Outbox` (or a
mapping of message type to handler) whose handlers the relay runs, as ``package.module:name``.

:data:`outbox` and :data:`relay` are registered under the entry-point group ``sagaguard.commands``.
Exit status: 0 done; 1 the database refused or failed, or a confirmation was declined; 2 bad usage
(an unknown message id included); 130 interrupted.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from typing import Any, TextIO, TypeVar

import click
import sqlalchemy as sa

from sagaguard.idempotency.audit import AuditLog, open_audit
from sagaguard.idempotency.bulk import MAX_ITEMS, run_bulk
from sagaguard.idempotency.cliopts import (
    Positive,
    actor_option,
    bulk_options_named,
    confirm_bulk,
    echo_json,
    json_option,
    rfc3339,
    run,
    store_url,
)
from sagaguard.idempotency.cliopts import actor as actor_name
from sagaguard.idempotency.cliutil import duration
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.outbox.control import DEFAULT_RETENTION, OutboxControl
from sagaguard.idempotency.outbox.model import DEFAULT_TABLE, check_schema, migrate
from sagaguard.idempotency.outbox.operator import discard_dead, replay_dead
from sagaguard.idempotency.outbox.records import OutboxStatus
from sagaguard.idempotency.outbox.relay import Relay, RelaySettings, RelayStats

__all__ = ["main", "outbox", "relay", "status_line"]

ENV_DB = "SAGAGUARD_OUTBOX_DB"

F = TypeVar("F", bound=Callable[..., Any])


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


def _print_status(status: OutboxStatus) -> None:
    rows = [
        ("depth", f"{status.depth:,}"),
        ("pending", f"{status.pending:,}"),
        ("in flight", f"{status.in_flight:,}"),
        ("dead", f"{status.dead:,}"),
        ("oldest pending", _age(status.oldest_pending_age)),
    ]
    for name, value in rows:
        click.echo(f"{name.ljust(14)}  {value}")
    if status.blocked:
        # Not in the depth: no relay delivers them until the dead letter is replayed or discarded.
        click.echo(f"blocked behind a dead letter: {status.blocked:,}")
        for agg in status.blocked_aggregates:
            click.echo(f"  {agg.aggregatetype}/{agg.aggregateid}: {agg.blocked:,}")
        if sum(a.blocked for a in status.blocked_aggregates) < status.blocked:
            click.echo("  ...")
        click.echo("  (sagaguard outbox dead lists them; replay or discard to let the rest go)")


# ----------------------------------------------------------------------------------- commands


def where(f: F) -> F:
    """``--store``, ``--db`` and ``--table``."""
    f = click.option("--table", default=DEFAULT_TABLE, help=f"the outbox table (default {DEFAULT_TABLE})")(f)
    f = click.option(
        "--db", metavar="URL", help=f"the outbox's database when not the store's (default: ${ENV_DB})"
    )(f)
    return click.option("--store", metavar="URL", default=None, help="the store (default: $SAGAGUARD_STORE)")(
        f
    )


def _url(db: str | None, store: str | None) -> str:
    return str(db or os.environ.get(ENV_DB) or store_url(store))


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


@contextlib.contextmanager
def _control(db: str | None, store: str | None, table: str) -> Iterator[OutboxControl]:
    """The outbox control on its database, its schema checked."""
    engine = _engine(_url(db, store), "")
    try:
        check_schema(engine, table)
        yield OutboxControl(engine, table)
    finally:
        engine.dispose()


def _message_json(info: Mapping[str, Any]) -> dict[str, Any]:
    """A message or dead letter as JSON types: ``*_at`` times as RFC 3339 text."""
    return {
        k: rfc3339(v)
        if k.endswith("_at") and isinstance(v, int | float) and v > 0
        else (None if k.endswith("_at") and isinstance(v, int | float) else v)
        for k, v in info.items()
    }


@click.group(no_args_is_help=True)
def outbox() -> None:
    """Inspect and operate the transactional outbox."""


@outbox.command()
@json_option
@where
def status(*, as_json: bool, store: str | None, db: str | None, table: str) -> None:
    """Depth, oldest pending age, in flight, dead, and what waits behind a dead letter."""

    def body() -> None:
        with _control(db, store, table) as control:
            found = control.status()
        if as_json:
            echo_json({**asdict(found), "depth": found.depth})
        else:
            _print_status(found)

    run(body)


@outbox.command()
@click.option("--limit", type=Positive(int), default=50, metavar="N", help="at most N (50)")
@click.option("--after", metavar="ID", help="the page after this message id")
@json_option
@where
def dead(
    *, limit: int, after: str | None, as_json: bool, store: str | None, db: str | None, table: str
) -> None:
    """List dead letters with their last error."""

    def body() -> None:
        with _control(db, store, table) as control:
            letters = control.dead_letters(limit=limit, after=after)
        if as_json:
            echo_json([_message_json(asdict(d)) for d in letters])
            return
        if not letters:
            click.echo("no dead letters")
        for d in letters:
            click.echo(f"{d.id}  {d.type}  {d.aggregatetype}/{d.aggregateid}  attempts {d.attempts}")
            click.echo(f"    {d.last_error or '-'}")

    run(body)


@outbox.command()
@click.argument("message_id", metavar="ID")
@json_option
@where
def show(*, message_id: str, as_json: bool, store: str | None, db: str | None, table: str) -> None:
    """One message in full."""

    def body() -> None:
        with _control(db, store, table) as control:
            info = control.get(message_id)
        if as_json:
            echo_json(
                _message_json(
                    {
                        k: v if isinstance(v, int | float | str | bool | None) else str(v)
                        for k, v in info.items()
                    }
                )
            )
        else:
            for name, value in info.items():
                click.echo(f"{name.ljust(14)}  {'-' if value is None else value}")

    run(body)


@contextlib.contextmanager
def _audit(db: str | None, store: str | None) -> Iterator[AuditLog]:
    log = open_audit(_url(db, store))
    try:
        yield log
    finally:
        log.close()


@outbox.command()
@click.argument("message_id", metavar="ID", required=False)
@click.option("--prefix", default="", metavar="P", help="with --all: only aggregates TYPE/ID starting with P")
@bulk_options_named("--all-dead")
@actor_option
@json_option
@where
def replay(
    *,
    message_id: str | None,
    prefix: str,
    all_: bool,
    dry_run: bool,
    yes: bool,
    action_id: str | None,
    actor: str | None,
    as_json: bool,
    store: str | None,
    db: str | None,
    table: str,
) -> None:
    """Give a dead letter (or with --all, every dead letter) back to the relays.

    Its attempts count from zero: its handler runs again (under the same provider key), and the
    messages blocked behind it drain.
    """
    if all_ == (message_id is not None):
        raise click.UsageError("give an ID or --all")
    if not all_ and (dry_run or yes or action_id or prefix):
        raise click.UsageError("--prefix, --dry-run, --yes and --action-id go with --all")

    def one() -> None:
        with _control(db, store, table) as control, _audit(db, store) as log:
            replay_dead(control, message_id or "", actor=actor_name(actor), audit=log, source="cli")
        click.echo(f"replayed {message_id}")

    def every() -> None:
        with _control(db, store, table) as control:
            letters = control.dead_letters(limit=MAX_ITEMS + 1)
            ids = [d.id for d in letters if f"{d.aggregatetype}/{d.aggregateid}".startswith(prefix)]
            acting = confirm_bulk(
                ids,
                what="dead letters",
                verb="replay",
                dry_run=dry_run,
                yes=yes,
                action_id=action_id,
                as_json=as_json,
            )
            if acting is None:
                return
            with _audit(db, store) as log:

                def act(target: str) -> str:
                    replay_dead(control, target, actor=actor_name(actor), audit=log, source="cli")
                    return "replayed"

                done = run_bulk(
                    log,
                    "outbox.replay",
                    acting,
                    ids,
                    act,
                    actor=actor_name(actor),
                    source="cli",
                    at=control.now(),
                    refusals=(IdempotencyError,),
                    args={"prefix": prefix},
                )
        result = done.to_json()
        if as_json:
            echo_json(result)
        elif done.repeated:
            click.echo(f"action {done.action_id} was done already: nothing done again")
        else:
            click.echo(
                f"replayed {len(done.outcomes)} dead letters ({len(done.refused)} refused), "
                f"action {done.action_id}"
            )

    run(every if all_ else one)


@outbox.command()
@click.argument("message_id", metavar="ID")
@actor_option
@where
def discard(*, message_id: str, actor: str | None, store: str | None, db: str | None, table: str) -> None:
    """Give up on a dead letter for good: it is never delivered, the messages behind it drain."""

    def body() -> None:
        with _control(db, store, table) as control, _audit(db, store) as log:
            discard_dead(control, message_id, actor=actor_name(actor), audit=log, source="cli")
        click.echo(f"discarded {message_id}")

    run(body)


@outbox.command()
@click.option(
    "--retention",
    type=Positive(float),
    default=DEFAULT_RETENTION,
    metavar="SECONDS",
    help="keep delivered messages this long",
)
@click.option("--page", type=Positive(int), default=1000, metavar="N", help="rows per page (1000)")
@where
def purge(*, retention: float, page: int, store: str | None, db: str | None, table: str) -> None:
    """Delete old delivered messages, in pages."""

    def body() -> None:
        with _control(db, store, table) as control:
            click.echo(f"purged {control.purge(retention, page=page):,} messages")

    run(body)


@outbox.command("migrate")
@where
def migrate_(*, store: str | None, db: str | None, table: str) -> None:
    """Create or upgrade the outbox table."""

    def body() -> None:
        engine = _engine(_url(db, store), "migrate")
        try:
            version = migrate(engine, table)
        finally:
            engine.dispose()
        click.echo(f"outbox table {table} is at schema version {version}")

    run(body)


@click.command()
@click.option("--app", required=True, metavar="MODULE:ATTR", help="the Outbox with the handlers")
@click.option("--batch", type=Positive(int), default=100, metavar="N", help="messages per claim (100)")
@click.option("--concurrency", type=Positive(int), default=1, metavar="N", help="handler threads (1)")
@click.option("--lease", type=Positive(float), default=30.0, metavar="SECONDS", help="claim lease (30)")
@click.option("--poll", type=Positive(float), default=1.0, metavar="SECONDS", help="poll interval (1)")
@click.option("--no-listen", is_flag=True, help="poll only (no LISTEN/NOTIFY)")
@click.option("--until-idle", is_flag=True, help="stop once nothing is claimable")
@click.option("--quiet", is_flag=True, help="no status line")
@where
def relay(
    *,
    app: str,
    batch: int,
    concurrency: int,
    lease: float,
    poll: float,
    no_listen: bool,
    until_idle: bool,
    quiet: bool,
    store: str | None,
    db: str | None,
    table: str,
) -> None:
    """Run an outbox relay worker.

    Deliver outbox messages with the handlers of --app until SIGTERM/SIGINT (a second one exits at
    once). Prints a live status line.
    """

    def body() -> None:
        engine = _engine(_url(db, store), "relay")
        try:
            handlers = _load_app(app)
            settings = RelaySettings(
                batch_size=batch,
                concurrency=concurrency,
                lease=lease,
                poll_interval=poll,
                listen=not no_listen,
            )
            _relay(Relay(handlers, engine, settings, table_name=table), until_idle=until_idle, quiet=quiet)
        finally:
            engine.dispose()

    run(body)


def _relay(worker: Relay, *, until_idle: bool, quiet: bool) -> None:
    signals = {"count": 0}

    def on_signal(signum: int, frame: Any) -> None:
        signals["count"] += 1
        if signals["count"] > 1:
            raise KeyboardInterrupt
        worker.request_stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    done = threading.Event()
    printer = None if quiet else threading.Thread(target=_show, args=(worker, done, sys.stdout), daemon=True)
    try:
        if printer is not None:
            printer.start()
        stats = worker.run(until_idle=until_idle)
    finally:
        done.set()
        if printer is not None:
            printer.join(timeout=2)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        worker.close()
    click.echo(
        f"relay {stats.worker_id} stopped: delivered {stats.delivered:,}, failed {stats.failed:,}, "
        f"dead {stats.dead:,}, released {stats.released:,}"
    )


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


def main(argv: list[str] | None = None) -> int:
    """``python -m sagaguard.idempotency.outbox.cli outbox status`` etc.: the ``sagaguard`` command line."""
    from sagaguard.idempotency.cli import main as root

    return root(argv)


if __name__ == "__main__":
    sys.exit(main())
