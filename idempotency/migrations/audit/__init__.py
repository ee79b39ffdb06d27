"""The ``audit`` table set: the operators' audit trail (:mod:`sagaguard.idempotency.audit`).

Its revisions are the files of this folder; its version table is ``{table_name}_version``. The
table is named after the effects table it sits beside (``sagaguard db upgrade --effects-table
shop_effects --audit-table shop_audit``; see :func:`~sagaguard.idempotency.audit.sql_schema.audit_table_for`).
"""

from pathlib import Path

from sagaguard.idempotency.audit.sql_schema import DEFAULT_TABLE, audit_tables, create_audit_table
from sagaguard.idempotency.migrations.tableset import TableSet

__all__ = ["TABLE_SET"]

TABLE_SET = TableSet(
    name="audit",
    what="audit trail",
    parameter="table",
    default=DEFAULT_TABLE,
    head="audit_0001",
    versions=Path(__file__).parent,
    version_table="{name}_version",
    tables=audit_tables,
    create=create_audit_table,
)
"""The audit trail's table and migrations."""
