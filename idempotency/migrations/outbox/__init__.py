"""The ``outbox`` table set: the transactional outbox's table (:mod:`sagaguard.idempotency.outbox`).

Its revisions are the files of this folder; its version table is ``{table_name}_version``.
"""

from pathlib import Path

from sagaguard.idempotency.migrations.tableset import TableSet
from sagaguard.idempotency.outbox.model import DEFAULT_TABLE, create_outbox_table, outbox_tables

__all__ = ["TABLE_SET"]

TABLE_SET = TableSet(
    name="outbox",
    what="outbox",
    parameter="table",
    default=DEFAULT_TABLE,
    head="outbox_0001",
    versions=Path(__file__).parent,
    version_table="{name}_version",
    tables=outbox_tables,
    create=create_outbox_table,
)
"""The outbox's table and migrations."""
