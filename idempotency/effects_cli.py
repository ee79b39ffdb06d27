"""``sagaguard effects``: list, show, resolve and purge effect records.

::

    sagaguard effects list [--state STATE ...] [--namespace NS] [--limit N] [--json]
    sagaguard effects show KEY [--json]
    sagaguard effects resolve KEY (--applied --result JSON | --not-applied) [--force] [--actor NAME]
    sagaguard effects resolve --all --not-applied [--state STATE ...] [--prefix P] [--namespace NS]
                              [--dry-run] [--yes] [--action-id ID] [--force] [--actor NAME] [--json]
    sagaguard effects purge [--page N]

Every command takes ``--store URL`` (else ``$SAGAGUARD_STORE``, else ``sqlite:///sagaguard.db``). A
KEY may be given in full or as any unique prefix (the table prints 16 characters).

Exit status: 0 done; 1 the store refused or failed (no such record, lost ownership, store
unreachable), or a confirmation was declined; 2 bad usage or configuration (unknown URL scheme,
``--applied`` without ``--result``, bad ``--result`` JSON or a result of another shape than the
effect's, ``--all`` without ``--yes`` when stdin is not a terminal). Expected errors are one line
on stderr, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import click

from sagaguard.idempotency.audit import open_audit
from sagaguard.idempotency.backends.urls import masked
from sagaguard.idempotency.bulk import run_bulk
from sagaguard.idempotency.cliopts import (
    EXIT_USAGE,
    CliError,
    Positive,
    actor_option,
    bulk_options,
    confirm_bulk,
    echo_json,
    json_option,
    run,
    store_option,
    store_url,
)
from sagaguard.idempotency.cliopts import actor as actor_name
from sagaguard.idempotency.cliutil import install_hint, open_existing_store
from sagaguard.idempotency.effects_view import SHORT_KEY, record_json, show_record, table
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError, RecordNotFound
from sagaguard.idempotency.operator import (
    AmbiguousKey,
    EffectBusy,
    OperatorRefused,
    find_effect,
    needs_resolution,
    resolve_effect,
    result_json,
)
from sagaguard.idempotency.records import Record, State
from sagaguard.idempotency.store import IdempotencyStore

__all__ = ["ORDER", "effects", "record_json"]

DAY = 86_400.0
ORDER = (State.IN_DOUBT, State.IN_PROGRESS, State.FAILED, State.SUCCEEDED)
"""The listing order: what needs an operator first."""
_LIVE = (State.IN_DOUBT, State.IN_PROGRESS)
_PAGE = 500

ResultCheck = Callable[[Any], object]
"""A check of ``effects resolve --result`` that raises ``ValueError`` for another shape."""

result_checks: list[Callable[[str], ResultCheck | None]] = []
"""Where ``effects resolve`` finds the result check of an effect by its name (the root CLI adds the
plugins' ``RESULT_SHAPES`` here)."""


def _collect(
    store: IdempotencyStore, states: Sequence[State], namespace: str | None, limit: int, prefix: str = ""
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
            found.extend(r for r in page if _matches(r, prefix))
            if len(page) < _PAGE:
                break
            after = page[-1].key
        if state in _LIVE:
            found.sort(key=lambda r: (r.created_at, r.key))
        chosen.extend(found[: limit - len(chosen)])
    return chosen


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


@contextlib.contextmanager
def _opened(url: str | None) -> Iterator[IdempotencyStore]:
    store = _open(store_url(url))
    try:
        yield store
    finally:
        with contextlib.suppress(IdempotencyError):
            store.close()


def _find(store: IdempotencyStore, key: str) -> Record:
    """The record under ``key``, or the one record whose key starts with it."""
    try:
        return find_effect(store, key)
    except AmbiguousKey as exc:
        raise CliError(str(exc)) from None


@click.group(no_args_is_help=True)
def effects() -> None:
    """List, show, resolve and purge effect records."""


_STATES = click.Choice([s.value for s in ORDER])


@effects.command("list")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=_STATES,
    metavar="STATE",
    help="only these states (in_doubt, in_progress, succeeded, failed); repeatable",
)
@click.option("--namespace", metavar="NS", help="only this namespace (tenant)")
@click.option("--prefix", default="", metavar="P", help="only keys, scopes or effect names starting with P")
@click.option("--limit", type=Positive(int), default=100, metavar="N", help="at most N records (default 100)")
@json_option
@store_option
def list_(
    *,
    states: tuple[str, ...],
    namespace: str | None,
    prefix: str,
    limit: int,
    as_json: bool,
    store: str | None,
) -> None:
    """List records: in-doubt first, then in-progress, failed, succeeded.

    In-doubt and in-progress records are listed oldest first; finished ones by key.
    """

    def body() -> None:
        with _opened(store) as opened:
            chosen = [State(s) for s in states] if states else list(ORDER)
            records = _collect(opened, chosen, namespace, limit, prefix)
            if as_json:
                echo_json([record_json(r) for r in records])
            elif not records:
                click.echo("no effect records" + (" in these states" if states else ""))
            else:
                table(records, opened.now())
                if len(records) >= limit:
                    click.echo(f"(first {limit}; raise --limit for more)")

    run(body)


@effects.command()
@click.argument("key")
@json_option
@store_option
def show(*, key: str, as_json: bool, store: str | None) -> None:
    """One record in full (KEY: the effect key or a unique prefix of it)."""

    def body() -> None:
        with _opened(store) as opened:
            record = _find(opened, key)
            if as_json:
                echo_json(record_json(record))
            else:
                show_record(record, opened.now(), opened.ledger_id())

    run(body)


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


def _check_shape(record: Record, result: str) -> None:
    """The connectors' name-based checks, for records that name no result type (written before
    types were recorded); a record that names one is checked against it by ``resolve_effect``."""
    if record.result_type is not None:
        return
    for finder in result_checks:
        check = finder(record.name)
        if check is None:
            continue
        try:
            check(json.loads(result or "null"))
        except ValueError as exc:
            raise CliError(
                f"--result is not the shape effect {record.name!r} records: {exc}", EXIT_USAGE
            ) from None
        return


@effects.command()
@click.argument("key", required=False)
@click.option("--applied", is_flag=True, help="the effect happened")
@click.option("--not-applied", is_flag=True, help="the effect did not happen")
@click.option(
    "--result",
    metavar="JSON",
    help="with --applied (required): the effect's result as JSON, as its return type stores it "
    "(null for an effect that returns nothing); checked against the result type the record "
    "names (a record that names none: the connector's shape, MCP calls only)",
)
@click.option(
    "--retention",
    type=Positive(float),
    default=7 * DAY,
    metavar="SECONDS",
    help="with --applied: how long the result is kept and replayed (default: 7 days)",
)
@click.option("--force", is_flag=True, help="resolve even though a worker's lease is still live")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice(["in_doubt", "in_progress"]),
    metavar="STATE",
    help="with --all: only these states (default: in_doubt and in_progress past its lease)",
)
@click.option(
    "--prefix", default="", metavar="P", help="with --all: only keys, scopes or names starting with P"
)
@click.option("--namespace", metavar="NS", help="with --all: only this namespace (tenant)")
@bulk_options
@actor_option
@json_option
@store_option
def resolve(
    *,
    key: str | None,
    applied: bool,
    not_applied: bool,
    result: str | None,
    retention: float,
    force: bool,
    states: tuple[str, ...],
    prefix: str,
    namespace: str | None,
    all_: bool,
    dry_run: bool,
    yes: bool,
    action_id: str | None,
    actor: str | None,
    as_json: bool,
    store: str | None,
) -> None:
    """Settle an effect left IN_DOUBT (or IN_PROGRESS past its lease) after checking the outside world.

    --applied records it as SUCCEEDED with --result, which every later run replays; --not-applied
    removes it, so the next run executes the effect. With --all (and --not-applied), every record
    the filters match, as one audited bulk action.
    """
    if applied == not_applied:
        raise click.UsageError("give one of --applied and --not-applied")
    if all_ == (key is not None):
        raise click.UsageError("give a KEY or --all")
    if all_ and applied:
        raise click.UsageError(
            "--all resolves as --not-applied only: an applied effect needs its own --result"
        )
    if not all_ and (dry_run or yes or action_id or states or prefix or namespace):
        raise click.UsageError(
            "--state, --prefix, --namespace, --dry-run, --yes and --action-id go with --all"
        )
    if all_:
        run(
            lambda: _resolve_all(
                store,
                states,
                prefix,
                namespace,
                force=force,
                dry_run=dry_run,
                yes=yes,
                action_id=action_id,
                who=actor,
                as_json=as_json,
            )
        )
    else:
        run(
            lambda: _resolve_one(
                url=store,
                key=key or "",
                applied=applied,
                result=result,
                retention=retention,
                force=force,
                who=actor,
            )
        )


