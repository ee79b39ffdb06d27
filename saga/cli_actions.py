"""The actions of ``sagaguard sagas``: signal, cancel, retry, resolve, reject, one saga or many.

Each calls :mod:`sagaguard.saga.operator`, which records it in the ledger's audit trail under
``--actor`` (default: the OS user). ``cancel``, ``retry`` and ``reject`` also act on every saga of
a list (``--all``, with the console's lists and filters: :mod:`sagaguard.saga.console.data`): they
show how many and which with ``--dry-run``, ask before acting unless ``--yes``, and act once per
action id (:mod:`sagaguard.idempotency.bulk`, shared with the console's bulk forms).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import click

from sagaguard.idempotency.audit import AuditLog, open_audit
from sagaguard.idempotency.bulk import MAX_ITEMS, run_bulk
from sagaguard.idempotency.cliopts import (
    EXIT_FAILED,
    EXIT_USAGE,
    CliError,
    actor_option,
    bulk_options,
    confirm_bulk,
    echo_json,
    json_option,
)
from sagaguard.idempotency.cliopts import actor as actor_name
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.saga.cli import age_options, opened_journal, run, saga_url, sagas, where
from sagaguard.saga.console.data import SAGA_LISTS, saga_page
from sagaguard.saga.errors import SagaError
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.operator import cancel_saga, reject_run, retry_saga, signal_saga, skip_compensation

__all__: list[str] = []


@contextlib.contextmanager
def _audit_log(url: str) -> Iterator[AuditLog]:
    """The audit log on the store URL, closed afterwards."""
    log = open_audit(url)
    try:
        yield log
    finally:
        log.close()


def _who(actor: str | None, log: AuditLog) -> dict[str, Any]:
    """The audit keywords of an operator action from the CLI."""
    return {"actor": actor_name(actor), "audit": log, "source": "cli"}


@sagas.command()
@click.argument("saga_id")
@click.argument("name")
@click.option("--payload", metavar="JSON", help="the payload as JSON (default: null)")
@actor_option
@where
def signal(
    *, saga_id: str, name: str, payload: str | None, actor: str | None, store: str | None, journal: str | None
) -> None:
    """Deliver a signal to a saga (a waiting saga resumes).

    The signal is recorded durably; a saga waiting for it is resumed by the next recovery sweep
    (sagaguard sagas worker). Each name is delivered once per saga.
    """

    def body() -> int:
        try:
            value = None if payload is None else json.loads(payload)
        except ValueError as exc:
            raise CliError(f"--payload is not valid JSON: {exc}", EXIT_USAGE) from None
        url = saga_url(store, journal)
        with opened_journal(url) as opened, _audit_log(url) as log:
            outcome = signal_saga(opened, saga_id, name, value, **_who(actor, log))
        click.echo(f"signal {name!r} to saga {saga_id!r}: {outcome.value}")
        return EXIT_FAILED if outcome.value == "too_late" else 0

    run(body)


@sagas.command()
@click.argument("saga_id")
@click.argument("step")
@click.option("--note", default="resolved by an operator", help="recorded on the step")
@actor_option
@where
def resolve(
    *, saga_id: str, step: str, note: str, actor: str | None, store: str | None, journal: str | None
) -> None:
    """Mark a step's failed compensation as done by hand, then compensate on.

    The step counts as compensated (with your note); the compensations of the steps before it run
    at the next recovery sweep.
    """

    def body() -> None:
        url = saga_url(store, journal)
        with opened_journal(url) as opened, _audit_log(url) as log:
            record = skip_compensation(opened, saga_id, step, note=note, **_who(actor, log))
        click.echo(
            f"resolve step {step!r} of saga {saga_id!r}: {record.state.value}, due now "
            "(the worker runs the remaining compensations)"
        )

    run(body)


Act = Callable[[SagaJournal, str, AuditLog], str]
"""One saga's action: returns its outcome word."""


def _filters(default: str) -> Callable[[Any], Any]:
    """``--state LIST``, ``--prefix``, ``--name``, ``--older`` and ``--newer`` of a bulk action over
    sagas."""

    def add(f: Any) -> Any:
        f = age_options(f)
        f = click.option(
            "--name", "name_prefix", default="", metavar="N", help="with --all: only sagas named N..."
        )(f)
        f = click.option(
            "--prefix", default="", metavar="P", help="with --all: only saga ids starting with P"
        )(f)
        return click.option(
            "--state",
            "view",
            default=default,
            type=click.Choice(sorted(SAGA_LISTS)),
            help=f"with --all: the list to act on, as the console lists them (default {default})",
        )(f)

    return add


