"""audit 0001: the audit table of the first versioned release (layout 1).

Creates the table where missing (the previous release had none), and adopts one made before
versioned schemas (created at open by the console's first release): adds the partial unique index
on bulk action ids. A new database never runs this: it is created at the current layout and
stamped. A later revision changes the layout with ``alembic.op`` and must leave this one creating
layout 1.
"""

from alembic import context, op

from sagaguard.idempotency.audit.sql_schema import adopt_audit_table

revision = "audit_0001"
down_revision = None
branch_labels = ("audit",)
depends_on = None


def upgrade() -> None:
    """Create the audit table, or bring one made before versioned schemas to layout 1."""
    adopt_audit_table(op.get_bind(), context.config.attributes["sagaguard_name"])


def downgrade() -> None:
    """Not supported: sagaguard's tables are never migrated down (records would be lost)."""
    raise NotImplementedError("sagaguard does not migrate its tables down")
