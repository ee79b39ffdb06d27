"""Versioned schemas: a store that refuses tables not yet created, the upgrade, where it stands."""

import os
import tempfile

from sagaguard.idempotency.errors import SchemaVersionMismatch
from sagaguard.idempotency.migrations import schema_status, table_sets, upgrade_schema
from sagaguard.idempotency.stores.sql import SqlStore, make_engine

url = os.environ.get("SAGAGUARD_STORE", "")
if not url.startswith(("sqlite", "postgresql")):  # the tables need a SQL database
    url = f"sqlite:///{tempfile.mkdtemp()}/schema.db"
names = {"effects": "example_effects"}  # a configured table name, as SqlStore(table_name=...)

try:  # a service with DML rights only: create=False writes no DDL
    SqlStore(url, create=False, table_name="example_effects").close()
except SchemaVersionMismatch as exc:
    print(f"refused ({exc.state}): run {exc.command}")

engine = make_engine(url)
for table_set in table_sets():  # what `sagaguard db upgrade --effects-table example_effects` does
    before = upgrade_schema(engine, table_set, names.get(table_set.name))
    print(f"{table_set.name}: was {before.state}, now at {table_set.head}")
for status in schema_status(engine, table_sets(), names):  # `sagaguard db status`
    print(status.table_set, status.name, status.current, status.state)
engine.dispose()

store = SqlStore(url, create=False, table_name="example_effects")  # opens now
store.close()
