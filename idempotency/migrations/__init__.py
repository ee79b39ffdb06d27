"""Versioned schemas: the SQL table sets, where a database stands, and upgrading it (Alembic).

::

    from sagaguard.idempotency.migrations import schema_status, table_sets, upgrade_schema

    for table_set in table_sets():          # audit, effects, journal, outbox (entry points)
        upgrade_schema(engine, table_set)   # or: sagaguard db upgrade --store URL
    schema_status(engine, table_sets())     # or: sagaguard db status --store URL

See ``docs/upgrading.md``.
"""

from sagaguard.idempotency.migrations.runner import (
    SchemaState,
    SchemaStatus,
    alembic_config,
    ensure_schema,
    schema_status,
    upgrade_schema,
)
from sagaguard.idempotency.migrations.tableset import ENTRY_POINT_GROUP, TableSet, table_sets

__all__ = [
    "ENTRY_POINT_GROUP",
    "SchemaState",
    "SchemaStatus",
    "TableSet",
    "alembic_config",
    "ensure_schema",
    "schema_status",
    "table_sets",
    "upgrade_schema",
]
