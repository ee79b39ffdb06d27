"""The ``effects`` table set: the effect store's table (:mod:`sagaguard.idempotency.stores.sql`).

Its revisions are the files of this folder; its version table is ``{table_name}_version``.
"""

from pathlib import Path

from sagaguard.idempotency.migrations.tableset import TableSet
from sagaguard.idempotency.stores.sql_schema import DEFAULT_TABLE, create_effects_table, effects_tables

__all__ = ["TABLE_SET"]

TABLE_SET = TableSet(
    name="effects",
    what="effect store",
    parameter="table",
    default=DEFAULT_TABLE,
    head="effects_0003",
    versions=Path(__file__).parent,
    version_table="{name}_version",
    tables=effects_tables,
    create=create_effects_table,
)
"""The effect store's tables and migrations."""
