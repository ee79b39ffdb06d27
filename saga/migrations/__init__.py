"""The ``journal`` table set: the SQL saga journal's tables (:mod:`sagaguard.saga.journals.sql`).

Contributed from the saga side (entry point ``sagaguard.schemas``), since the idempotency layer
never imports this package. Its revisions are the files of this folder; its version table is
``{prefix}journal_version``.
"""

from pathlib import Path

from sagaguard.idempotency.migrations import TableSet
from sagaguard.saga.journals.sql_schema import DEFAULT_PREFIX, create_journal_tables, journal_tables

__all__ = ["TABLE_SET"]

TABLE_SET = TableSet(
    name="journal",
    what="saga journal",
    parameter="prefix",
    default=DEFAULT_PREFIX,
    head="journal_0002",
    versions=Path(__file__).parent,
    version_table="{name}journal_version",
    tables=journal_tables,
    create=create_journal_tables,
)
"""The saga journal's tables and migrations."""
