"""``sagaguard sagas``: the operator's commands for saga instances (a click group).

::

    sagaguard sagas list [--state STATE ...] [--limit N] [--json]
    sagaguard sagas show SAGA_ID [--json]
    sagaguard sagas signal SAGA_ID NAME [--payload JSON]
    sagaguard sagas cancel (SAGA_ID | --all [--state LIST] [--prefix P] [--name N] [--dry-run] [--yes])
    sagaguard sagas retry (SAGA_ID | --all ...) [--fresh]
    sagaguard sagas resolve SAGA_ID STEP [--note TEXT]
    sagaguard sagas reject (RUN_ID | --all ...) [--reason TEXT]
    sagaguard sagas worker --app MODULE:ATTR [--guard MODULE:ATTR] [--interval S] [--once] ...

The store is the one every ``sagaguard`` command uses: ``--store`` (before ``sagas`` or after its
action), else ``$SAGAGUARD_STORE``, else ``sqlite:///sagaguard.db``; it holds the saga journal and
the worker's guard. ``--journal`` and ``$SAGAGUARD_JOURNAL`` are deprecated aliases (a warning on
stderr). Every command but ``worker`` opens it without creating anything: a SQLite file or saga
table that does not exist is an error naming the URL, never an empty database. The worker imports
the saga definitions it may run from ``--app`` (a :class:`~sagaguard.saga.registry.SagaRegistry`, one
saga, a list of sagas, or a function returning one) and uses the module's ``guard`` (or ``--guard``,
or a guard on ``--store``) for compensations.

The group :data:`sagas` is registered under the entry-point group ``sagaguard.commands``, where the
``sagaguard`` root finds it; :func:`main` runs the command line (``python -m sagaguard.saga.cli``).
The actions (:mod:`sagaguard.saga.cli_actions`) go through :mod:`sagaguard.saga.operator` and are
recorded in the ledger's audit trail under ``--actor`` (default: the OS user); ``sagas show`` lists
the actions recorded on the saga, and ``sagaguard audit`` all of them.

Exit status: 0 done; 1 the journal refused or failed (no such saga, unreachable), a signal or a
cancel came too late, or a confirmation was declined; 2 bad usage.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from sagaguard.idempotency.audit import AuditEntry, AuditFilter, open_audit
from sagaguard.idempotency.audit_cli import entry_json
from sagaguard.idempotency.backends.urls import check_url, masked
from sagaguard.idempotency.cliopts import (
    EXIT_USAGE,
    PROG,
    CliError,
    Positive,
    echo_json,
    json_option,
    store_url,
)
from sagaguard.idempotency.cliopts import run as run_command
from sagaguard.idempotency.cliutil import install_hint, require_schema
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.stores import open_store
from sagaguard.saga.cli_view import nested, outcomes_of, record_json, show_snapshot, step_json, table
from sagaguard.saga.definition import Saga
from sagaguard.saga.errors import SagaError, SagaNotFound
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.journals import DEFAULT_URL, open_journal
from sagaguard.saga.records import (
    SagaRecord,
    SagaState,
)
from sagaguard.saga.recovery import RecoveryReport, RecoveryWorker, Sagas, run_worker
from sagaguard.saga.registry import SagaRegistry, as_registry

__all__ = ["main", "record_json", "sagas", "step_json", "sweep_once"]

ENV_JOURNAL = "SAGAGUARD_JOURNAL"
ENV_STORE = "SAGAGUARD_STORE"
ORDER = (
    SagaState.NEEDS_ATTENTION,
    SagaState.COMPENSATING,
    SagaState.RUNNING,
    SagaState.WAITING,
    SagaState.FAILED,
    SagaState.COMPENSATED,
    SagaState.COMPLETED,
)
"""The listing order: what needs an operator first."""

F = TypeVar("F", bound=Callable[..., Any])


# ------------------------------------------------------------------------------------ the store


def where(f: F) -> F:
    """``--store URL`` and the deprecated, hidden ``--journal URL``."""
    f = click.option(
        "--journal", metavar="URL", default=None, hidden=True, help="deprecated alias of --store"
    )(f)
    return click.option(
        "--store",
        metavar="URL",
        default=None,
        help=f"the store holding the sagas (default: ${ENV_STORE}, else {DEFAULT_URL})",
    )(f)


def saga_url(store: str | None, journal: str | None) -> str:
    """The one store URL: ``--store`` (the command's, else the root's), else ``$SAGAGUARD_STORE``,
    else the default; the deprecated ``--journal`` / ``$SAGAGUARD_JOURNAL`` only when neither of
    the first two is given.

    Raises:
        CliError: ``--store`` and ``--journal`` name different URLs.
    """
    ctx = click.get_current_context(silent=True)
    flag = store or (ctx.find_root().params.get("store") if ctx is not None else None)
    if journal is not None:
        click.echo(f"{PROG}: --journal is deprecated: use --store", err=True)
        if flag is not None and flag != journal:
            raise CliError("--store and the deprecated --journal name different URLs", EXIT_USAGE)
    if flag or journal:
        return str(flag or journal)
    if os.environ.get(ENV_STORE):
        return store_url()
    if os.environ.get(ENV_JOURNAL):
        click.echo(f"{PROG}: ${ENV_JOURNAL} is deprecated: use ${ENV_STORE}", err=True)
        return os.environ[ENV_JOURNAL]
    return DEFAULT_URL


def open_existing_journal(url: str, *, create: bool = False) -> SagaJournal:
    """The journal on ``url``. Only the long-running worker creates its tables; every other command
    (``worker --once`` too: one sweep of an empty database has nothing to do) opens it as it is, so
    a mistyped URL is an error naming it rather than an empty journal.

    Raises:
        SchemaMissing: no SQLite file or no saga tables (``create`` false).
        CliError: the backend's driver is not installed.
    """
    try:
        scheme = check_url(url, what="store")
        if scheme not in ("sqlite", "postgresql") or create:
            return open_journal(url)
        from sagaguard.saga.journals.sql import SqlJournal
        from sagaguard.saga.journals.sql_schema import DEFAULT_PREFIX, journal_models

        tables = [str(model.__tablename__) for model in journal_models(DEFAULT_PREFIX)]
        require_schema(url, tables, what="sagas")
        return SqlJournal(url, create=False)
    except ModuleNotFoundError as exc:
        hint = install_hint(exc)
        raise CliError(f"the store {masked(url)!r} needs the {exc.name!r} package{hint}", EXIT_USAGE) from exc


@contextlib.contextmanager
def opened_journal(url: str, *, create: bool = False) -> Iterator[SagaJournal]:
    """:func:`open_existing_journal`, closed afterwards."""
    journal = open_existing_journal(url, create=create)
    try:
        yield journal
    finally:
        with contextlib.suppress(SagaError):
            journal.close()


def run(body: Callable[[], int | None]) -> None:
    """Run a command's ``body`` (:func:`sagaguard.idempotency.cliopts.run`, with the saga errors)."""
    run_command(body, failed=(SagaError,))


