"""The pieces of the click command tree that every ``sagaguard`` command shares.

The store option (``--store`` on the root or on the command, else ``$SAGAGUARD_STORE``), ``--actor``,
``--json`` with RFC 3339 times, the bulk actions' ``--dry-run``/``--yes``/``--action-id`` and their
confirmation, and :func:`run`, which turns a command's expected errors into one line on stderr and
an exit status, and a reader that went away (``| head``) into a quiet exit.

Exit status, for every command: 0 done; 1 the store refused or failed, or a confirmation was
declined; 2 bad usage or configuration; 130 interrupted. A command may document more.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from sagaguard.idempotency.audit import default_actor
from sagaguard.idempotency.bulk import MAX_ITEMS, check_action_id, new_action_id
from sagaguard.idempotency.cliutil import piped
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.stores import DEFAULT_URL

__all__ = [
    "ENV_STORE",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "CliError",
    "Positive",
    "actor_option",
    "bulk_options",
    "bulk_options_named",
    "confirm_bulk",
    "echo_json",
    "json_option",
    "rfc3339",
    "run",
    "store_option",
    "store_url",
]

PROG = "sagaguard"
ENV_STORE = "SAGAGUARD_STORE"
"""Environment variable naming the store when ``--store`` is not given."""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

F = TypeVar("F", bound=Callable[..., Any])


class CliError(Exception):
    """An expected failure of a command: printed as one line, exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class Positive(click.ParamType):  # type: ignore[type-arg, unused-ignore]  # generic in newer click
    """A finite number > 0, of ``int`` or ``float``."""

    def __init__(self, kind: type[int] | type[float]) -> None:
        self.kind = kind
        self.name = kind.__name__

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The number, or a usage error saying what is wrong."""
        if isinstance(value, self.kind):
            return value
        try:
            number = self.kind(value)
        except ValueError:
            self.fail(f"not a number: {value!r}", param, ctx)
        if not math.isfinite(number) or number <= 0:
            self.fail(f"must be > 0, got {value}", param, ctx)
        return number


def rfc3339(at: float) -> str:
    """``at`` (seconds since the epoch) as an RFC 3339 UTC time."""
    return datetime.datetime.fromtimestamp(at, tz=datetime.UTC).isoformat().replace("+00:00", "Z")


def echo_json(data: Any) -> None:
    """Print ``data`` as indented JSON (times are converted by the caller, with :func:`rfc3339`)."""
    click.echo(json.dumps(data, indent=2, ensure_ascii=False))


def store_option(f: F) -> F:
    """``--store URL``, on the root group and on each command (the command's wins)."""
    return click.option(
        "--store",
        metavar="URL",
        default=None,
        help=f"the ledger (default: ${ENV_STORE}, else {DEFAULT_URL})",
    )(f)


def store_url(given: str | None = None) -> str:
    """The store URL: the command's ``--store``, else the root's, else ``$SAGAGUARD_STORE``, else
    the default."""
    if given:
        return given
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root().params.get("store") if ctx is not None else None
    return str(root or os.environ.get(ENV_STORE) or DEFAULT_URL)


def actor_option(f: F) -> F:
    """``--actor NAME``: who acts, as the audit trail records (default: the OS user)."""
    return click.option(
        "--actor",
        metavar="NAME",
        default=None,
        help="who acts, as the audit trail records (default: the OS user)",
    )(f)


def actor(given: str | None) -> str:
    """``--actor``, else the OS user."""
    return given or default_actor()


def json_option(f: F) -> F:
    """``--json``: the output as JSON (nested objects, RFC 3339 times)."""
    return click.option("--json", "as_json", is_flag=True, help="the output as JSON")(f)


def bulk_options_named(*aliases: str) -> Callable[[F], F]:
    """:func:`bulk_options`, with ``aliases`` of ``--all`` (``--all-dead``)."""

    def add(f: F) -> F:
        for option in reversed(
            (
                click.option("--all", *aliases, "all_", is_flag=True, help="every item the filters match"),
                click.option(
                    "--dry-run", is_flag=True, help="with --all: show what it would touch, touch nothing"
                ),
                click.option("--yes", "-y", is_flag=True, help="with --all: do not ask for confirmation"),
                click.option(
                    "--action-id",
                    metavar="ID",
                    default=None,
                    help="with --all: the bulk action's id (32 hex digits; default: a fresh one); rerun "
                    "with the same id, it does nothing again",
                ),
            )
        ):
            f = option(f)
        return f

    return add


bulk_options = bulk_options_named()
"""``--all``, ``--dry-run``, ``--yes`` and ``--action-id`` of a bulk action."""


def confirm_bulk(
    ids: Sequence[str],
    *,
    what: str,
    verb: str,
    dry_run: bool,
    yes: bool,
    action_id: str | None,
    as_json: bool,
) -> str | None:
    """Show what a bulk action would touch and ask; the action id to act under, or None to stop.

    With ``dry_run``, prints how many and which ids and stops. Without ``yes``, asks on the
    terminal, and refuses when stdin is not one.

    Raises:
        CliError: more than :data:`MAX_ITEMS` items, a malformed ``action_id``, or no terminal to
            ask on without ``yes`` (exit 2).
        click.Abort: the operator declined (exit 1).
    """
    if action_id is not None:
        try:
            check_action_id(action_id)
        except ConfigurationError as exc:
            raise CliError(f"--action-id: {exc}", EXIT_USAGE) from None
    if len(ids) > MAX_ITEMS:
        raise CliError(
            f"{len(ids)} {what} match; a bulk action takes at most {MAX_ITEMS}: narrow the filters"
        )
    if dry_run or not ids:
        if as_json:
            echo_json({"dry_run": dry_run, "action": verb, "count": len(ids), "targets": list(ids)})
        else:
            click.echo(f"{'would ' if dry_run else ''}{verb} {len(ids)} {what}" + (":" if ids else ""))
            for ident in ids:
                click.echo(f"  {ident}")
        return None
    if not yes:
        if not sys.stdin.isatty():
            raise CliError(
                f"{verb} {len(ids)} {what}: stdin is not a terminal to confirm on: pass --yes", EXIT_USAGE
            )
        click.echo(f"{verb} {len(ids)} {what}:", err=True)
        for ident in ids:
            click.echo(f"  {ident}", err=True)
        click.confirm(f"{verb} these {len(ids)} {what}?", abort=True, err=True)
    return action_id or new_action_id()


def run(body: Callable[[], int | None], *, failed: tuple[type[BaseException], ...] = ()) -> None:
    """Run a command's ``body``: expected errors as one line on stderr, then exit with the status.

    ``CliError`` exits with its code; ``ConfigurationError`` with 2; ``IdempotencyError`` and
    ``failed`` (a package's own error root) with 1; an interrupt with 130. A reader that went away
    exits quietly with 1. Output is flushed here, so a closed pipe is met here and not at exit.
    """

    refused: tuple[type[BaseException], ...] = (IdempotencyError, *failed)

    def guarded() -> int:
        try:
            return body() or EXIT_OK
        except CliError as exc:
            click.echo(f"{PROG}: {exc}", err=True)
            return exc.code
        except ConfigurationError as exc:
            click.echo(f"{PROG}: {exc}", err=True)
            return EXIT_USAGE
        except refused as exc:
            click.echo(f"{PROG}: {exc}", err=True)
            return EXIT_FAILED
        except KeyboardInterrupt:
            click.echo(f"{PROG}: interrupted", err=True)
            return EXIT_INTERRUPTED

    code = piped(guarded, gone=EXIT_FAILED)
    if code:
        raise click.exceptions.Exit(code)
