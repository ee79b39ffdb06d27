"""journal 0001: the journal's tables of the first versioned release (layout 4).

Adopts tables made before versioned schemas: creates the tables and indexes that are missing (the
signals table came with layout 2) and adds the steps' ``trace`` and ``resolution`` (layout 3) and
the sagas' ``holder`` (layout 4) where they are missing. A new database never runs this: it is
created at the current layout and stamped. The tables it creates are this code's (later layouts
included), so every later revision must be idempotent over them (``journal_0002`` is).
"""

from alembic import context, op

from sagaguard.idempotency.stores.sql_schema import add_missing_columns
from sagaguard.saga.journals.sql_schema import create_journal_tables

revision = "journal_0001"
down_revision = None
branch_labels = ("journal",)
depends_on = None


def upgrade() -> None:
    """Bring tables made before versioned schemas to layout 4."""
    prefix = context.config.attributes["sagaguard_name"]
    conn = op.get_bind()
    create_journal_tables(conn, prefix)
    add_missing_columns(conn, f"{prefix}saga_steps", ("trace", "resolution"))
    add_missing_columns(conn, f"{prefix}sagas", ("holder",))


def downgrade() -> None:
    """Not supported: sagaguard's tables are never migrated down (records would be lost)."""
    raise NotImplementedError("sagaguard does not migrate its tables down")
