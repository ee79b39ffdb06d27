"""effects 0003: the ``result_type`` column, the declared result type each claim records.

An operator's ``effects resolve --applied --result`` is checked against it
(:mod:`sagaguard.idempotency.result_types`). Records written before it have none and are resolved
as before (any JSON; MCP calls by their name). A nullable text column: adding it rewrites no row
on SQLite or Postgres. Idempotent: a table that already has the column (one ``effects_0001``
created from the current model) is left as it is.
"""

from alembic import context, op

from sagaguard.idempotency.stores.sql_schema import add_missing_columns

revision = "effects_0003"
down_revision = "effects_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add ``result_type`` to the effects table where missing."""
    name = context.config.attributes["sagaguard_name"]
    add_missing_columns(op.get_bind(), name, ("result_type",))


def downgrade() -> None:
    """Not supported: sagaguard's tables are never migrated down (records would be lost)."""
    raise NotImplementedError("sagaguard does not migrate its tables down")
