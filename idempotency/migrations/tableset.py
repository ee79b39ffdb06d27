"""A table set: the SQL tables one sagaguard component keeps, and where their migrations live.

Each component that owns SQL tables (the effect store, the outbox here; the saga journal in
``sagaguard.saga``; any later one) declares one :class:`TableSet` and registers it under the
entry-point group :data:`ENTRY_POINT_GROUP`. ``sagaguard db`` and the stores find them there, so
this package never imports the packages above it (imports flow connectors -> saga -> idempotency).

A table set's tables are named by one configured value (the effect store's ``table_name``, the
journal's ``table_prefix``); its schema revision is recorded in an Alembic version table of its
own, named after that value, so several stores under other names share one database, each with
its own revision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import sqlalchemy as sa

from sagaguard.idempotency.errors import ConfigurationError

__all__ = ["ENTRY_POINT_GROUP", "TableSet", "table_sets"]

ENTRY_POINT_GROUP = "sagaguard.schemas"
"""Entry-point group of the :class:`TableSet` objects ``sagaguard db`` migrates (``name = "module:ATTR"``)."""


@dataclass(frozen=True)
class TableSet:
    """The SQL tables of one component and their Alembic migrations.

    The migrations are the revision files in :attr:`versions`, one linear history whose first
    revision carries the branch label :attr:`name`. A revision reads the configured name from
    ``alembic.context.config.attributes["sagaguard_name"]``.
    """

    name: str
    """Short name: ``effects``, ``journal``, ``outbox`` (also the ``sagaguard db`` option's stem and
    the Alembic branch label)."""
    what: str
    """What the tables hold, for messages (``effect records``)."""
    parameter: str
    """What the configured value is (``table`` or ``prefix``): ``sagaguard db`` takes it as
    ``--{name}-{parameter}``."""
    default: str
    """The configured value unless told otherwise."""
    head: str
    """The revision this code's tables are at (a test checks it is the head of :attr:`versions`)."""
    versions: Path
    """The folder of the revision files."""
    version_table: str
    """The Alembic version table's name, a format string of ``{name}`` (the configured value)."""
    tables: Callable[[str], Sequence[sa.Table]]
    """The tables for a configured value (validates it: raises ConfigurationError)."""
    create: Callable[[sa.Connection, str], None]
    """Create the tables at this code's layout where they are missing (a new database)."""

    def version_table_for(self, value: str) -> str:
        """The version table for the configured ``value`` (checked by :attr:`tables`)."""
        self.tables(value)
        return self.version_table.format(name=value)

    def option(self) -> str:
        """The ``sagaguard db`` option naming the configured value: ``--effects-table``."""
        return f"--{self.name}-{self.parameter}"


def table_sets() -> list[TableSet]:
    """The table sets registered under :data:`ENTRY_POINT_GROUP`, by name.

    A set whose module does not import (an optional part not installed) is left out.

    Raises:
        ConfigurationError: an entry point names something that is not a TableSet.
    """
    found: dict[str, TableSet] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            value = entry.load()
        except ImportError:
            continue
        if not isinstance(value, TableSet):
            raise ConfigurationError(f"entry point {entry.name!r} of {ENTRY_POINT_GROUP} is not a TableSet")
        found[value.name] = value
    return [found[name] for name in sorted(found)]
