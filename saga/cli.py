"""``sagaguard sagas``: the operator's commands for saga instances.

::

    sagaguard sagas list [--state STATE ...] [--limit N] [--json]
    sagaguard sagas show SAGA_ID [--json]
    sagaguard sagas signal SAGA_ID NAME [--payload JSON]
    sagaguard sagas cancel SAGA_ID [--reason TEXT]
    sagaguard sagas retry SAGA_ID [--fresh]
    sagaguard sagas resolve SAGA_ID STEP [--note TEXT]
    sagaguard sagas reject RUN_ID [--reason TEXT]
    sagaguard sagas worker --app MODULE:ATTR [--guard MODULE:ATTR] [--interval S] [--once] ...

The store is the one every ``sagaguard`` command uses: ``--store`` (before ``sagas`` or after its
action), else ``$SAGAGUARD_STORE``, else ``sqlite:///sagaguard.db``; it holds the saga journal and
the worker's guard. ``--journal`` and ``$SAGAGUARD_JOURNAL`` are deprecated aliases (a warning on
stderr). Every command but ``worker`` opens it without creating anything: a SQLite file or saga
table that does not exist is an error naming the URL, never an empty database. The worker imports
the saga definitions it may run from ``--app`` (a :class:`~sagaguard.saga.registry.SagaRegistry`, one saga, a
list of sagas, or a function returning one) and uses the module's ``guard`` (or ``--guard``, or a
guard on ``--store``) for compensations.

:func:`add_commands` adds ``sagas`` to another CLI's sub-parsers (the ``sagaguard`` command); the
parsed namespace carries ``saga_command``, which :func:`run` dispatches. :func:`main` runs the
commands on their own (``python -m sagaguard.saga.cli``).

The actions (signal, cancel, retry, resolve, reject) go through :mod:`sagaguard.saga.operator` and
are recorded in the ledger's audit trail under ``--actor`` (default: the OS user); ``sagas show``
lists the actions recorded on the saga, and ``sagaguard audit`` all of them.

Exit status: 0 done; 1 the journal refused or failed (no such saga, unreachable); 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

from sagaguard.idempotency.audit import AuditEntry, AuditFilter, AuditLog, default_actor, open_audit
from sagaguard.idempotency.backends.urls import check_url, masked
from sagaguard.idempotency.cliutil import duration, install_hint, piped, positive, require_schema
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.stores import open_store
from sagaguard.saga.agent.call import ToolCall
from sagaguard.saga.agent.definition import tool_outcomes
from sagaguard.saga.decisions import CallOutcome
from sagaguard.saga.definition import Saga
from sagaguard.saga.errors import SagaError, SagaNotFound
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.journals import DEFAULT_URL, open_journal
from sagaguard.saga.operator import cancel_saga, reject_run, retry_saga, signal_saga, skip_compensation
from sagaguard.saga.records import (
    FOREVER,
    RESUMABLE_STATES,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    StepRecord,
    StepState,
)
from sagaguard.saga.recovery import RecoveryReport, RecoveryWorker, run_worker
from sagaguard.saga.registry import SagaRegistry, as_registry
from sagaguard.saga.timeline import timeline

__all__ = ["add_commands", "main", "run"]

PROG = "sagaguard"
ENV_JOURNAL = "SAGAGUARD_JOURNAL"
ENV_STORE = "SAGAGUARD_STORE"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
ORDER = (
    SagaState.NEEDS_ATTENTION, SagaState.COMPENSATING, SagaState.RUNNING, SagaState.WAITING,
    SagaState.FAILED, SagaState.COMPENSATED, SagaState.COMPLETED,
)  # fmt: skip
"""The listing order: what needs an operator first."""


class CliError(Exception):
    """An expected failure: printed as one line, exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def add_commands(subparsers: Any) -> None:
    """Add ``sagas`` (list, show, signal, cancel, retry, resolve, reject, worker) to ``subparsers``.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--store",
        metavar="URL",
        default=argparse.SUPPRESS,
        help=f"the store holding the sagas (default: ${ENV_STORE}, else {DEFAULT_URL})",
    )
    where.add_argument(
        "--journal", metavar="URL", default=argparse.SUPPRESS, help="deprecated alias of --store"
    )
    who = argparse.ArgumentParser(add_help=False)
    who.add_argument(
        "--actor", metavar="NAME", help="who acts, as the audit trail records it (default: the OS user)"
    )
    sagas = subparsers.add_parser("sagas", help="list, inspect, signal, cancel and recover sagas")
    sagas.set_defaults(saga_command=None, saga_parser=sagas)
    actions = sagas.add_subparsers(dest="saga_action", metavar="ACTION")

    listing = actions.add_parser("list", parents=[where], help="list sagas, those needing attention first")
    listing.add_argument(
        "--state",
        dest="states",
        action="extend",
        nargs="+",
        choices=[s.value for s in ORDER],
        metavar="STATE",
        help="only these states; repeatable",
    )
    listing.add_argument("--limit", type=positive(int), default=100, metavar="N", help="at most N (100)")
    listing.add_argument("--json", action="store_true", help="the saga rows as a JSON array")
    listing.set_defaults(saga_command=cmd_list)

    show = actions.add_parser("show", parents=[where], help="one saga with its steps and signals")
    show.add_argument("saga_id", metavar="SAGA_ID")
    show.add_argument("--json", action="store_true", help="as a JSON object")
    show.set_defaults(saga_command=cmd_show)

    sig = actions.add_parser(
        "signal",
        parents=[where, who],
        help="deliver a signal to a saga (a waiting saga resumes)",
        description="Record the signal durably; a saga waiting for it is resumed by the next "
        "recovery sweep (sagaguard sagas worker). Each name is delivered once per saga.",
    )
    sig.add_argument("saga_id", metavar="SAGA_ID")
    sig.add_argument("name", metavar="NAME", help="the signal's name")
    sig.add_argument("--payload", metavar="JSON", help="the payload as JSON (default: null)")
    sig.set_defaults(saga_command=cmd_signal)

    stop = actions.add_parser(
        "cancel",
        parents=[where, who],
        help="undo a saga that has not reached its pivot",
        description="Ask the saga to stop and run its compensations: its runner does at its next "
        "step boundary; a waiting saga, or one nobody holds, the next recovery sweep.",
    )
    stop.add_argument("saga_id", metavar="SAGA_ID")
    stop.add_argument("--reason", default="cancelled by an operator", help="recorded as the cause")
    stop.set_defaults(saga_command=cmd_cancel)

    again = actions.add_parser(
        "retry",
        parents=[where, who],
        help="try again what made a saga need attention",
        description="A failed compensation is due again (the saga compensates on); a step after "
        "the pivot that ran out of retries runs again. The next recovery sweep continues the saga.",
    )
    again.add_argument("saga_id", metavar="SAGA_ID")
    again.add_argument(
        "--fresh",
        action="store_true",
        help="run a failed compensation under a new attempt key: its effects are sent again under "
        "new keys instead of replaying what they recorded (a refusal included)",
    )
    again.set_defaults(saga_command=cmd_retry)

    settle = actions.add_parser(
        "resolve",
        parents=[where, who],
        help="mark a step's failed compensation as done by hand, then compensate on",
        description="The step counts as compensated (with your note); the compensations of the "
        "steps before it run at the next recovery sweep.",
    )
    settle.add_argument("saga_id", metavar="SAGA_ID")
    settle.add_argument("step", metavar="STEP", help="the step whose compensation failed")
    settle.add_argument("--note", default="resolved by an operator", help="recorded on the step")
    settle.set_defaults(saga_command=cmd_resolve)

    refuse = actions.add_parser(
        "reject",
        parents=[where, who],
        help="reject an agent run waiting at an approval (its tool calls are undone)",
        description="The run is cancelled with the cause 'rejected'; the next recovery sweep undoes "
        "its tool calls in reverse order.",
    )
    refuse.add_argument("saga_id", metavar="RUN_ID")
    refuse.add_argument("--reason", default="rejected", help="recorded as the cause")
    refuse.set_defaults(saga_command=cmd_reject)

    worker = actions.add_parser(
        "worker",
        parents=[where],
        help="run the recovery sweeper until SIGINT/SIGTERM",
        description="Every --interval seconds, continue sagas whose runner is gone and waiting sagas "
        "whose signal, deadline or cancellation came. Any number of workers may run at once.",
    )
    worker.add_argument("--app", required=True, metavar="MODULE:ATTR", help="the saga definitions")
    worker.add_argument("--guard", metavar="MODULE:ATTR", help="the effect guard (default: the app's)")
    worker.add_argument(
        "--interval", type=positive(float), default=5.0, metavar="S", help="seconds between sweeps (5)"
    )
    worker.add_argument("--limit", type=positive(int), default=100, metavar="N", help="sagas per sweep (100)")
    worker.add_argument(
        "--lease", type=positive(float), default=60.0, metavar="S", help="seconds a worker holds a saga (60)"
    )
    worker.add_argument(
        "--max-recoveries",
        type=int,
        default=5,
        metavar="N",
        help="take-overs before a saga needs attention (5; -1: no cap)",
    )
    worker.add_argument("--once", action="store_true", help="one sweep, print its report, exit")
    worker.set_defaults(saga_command=cmd_worker)


# ------------------------------------------------------------------------------------ output


def _due(record: SagaRecord, now: float) -> str:
    """The lease left (running) or the wake-up (waiting)."""
    if record.state not in RESUMABLE_STATES:
        return "-"
    if record.lease_until >= FOREVER:
        return "never"
    if record.lease_until <= now:
        return "due now"
    return f"in {duration(record.lease_until - now)}"


def record_json(record: SagaRecord) -> dict[str, Any]:
    """A saga row as plain JSON types (``input`` and ``error`` stay the JSON text the journal holds)."""
    data = dataclasses.asdict(record)
    data["state"] = record.state.value
    return data


def _table(records: Sequence[SagaRecord], now: float, out: TextIO) -> None:
    header = ("SAGA ID", "NAME", "VER", "STATE", "TOKEN", "RECOV", "WAITING FOR", "NEXT", "AGE")
    rows = [
        (
            r.saga_id if len(r.saga_id) <= 36 else r.saga_id[:33] + "...",
            r.name[:24],
            str(r.version),
            r.state.value + (" (cancel)" if r.cancel_requested and r.state in RESUMABLE_STATES else ""),
            str(r.token),
            str(r.recoveries),
            (r.waiting_for or "-") if r.state is SagaState.WAITING else "-",
            _due(r, now),
            duration(now - r.created_at),
        )
        for r in records
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)


def _pretty(text: str | None) -> str:
    if text is None:
        return "-"
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def _outcomes(args: argparse.Namespace, snapshot: SagaSnapshot) -> dict[int, CallOutcome]:
    """What an agent run's tool calls did, from the ledger on the same store URL; empty for a
    saga without tool calls, or when the ledger cannot be read (the rows then say what they know)."""
    if not any(ToolCall.of_row(row) is not None for row in snapshot.steps):
        return {}
    try:
        store = open_store(store_url(args))
    except Exception:  # the journal alone still shows the saga
        return {}
    try:
        return tool_outcomes(Guard(store), snapshot)
    except Exception:
        return {}
    finally:
        store.close()


def _step_state(row: StepRecord, outcome: CallOutcome | None) -> str:
    """A step's state as ``sagas show`` lists it: a tool call's real outcome where it is known."""
    if outcome is None or row.state is StepState.COMPENSATION_FAILED:
        return row.state.value
    if row.state is StepState.COMPENSATED:
        return CallOutcome.UNDONE.value
    return outcome.value


def _show(
    snapshot: SagaSnapshot, now: float, out: TextIO, outcomes: Mapping[int, CallOutcome] | None = None,
    audit: Sequence[AuditEntry] = (),
) -> None:
    r = snapshot.saga
    fields = [
        ("saga id", r.saga_id),
        ("saga", f"{r.name} v{r.version}"),
        ("state", r.state.value),
        ("token", str(r.token)),
        ("recoveries", str(r.recoveries)),
        ("next", _due(r, now)),
        ("deadline", "-" if r.deadline <= 0 else duration(r.deadline - now) + " left"),
        ("waiting for", r.waiting_for if r.state is SagaState.WAITING and r.waiting_for else "-"),
        ("cancel", "requested" if r.cancel_requested else "-"),
        ("created", f"{duration(now - r.created_at)} ago"),
        ("updated", f"{duration(now - r.updated_at)} ago"),
    ]
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        print(f"{name.ljust(width)}  {value}", file=out)
    print("steps:", file=out)
    found = outcomes or {}
    for row in snapshot.steps:
        extra = " (not applied)" if row.not_applied else ""
        state = _step_state(row, found.get(row.index))
        print(f"  {row.index}. {row.name} [{row.kind.value}] {state}{extra}", file=out)
    if snapshot.signals:
        print(f"signals: {', '.join(sorted(snapshot.signals))}", file=out)
    print("timeline:", file=out)
    for event in timeline(snapshot, found, audit):
        print(f"  {event}", file=out)
    if r.error is not None:
        print("error:", file=out)
        for line in _pretty(r.error).splitlines():
            print(f"  {line}", file=out)


# ---------------------------------------------------------------------------------- commands


def store_url(args: argparse.Namespace) -> str:
    """The one store URL: ``--store``, else ``$SAGAGUARD_STORE``, else the default; the deprecated
    ``--journal`` / ``$SAGAGUARD_JOURNAL`` only when neither of the first two is given.

    Raises:
        CliError: ``--store`` and ``--journal`` name different URLs.
    """
    flag, alias = getattr(args, "store", None), getattr(args, "journal", None)
    if alias is not None:
        print(f"{PROG}: --journal is deprecated: use --store", file=sys.stderr)
        if flag is not None and flag != alias:
            raise CliError("--store and the deprecated --journal name different URLs", EXIT_USAGE)
    if flag or alias:
        return str(flag or alias)
    if os.environ.get(ENV_STORE):
        return os.environ[ENV_STORE]
    if os.environ.get(ENV_JOURNAL):
        print(f"{PROG}: ${ENV_JOURNAL} is deprecated: use ${ENV_STORE}", file=sys.stderr)
        return os.environ[ENV_JOURNAL]
    return DEFAULT_URL


def _journal(args: argparse.Namespace) -> SagaJournal:
    """The journal on the store URL. Only the long-running worker may create its tables; every
    other command (``worker --once`` too: one sweep of an empty database has nothing to do) opens it
    as it is, so a mistyped URL is an error naming it rather than an empty journal."""
    url = store_url(args)
    creates = getattr(args, "saga_command", None) is cmd_worker and not getattr(args, "once", False)
    try:
        scheme = check_url(url, what="store")
        if scheme not in ("sqlite", "postgresql") or creates:
            return open_journal(url)
        from sagaguard.saga.journals.sql import SqlJournal
        from sagaguard.saga.journals.sql_schema import DEFAULT_PREFIX, journal_models

        tables = [str(model.__tablename__) for model in journal_models(DEFAULT_PREFIX)]
        require_schema(url, tables, what="sagas")
        return SqlJournal(url, create=False)
    except ModuleNotFoundError as exc:
        hint = install_hint(exc)
        raise CliError(f"the store {masked(url)!r} needs the {exc.name!r} package{hint}", EXIT_USAGE) from exc


def cmd_list(journal: SagaJournal, args: argparse.Namespace, out: TextIO) -> int:
    """``sagas list``."""
    states = [SagaState(s) for s in args.states] if args.states else list(ORDER)
    records: list[SagaRecord] = []
    for state in (s for s in ORDER if s in states):
        if len(records) < args.limit:
            records.extend(journal.list(states=[state], limit=args.limit - len(records)))
    if args.json:
        json.dump([record_json(r) for r in records], out, indent=2, ensure_ascii=False)
        print(file=out)
    elif not records:
        print("no sagas" + (" in these states" if args.states else ""), file=out)
    else:
        _table(records, journal.now(), out)
    return EXIT_OK


def cmd_show(journal: SagaJournal, args: argparse.Namespace, out: TextIO) -> int:
    """``sagas show``."""
    snapshot = journal.load(args.saga_id)
    if snapshot is None:
        raise SagaNotFound(args.saga_id)
    if args.json:
        data = record_json(snapshot.saga)
        outcomes = _outcomes(args, snapshot)
        data["steps"] = [
            {
                **dataclasses.asdict(s), "kind": s.kind.value, "state": s.state.value,
                "outcome": _step_state(s, outcomes.get(s.index)) if s.index in outcomes else None,
            }
            for s in snapshot.steps
        ]  # fmt: skip
        data["signals"] = dict(snapshot.signals)
        data["audit"] = [entry.to_json() for entry in _audit_entries(args, args.saga_id)]
        json.dump(data, out, indent=2, ensure_ascii=False)
        print(file=out)
    else:
        _show(snapshot, journal.now(), out, _outcomes(args, snapshot), _audit_entries(args, args.saga_id))
    return EXIT_OK


def cmd_signal(journal: SagaJournal, args: argparse.Namespace, out: TextIO) -> int:
    """``sagas signal``."""
    try:
        payload = None if args.payload is None else json.loads(args.payload)
    except ValueError as exc:
        raise CliError(f"--payload is not valid JSON: {exc}", EXIT_USAGE) from None
    with _audit_log(args) as log:
        outcome = signal_saga(journal, args.saga_id, args.name, payload, **_who(args, log))
    print(f"signal {args.name!r} to saga {args.saga_id!r}: {outcome.value}", file=out)
    return EXIT_OK if outcome.value != "too_late" else EXIT_FAILED


def cmd_cancel(journal: SagaJournal, args: argparse.Namespace, out: TextIO) -> int:
    """``sagas cancel``."""
    with _audit_log(args) as log:
        outcome = cancel_saga(journal, args.saga_id, reason=args.reason, **_who(args, log))
    print(f"cancel saga {args.saga_id!r}: {outcome.value}", file=out)
    return EXIT_OK if outcome.value != "too_late" else EXIT_FAILED


def cmd_retry(journal: SagaJournal, args: argparse.Namespace, out: TextIO) -> int:
    """``sagas retry``."""
    with _audit_log(args) as log:
        record = retry_saga(journal, args.saga_id, fresh=args.fresh, **_who(args, log))
    print(f"retry saga {args.saga_id!r}: {record.state.value}, due now (the worker continues it)", file=out)
    return EXIT_OK


def cmd_resolve(journal: SagaJournal, args: argparse.Namespace, out: TextIO) -> int:
    """``sagas resolve``."""
    with _audit_log(args) as log:
        record = skip_compensation(journal, args.saga_id, args.step, note=args.note, **_who(args, log))
    print(
        f"resolve step {args.step!r} of saga {args.saga_id!r}: {record.state.value}, due now "
        "(the worker runs the remaining compensations)",
        file=out,
    )
    return EXIT_OK


def cmd_reject(journal: SagaJournal, args: argparse.Namespace, out: TextIO) -> int:
    """``sagas reject``."""
    with _audit_log(args) as log:
        outcome = reject_run(journal, args.saga_id, reason=args.reason, **_who(args, log))
    print(f"reject run {args.saga_id!r}: {outcome.value} (the worker undoes its tool calls)", file=out)
    return EXIT_OK if outcome.value != "too_late" else EXIT_FAILED


@contextlib.contextmanager
def _audit_log(args: argparse.Namespace) -> Iterator[AuditLog]:
    """The audit log on the store URL, closed afterwards."""
    log = open_audit(store_url(args))
    try:
        yield log
    finally:
        log.close()


def _who(args: argparse.Namespace, log: AuditLog) -> dict[str, Any]:
    """The audit keywords of an operator action from the CLI."""
    return {"actor": getattr(args, "actor", None) or default_actor(), "audit": log, "source": "cli"}


def _audit_entries(args: argparse.Namespace, saga_id: str) -> list[AuditEntry]:
    """The audit entries on ``saga_id``, oldest first; none when the audit cannot be read."""
    try:
        log = open_audit(store_url(args), create=False)
    except (IdempotencyError, ConfigurationError):
        return []
    try:
        return list(reversed(log.list(AuditFilter(target=saga_id), limit=200)))
    except IdempotencyError:
        return []
    finally:
        log.close()


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


def _guard(args: argparse.Namespace) -> Guard:
    if args.guard:
        found = _import(args.guard)
    else:
        found = getattr(importlib.import_module(args.app.partition(":")[0]), "guard", None)
    if isinstance(found, Guard):
        return found
    if args.guard:
        raise CliError(f"{args.guard!r} is not a Guard", EXIT_USAGE)
    return Guard(open_store(store_url(args)))


def _print_report(report: RecoveryReport, out: TextIO) -> None:
    print(
        f"{report.found} due, {len(report.outcomes)} driven, {len(report.lost)} taken by others, "
        f"{len(report.skipped)} skipped, {len(report.errors)} failed",
        file=out,
    )
    for saga_id, outcome in report.outcomes.items():
        print(f"  {saga_id}: {outcome.state.value}", file=out)
    for saga_id, reason in {**report.skipped, **report.errors}.items():
        print(f"  {saga_id}: {reason}", file=out)


def cmd_worker(journal: SagaJournal, args: argparse.Namespace, out: TextIO) -> int:
    """``sagas worker``."""
    registry = _registry(args.app)
    guard = _guard(args)
    max_recoveries = args.max_recoveries if args.max_recoveries >= 0 else None
    options: dict[str, Any] = {"interval": args.interval, "limit": args.limit, "lease": args.lease}
    if args.once:
        worker = RecoveryWorker(journal, guard, registry, max_recoveries=max_recoveries, **options)
        try:
            _print_report(worker.run_once(), out)
        finally:
            worker.runner.close()
        return EXIT_OK
    print(f"{PROG}: sagas worker running for {registry!r}; stop with Ctrl-C or SIGTERM", file=out, flush=True)
    run_worker(journal, guard, registry, max_recoveries=max_recoveries, **options)
    print(f"{PROG}: sagas worker stopped", file=out)
    return EXIT_OK


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the ``sagas`` command that ``args`` (parsed with :func:`add_commands`) names."""
    command = getattr(args, "saga_command", None)
    if command is None:
        parser = getattr(args, "saga_parser", None)
        if parser is not None:
            parser.print_help(sys.stderr)
        return EXIT_USAGE
    out = out or sys.stdout
    journal: SagaJournal | None = None
    try:
        journal = _journal(args)
        return int(command(journal, args, out))
    except CliError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.code
    except ConfigurationError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (SagaError, IdempotencyError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        if journal is not None:
            with contextlib.suppress(SagaError):
                journal.close()


def main(argv: list[str] | None = None) -> int:
    """Run ``sagas ...`` on its own; returns the exit status.

    Args:
        argv: the arguments after the program name, starting with ``sagas``.
    """
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
