"""journal 0002: the sagas' redundant state index dropped; room left on Postgres pages (layout 5).

The sagas table had two indexes led by ``state``: ``ix_{prefix}sagas_state`` and the due index
``(state, lease_until)``. Every write that moved a saga wrote an entry into both; the due index
alone serves the recovery sweep and a listing by state. On Postgres, the sagas and steps tables
get ``fillfactor`` 70 (:data:`~sagaguard.saga.journals.sql_schema.FILLFACTOR`): pages written from
then on keep room for the few updates a saga's rows get soon after they are written, as heap-only
tuples. Neither change rewrites a row. Idempotent: a database without the index is left as it is.
"""

from alembic import context, op

from sagaguard.saga.journals.sql_schema import FILLFACTOR

revision = "journal_0002"
down_revision = "journal_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Drop the state index where it exists; on Postgres, set the two tables' fillfactor."""
    prefix = context.config.attributes["sagaguard_name"]
    op.drop_index(f"ix_{prefix}sagas_state", table_name=f"{prefix}sagas", if_exists=True)
    if op.get_bind().dialect.name == "postgresql":
        for table in (f"{prefix}sagas", f"{prefix}saga_steps"):
            op.execute(f'ALTER TABLE "{table}" SET (fillfactor = {FILLFACTOR})')


def downgrade() -> None:
    """Not supported: sagaguard's tables are never migrated down (records would be lost)."""
    raise NotImplementedError("sagaguard does not migrate its tables down")