def _audit_entries(url: str, saga_id: str) -> list[AuditEntry]:
    """The audit entries on ``saga_id``, oldest first; none when the audit cannot be read."""
    try:
        log = open_audit(url, create=False)
    except (IdempotencyError, ConfigurationError):
        return []
    try:
        return list(reversed(log.list(AuditFilter(target=saga_id), limit=200)))
    except IdempotencyError:
        return []
    finally:
        log.close()


def age_options(f: F) -> F:
    """``--older SECONDS`` and ``--newer SECONDS``: sagas created at least / at most that long ago."""
    f = click.option(
        "--newer", type=Positive(float), metavar="S", help="only sagas created at most S seconds ago"
    )(f)
    return click.option(
        "--older", type=Positive(float), metavar="S", help="only sagas created at least S seconds ago"
    )(f)


# ---------------------------------------------------------------------------------- commands


@click.group(no_args_is_help=True)
def sagas() -> None:
    """List, inspect, signal, cancel and recover sagas."""


@sagas.command("list")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([*(s.value for s in ORDER), "running_past_lease"]),
    metavar="STATE",
    help="only these states (running_past_lease: running sagas whose runner's lease ran out); repeatable",
)
@click.option("--prefix", default="", metavar="P", help="only saga ids starting with P")
@click.option("--name", "name_prefix", default="", metavar="N", help="only sagas whose name starts with N")
@age_options
@click.option("--limit", type=Positive(int), default=100, metavar="N", help="at most N (100)")
@json_option
@where
def list_(
    *,
    states: tuple[str, ...],
    prefix: str,
    name_prefix: str,
    older: float | None,
    newer: float | None,
    limit: int,
    as_json: bool,
    store: str | None,
    journal: str | None,
) -> None:
    """List sagas, those needing attention first (the console's lists and filters)."""
    from sagaguard.saga.console.data import saga_page

    def body() -> None:
        with opened_journal(saga_url(store, journal)) as opened:
            order = [s.value for s in ORDER]
            views = (
                [v for v in (*order[:3], "running_past_lease", *order[3:]) if v in states]
                if states
                else order
            )
            records: list[SagaRecord] = []
            for view in views:
                if len(records) < limit:
                    page = saga_page(
                        opened,
                        view,
                        prefix=prefix,
                        name=name_prefix,
                        size=limit - len(records),
                        older=older,
                        newer=newer,
                    )
                    records.extend(page.items)
            if as_json:
                echo_json([record_json(r) for r in records])
            elif not records:
                click.echo("no sagas" + (" in these states" if states else ""))
            else:
                table(records, opened.now())

    run(body)