def _act(
    *,
    action: str,
    verb: str,
    noun: str = "saga",
    saga_id: str | None,
    act: Act,
    fixed: dict[str, Any],
    store: str | None,
    journal: str | None,
    actor: str | None,
    all_: bool,
    dry_run: bool,
    yes: bool,
    action_id: str | None,
    view: str,
    prefix: str,
    name_prefix: str,
    older: float | None,
    newer: float | None,
    as_json: bool,
    extra_set: bool,
) -> None:
    """One saga's action, or with ``all_`` the bulk action over the list ``view``."""
    if all_ == (saga_id is not None):
        raise click.UsageError("give a SAGA_ID or --all")
    if not all_ and (dry_run or yes or action_id or prefix or name_prefix or extra_set or older or newer):
        raise click.UsageError(
            "--state, --prefix, --name, --older, --newer, --dry-run, --yes and --action-id go with --all"
        )

    def one() -> int:
        url = saga_url(store, journal)
        with opened_journal(url) as opened, _audit_log(url) as log:
            outcome = act(opened, saga_id or "", log)
        click.echo(f"{verb} {noun} {saga_id!r}: {outcome}")
        return EXIT_FAILED if outcome.startswith("too_late") else 0

    def every() -> None:
        url = saga_url(store, journal)
        with opened_journal(url) as opened:
            ids = [
                r.saga_id
                for r in saga_page(
                    opened,
                    view,
                    prefix=prefix,
                    name=name_prefix,
                    size=MAX_ITEMS + 1,
                    older=older,
                    newer=newer,
                ).items
            ]
            acting = confirm_bulk(
                ids, what="sagas", verb=verb, dry_run=dry_run, yes=yes, action_id=action_id, as_json=as_json
            )
            if acting is None:
                return
            with _audit_log(url) as log:
                done = run_bulk(
                    log,
                    action,
                    acting,
                    ids,
                    lambda target: act(opened, target, log),
                    actor=actor_name(actor),
                    source="cli",
                    at=opened.now(),
                    refusals=(ConfigurationError, IdempotencyError, SagaError),
                    args={**fixed, "list": view, "prefix": prefix, "name": name_prefix},
                )
        report_bulk(done.to_json(), as_json)

    run(every if all_ else one)


def report_bulk(done: dict[str, Any], as_json: bool) -> None:
    """Print what a bulk action did (:meth:`~sagaguard.idempotency.bulk.BulkResult.to_json`)."""
    if as_json:
        echo_json(done)
        return
    if done["repeated"]:
        click.echo(f"action {done['action_id']} was done already: nothing done again")
        return
    click.echo(f"action {done['action_id']}: {done['done']} done, {done['refused']} refused")
    for target, outcome in done["outcomes"].items():
        click.echo(f"  {target}: {outcome}")
    for target, error in done["refusals"].items():
        click.echo(f"  {target}: refused ({error})")


def _view_set() -> bool:
    ctx = click.get_current_context()
    return ctx.get_parameter_source("view") is not click.core.ParameterSource.DEFAULT


@sagas.command()
@click.argument("saga_id", required=False)
@click.option("--reason", default="cancelled by an operator", help="recorded as the cause")
@_filters("running")
@bulk_options
@actor_option
@json_option
@where
def cancel(*, saga_id: str | None, reason: str, actor: str | None, **common: Any) -> None:
    """Undo a saga (or with --all, every saga of a list) that has not reached its pivot.

    The saga is asked to stop and run its compensations: its runner does at its next step boundary;
    a waiting saga, or one nobody holds, the next recovery sweep.
    """

    def act(journal: SagaJournal, target: str, log: AuditLog) -> str:
        return cancel_saga(journal, target, reason=reason, **_who(actor, log)).value

    _act(
        action="saga.cancel",
        verb="cancel",
        saga_id=saga_id,
        act=act,
        fixed={"reason": reason},
        actor=actor,
        extra_set=_view_set(),
        **common,
    )


@sagas.command()
@click.argument("saga_id", required=False)
@click.option(
    "--fresh",
    is_flag=True,
    help="run a failed compensation under a new attempt key: its effects are sent again under "
    "new keys instead of replaying what they recorded (a refusal included)",
)
@_filters("needs_attention")
@bulk_options
@actor_option
@json_option
@where
def retry(*, saga_id: str | None, fresh: bool, actor: str | None, **common: Any) -> None:
    """Try again what made a saga (or with --all, every saga of a list) need attention.

    A failed compensation is due again (the saga compensates on); a step after the pivot that ran
    out of retries runs again. The next recovery sweep continues the saga.
    """

    def act(journal: SagaJournal, target: str, log: AuditLog) -> str:
        record = retry_saga(journal, target, fresh=fresh, **_who(actor, log))
        return f"{record.state.value}, due now (the worker continues it)"

    _act(
        action="saga.retry",
        verb="retry",
        saga_id=saga_id,
        act=act,
        fixed={"fresh": fresh},
        actor=actor,
        extra_set=_view_set(),
        **common,
    )


@sagas.command()
@click.argument("saga_id", required=False, metavar="RUN_ID")
@click.option("--reason", default="rejected", help="recorded as the cause")
@_filters("waiting")
@bulk_options
@actor_option
@json_option
@where
def reject(*, saga_id: str | None, reason: str, actor: str | None, **common: Any) -> None:
    """Reject an agent run waiting at an approval (or with --all, every run of a list).

    The run is cancelled with the cause 'rejected'; the next recovery sweep undoes its tool calls
    in reverse order.
    """

    def act(journal: SagaJournal, target: str, log: AuditLog) -> str:
        outcome = reject_run(journal, target, reason=reason, **_who(actor, log)).value
        return f"{outcome} (the worker undoes its tool calls)"

    _act(
        action="saga.reject",
        verb="reject",
        noun="run",
        saga_id=saga_id,
        act=act,
        fixed={"reason": reason},
        actor=actor,
        extra_set=_view_set(),
        **common,
    )
