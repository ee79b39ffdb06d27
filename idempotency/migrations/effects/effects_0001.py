"""effects 0001: the effects table of the first versioned release (layout 2, with ``holder``).

Adopts a table made before versioned schemas: creates the table and its indexes where missing and
adds ``holder`` to a table made by layout 1. A new database never runs this: it is created at the
current layout and stamped. A later revision changes the layout with ``alembic.op`` and must leave
this one creating layout 2 (copy the columns here before changing the model).
"""

from alembic import context, op

from sagaguard.idempotency.stores.sql_schema import add_missing_columns, create_records_table

revision = "effects_0001"
down_revision = None
branch_labels = ("effects",)
depends_on = None


def upgrade() -> None:
    """Bring a table made before versioned schemas to layout 2."""
    name = context.config.attributes["sagaguard_name"]
    conn = op.get_bind()
    create_records_table(conn, name)
    add_missing_columns(conn, name, ("holder",))


def downgrade() -> None:
    """Not supported: sagaguard's tables are never migrated down (records would be lost)."""
    raise NotImplementedError("sagaguard does not migrate its tables down")