def _resolve_one(
    *,
    url: str | None,
    key: str,
    applied: bool,
    result: str | None,
    retention: float,
    force: bool,
    who: str | None,
) -> None:
    if result is not None and not applied:
        raise CliError("--result goes with --applied", EXIT_USAGE)
    text = _result_text(result) if applied else None
    with _opened(url) as store:
        record = _find(store, key)
        short = record.key[:SHORT_KEY]
        if text is not None:
            _check_shape(record, text)
        audit = open_audit(store_url(url))
        try:
            resolve_effect(
                store,
                record.key,
                applied=text is not None,
                result=text,
                retention=retention,
                force=force,
                token=record.token,
                actor=actor_name(who),
                audit=audit,
                source="cli",
            )
        except EffectBusy as exc:
            raise CliError(f"{exc} (--force)") from exc
        finally:
            audit.close()
    if text is not None:
        click.echo(f"resolved {record.name!r} ({short}) as applied: later runs replay the recorded result")
    else:
        click.echo(
            f"resolved {record.name!r} ({short}) as not applied: the record is removed and the next run "
            "executes the effect"
        )


def _matches(record: Record, prefix: str) -> bool:
    return any(text.startswith(prefix) for text in (record.key, record.scope, record.name))


def _resolve_all(
    url: str | None,
    states: Sequence[str],
    prefix: str,
    namespace: str | None,
    *,
    force: bool,
    dry_run: bool,
    yes: bool,
    action_id: str | None,
    who: str | None,
    as_json: bool,
) -> None:
    with _opened(url) as store:
        now = store.now()
        chosen = [State(s) for s in states] if states else list(_LIVE)
        found = _collect(store, chosen, namespace, limit=10**9, prefix=prefix)
        keys = [r.key for r in found if force or needs_resolution(r, now)]
        acting = confirm_bulk(
            keys,
            what="effects",
            verb="resolve as not applied",
            dry_run=dry_run,
            yes=yes,
            action_id=action_id,
            as_json=as_json,
        )
        if acting is None:
            return
        audit = open_audit(store_url(url))

        def one(target: str) -> str:
            resolve_effect(
                store, target, applied=False, force=force, actor=actor_name(who), audit=audit, source="cli"
            )
            return "not_applied"

        try:
            done = run_bulk(
                audit,
                "effect.resolve",
                acting,
                keys,
                one,
                actor=actor_name(who),
                source="cli",
                at=now,
                refusals=(OperatorRefused, RecordNotFound),
                args={"verdict": "not_applied", "prefix": prefix},
            )
        finally:
            audit.close()
    _report_bulk(done.to_json(), as_json)


def _report_bulk(done: dict[str, Any], as_json: bool) -> None:
    if as_json:
        echo_json(done)
        return
    if done["repeated"]:
        click.echo(f"action {done['action_id']} was done already: nothing done again")
        return
    click.echo(f"action {done['action_id']}: {done['done']} done, {done['refused']} refused")
    for target, error in done["refusals"].items():
        click.echo(f"  refused {target}: {error}")


@effects.command()
@click.option("--page", type=Positive(int), default=1000, metavar="N", help="records per page (default 1000)")
@store_option
def purge(*, page: int, store: str | None) -> None:
    """Delete finished records past their retention, in pages.

    IN_PROGRESS and IN_DOUBT records are never deleted.
    """

    def body() -> None:
        with _opened(store) as opened:
            total = pages = 0
            while True:
                deleted = opened.purge(limit=page)
                total += deleted
                pages += 1
                if deleted:
                    click.echo(f"page {pages}: purged {deleted} (total {total})")
                    sys.stdout.flush()  # each page shows as it is done
                if deleted < page:
                    break
        click.echo(f"purged {total} expired record{'' if total == 1 else 's'}")

    run(body)
