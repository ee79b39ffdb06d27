"""``sagaguard``: the operator's command line, one click command tree.

::

    sagaguard [--store URL] effects list|show|resolve|purge ...
    sagaguard [--store URL] audit [...]
    sagaguard [--store URL] sagas|outbox|relay|db|llm|mcp|ui ...   (found through entry points)
    sagaguard demo [ARGS ...]

The store is ``--store`` (on the root or on the command), else ``$SAGAGUARD_STORE``, else
``sqlite:///sagaguard.db``. The commands of the packages above this one (``sagas``, ``llm``,
``mcp``, ``ui``) and of the outbox and the migrations are click commands registered under the
entry-point group :data:`PLUGIN_GROUP`, so this package never imports the packages above it
(imports flow connectors -> saga -> idempotency). Shell completion is click's:
``eval "$(_SAGAGUARD_COMPLETE=bash_source sagaguard)"``.

Exit status: 0 done; 1 the store refused or failed, or a confirmation was declined; 2 bad usage or
configuration; 130 interrupted. Expected errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import Any

import click

from sagaguard.idempotency.audit_cli import audit
from sagaguard.idempotency.cliopts import EXIT_FAILED, EXIT_OK, EXIT_USAGE, PROG, store_option
from sagaguard.idempotency.effects_cli import effects, result_checks

__all__ = ["DEMO_GROUP", "PLUGIN_GROUP", "RESULT_SHAPES", "cli", "main"]

PLUGIN_GROUP = "sagaguard.commands"
"""Entry-point group of the click commands the root finds (``sagaguard.saga.cli:sagas``, ...).

Each entry point names a click command (a group, usually) under its command name. They are found
through the installed distribution's entry points, so this package never imports the packages
above it; a command whose optional extra is not installed is absent."""

RESULT_SHAPES = "RESULT_SHAPES"
"""The attribute of a command's module (:data:`PLUGIN_GROUP`) that declares the result shapes of
its connector's effects: a mapping of an effect-name prefix (``"mcp."``) to a check that raises
``ValueError`` (saying what is expected) for a ``--result`` value of another shape."""

DEMO_GROUP = "sagaguard.demo"
"""Entry-point group of the demos (``sagaguard.connectors.demo``: the trip-booking saga, and
``sagaguard.connectors.demo.small``), found without importing the packages above this one."""

SMALL_DEMO = "small"
"""The entry point of the small demo (a guarded charge, a SIGKILL, a restart), which needs no extra."""


def _plugin(name: str) -> click.Command | None:
    """The command registered as ``name`` under :data:`PLUGIN_GROUP`, or None: none is, or its
    optional extra is not installed (the command is then absent). Only that one is imported."""
    for entry in entry_points(group=PLUGIN_GROUP, name=name):
        try:
            command = entry.load()
        except ImportError:
            return None
        if isinstance(command, click.Command):
            return command
    return None


def _result_check(name: str) -> Callable[[Any], object] | None:
    """The check of ``effects resolve --result`` for the effect ``name``, or None."""
    for entry in entry_points(group=PLUGIN_GROUP):
        try:
            module = importlib.import_module(entry.module)
        except ImportError:
            continue
        for prefix, check in (getattr(module, RESULT_SHAPES, None) or {}).items():
            if name.startswith(prefix):
                return check  # type: ignore[no-any-return]
    return None


result_checks.append(_result_check)


class _Root(click.Group):
    """The root group: its own commands, then those found through :data:`PLUGIN_GROUP`."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every command name, sorted (a plugged-in one whose extra is missing is left out of the
        help, which loads each)."""
        return sorted({*super().list_commands(ctx), *(e.name for e in entry_points(group=PLUGIN_GROUP))})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The command ``cmd_name``: the root's own, else the plugged-in one of that name."""
        return super().get_command(ctx, cmd_name) or _plugin(cmd_name)


def _version() -> str:
    """The installed distribution's version (pyproject.toml is its one source)."""
    try:
        return version("sagaguard")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


@click.group(cls=_Root, context_settings={"help_option_names": ["-h", "--help"]}, no_args_is_help=True)
@click.version_option(_version(), "--version", prog_name=PROG, message="%(prog)s %(version)s")
@store_option
def cli(store: str | None) -> None:
    """Operate sagaguard's ledger: effects, sagas, the outbox, the audit trail, the schema.

    Exit status: 0 done, 1 the store refused or failed (or a confirmation was declined), 2 bad
    usage or configuration, 130 interrupted.
    """


cli.add_command(effects)
cli.add_command(audit)


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def demo(ctx: click.Context, args: tuple[str, ...]) -> None:
    """Run the demo (arguments go to the demo; try: sagaguard demo --help).

    The trip-booking demo when installed, else the small demo (a guarded charge, a SIGKILL, a
    restart); ``--small``, or a ``--store``, which only the small demo takes, runs the small one.
    A ``--store`` given before ``demo`` is passed on as the demo's.
    """
    rest = list(args)
    root_store = ctx.find_root().params.get("store")
    has_store = any(a == "--store" or a.startswith("--store=") for a in rest)
    if root_store and not has_store:
        rest = ["--store", root_store, *rest]
    ctx.exit(_run_demo(rest))


def _run_demo(args: list[str]) -> int:
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
        click.echo(f"{PROG}: the demo is not part of this installation", err=True)
        return EXIT_FAILED
    return int(demos[SMALL_DEMO].load()(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (for ``python -m`` and for tests).

    Args:
        argv: the arguments without the program name (default: ``sys.argv[1:]``).
    """
    try:
        cli.main(args=list(sys.argv[1:] if argv is None else argv), prog_name=PROG)
    except SystemExit as exc:
        if exc.code is None:
            return EXIT_OK
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    return EXIT_OK
