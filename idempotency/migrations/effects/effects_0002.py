"""effects 0002: the ledger table, holding the ledger id that enters every provider key.

A database upgraded here held effect records made when provider keys had no ledger id: its ledger
gets the empty id (:data:`~sagaguard.idempotency.keys.LEGACY_LEDGER`), stored explicitly, so every
key it derives stays the one its records were sent under (a record in doubt from before the
upgrade is re-sent under its first key, which the provider absorbs). A new database never runs
this: it is created at the current layout with a fresh id. docs/upgrading.md says how to give an
upgraded ledger an id of its own.
"""

from alembic import context, op

from sagaguard.idempotency.keys import LEGACY_LEDGER
from sagaguard.idempotency.stores.sql_ledger import ledger_table, store_ledger_id
from sagaguard.idempotency.stores.sql_schema import METADATA

revision = "effects_0002"
down_revision = "effects_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the ledger table where missing and keep the empty id in it, unless an id is kept."""
    name = context.config.attributes["sagaguard_name"]
    conn = op.get_bind()
    METADATA.create_all(conn, tables=[ledger_table(name)])
    store_ledger_id(conn, name, LEGACY_LEDGER)


def downgrade() -> None:
    """Not supported: sagaguard's tables are never migrated down (records would be lost)."""
    raise NotImplementedError("sagaguard does not migrate its tables down")