@sagas.command()
@click.argument("saga_id")
@json_option
@where
def show(*, saga_id: str, as_json: bool, store: str | None, journal: str | None) -> None:
    """One saga with its steps, signals, timeline and the operators' actions on it."""

    def body() -> None:
        url = saga_url(store, journal)
        with opened_journal(url) as opened:
            snapshot = opened.load(saga_id)
            if snapshot is None:
                raise SagaNotFound(saga_id)
            outcomes = outcomes_of(url, snapshot)
            audit = _audit_entries(url, saga_id)
            if as_json:
                data = record_json(snapshot.saga)
                data["steps"] = [step_json(s, outcomes.get(s.index)) for s in snapshot.steps]
                data["signals"] = {k: nested(v) for k, v in snapshot.signals.items()}
                data["audit"] = [entry_json(e) for e in audit]
                echo_json(data)
            else:
                show_snapshot(snapshot, opened.now(), outcomes, audit)

    run(body)


def _import(ref: str) -> Any:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise CliError(f"expected MODULE:ATTR, got {ref!r}", EXIT_USAGE)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"cannot import {module_name!r}: {exc}", EXIT_USAGE) from exc
    found = module
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise CliError(f"{module_name!r} has no {attr!r}", EXIT_USAGE) from None
    return found


def _registry(ref: str) -> SagaRegistry:
    found = _import(ref)
    if callable(found) and not isinstance(found, Saga | SagaRegistry):
        found = found()
    try:
        return as_registry(found)
    except (TypeError, AttributeError) as exc:
        raise CliError(f"{ref!r} is not a SagaRegistry, a Saga or a list of sagas", EXIT_USAGE) from exc


def _guard(app: str, ref: str | None, url: str) -> Guard:
    found = _import(ref) if ref else getattr(importlib.import_module(app.partition(":")[0]), "guard", None)
    if isinstance(found, Guard):
        return found
    if ref:
        raise CliError(f"{ref!r} is not a Guard", EXIT_USAGE)
    return Guard(open_store(url))


def sweep_once(journal: SagaJournal, guard: Guard, registry: Sagas, **options: Any) -> None:
    """One sweep of a :class:`~sagaguard.saga.recovery.RecoveryWorker` (``options`` are its
    own), its report printed: what ``sagas worker --once`` and ``mcp worker --once`` do."""
    sweeper = RecoveryWorker(journal, guard, registry, **options)
    try:
        _print_report(sweeper.run_once())
    finally:
        sweeper.runner.close()


def _print_report(report: RecoveryReport) -> None:
    click.echo(
        f"{report.found} due, {len(report.outcomes)} driven, {len(report.lost)} taken by others, "
        f"{len(report.skipped)} skipped, {len(report.errors)} failed"
    )
    for saga_id, outcome in report.outcomes.items():
        click.echo(f"  {saga_id}: {outcome.state.value}")
    for saga_id, reason in {**report.skipped, **report.errors}.items():
        click.echo(f"  {saga_id}: {reason}")


@sagas.command()
@click.option("--app", required=True, metavar="MODULE:ATTR", help="the saga definitions")
@click.option("--guard", "guard_ref", metavar="MODULE:ATTR", help="the effect guard (default: the app's)")
@click.option("--interval", type=Positive(float), default=5.0, metavar="S", help="seconds between sweeps (5)")
@click.option("--limit", type=Positive(int), default=100, metavar="N", help="sagas per sweep (100)")
@click.option(
    "--lease", type=Positive(float), default=60.0, metavar="S", help="seconds a worker holds a saga (60)"
)
@click.option(
    "--max-recoveries",
    type=int,
    default=5,
    metavar="N",
    help="take-overs before a saga needs attention (5; -1: no cap)",
)
@click.option("--once", is_flag=True, help="one sweep, print its report, exit")
@where
def worker(
    *,
    app: str,
    guard_ref: str | None,
    interval: float,
    limit: int,
    lease: float,
    max_recoveries: int,
    once: bool,
    store: str | None,
    journal: str | None,
) -> None:
    """Run the recovery sweeper until SIGINT/SIGTERM.

    Every --interval seconds, continue sagas whose runner is gone and waiting sagas whose signal,
    deadline or cancellation came. Any number of workers may run at once.
    """

    def body() -> None:
        url = saga_url(store, journal)
        with opened_journal(url, create=not once) as opened:
            registry = _registry(app)
            guard = _guard(app, guard_ref, url)
            cap = max_recoveries if max_recoveries >= 0 else None
            options: dict[str, Any] = {"interval": interval, "limit": limit, "lease": lease}
            if once:
                sweep_once(opened, guard, registry, max_recoveries=cap, **options)
                return
            click.echo(f"{PROG}: sagas worker running for {registry!r}; stop with Ctrl-C or SIGTERM")
            sys.stdout.flush()
            run_worker(opened, guard, registry, max_recoveries=cap, **options)
            click.echo(f"{PROG}: sagas worker stopped")

    run(body)


def main(argv: list[str] | None = None) -> int:
    """Run the ``sagaguard`` command line (``sagas ...`` and the rest); returns the exit status.

    Args:
        argv: the arguments after the program name, starting with ``sagas``.
    """
    from sagaguard.idempotency.cli import main as root

    return root(argv)


# The actions (signal, cancel, retry, resolve, reject) add themselves to the group.
from sagaguard.saga import cli_actions  # noqa: E402, F401

if __name__ == "__main__":
    sys.exit(main())
