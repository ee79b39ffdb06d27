"""outbox 0001: the outbox table of the first versioned release (layout 2, with ``dedup_key``).

Adopts a table made before versioned schemas (layout 1 or 2, its version once recorded in
``sagaguard_schema``, which is left in place): creates what is missing, adds ``dedup_key`` and its
partial unique index, and on Postgres (re)creates the NOTIFY trigger and sets the fillfactor. A
new database never runs this: it is created at the current layout and stamped. A later revision
changes the layout with ``alembic.op`` and must leave this one creating layout 2.
"""

from alembic import context, op

from sagaguard.idempotency.outbox.model import adopt_outbox_table

revision = "outbox_0001"
down_revision = None
branch_labels = ("outbox",)
depends_on = None


def upgrade() -> None:
    """Bring a table made before versioned schemas to layout 2."""
    adopt_outbox_table(op.get_bind(), context.config.attributes["sagaguard_name"])


def downgrade() -> None:
    """Not supported: sagaguard's tables are never migrated down (records would be lost)."""
    raise NotImplementedError("sagaguard does not migrate its tables down")
