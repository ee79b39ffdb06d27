"""Alembic's environment for sagaguard's table sets (run by ``alembic.command``; see runner.py).

The connection, its open transaction, the version table and the configured table name or prefix
come in ``config.attributes``: the migrations run inside the caller's transaction (and, on
Postgres, under its advisory lock), so an upgrade commits whole or not at all.
"""

from alembic import context

_config = context.config
context.configure(
    connection=_config.attributes["connection"],
    version_table=_config.attributes["version_table"],
)
with context.begin_transaction():
    context.run_migrations()
