"""The ledger table: one row holding the effect store's ledger id (``{table_name}_ledger``).

The id enters every provider key derived for the store's records
(:func:`~sagaguard.idempotency.keys.provider_key`). A new database gets a fresh id when its tables
are created; a database upgraded by the ``effects_0002`` revision gets the empty id (the keys it
always derived), so a record in doubt from before the upgrade is re-sent under its first key.
"""

from __future__ import annotations

import threading

import sqlalchemy as sa

from sagaguard.idempotency.keys import LEGACY_LEDGER, check_ledger_id, new_ledger_id
from sagaguard.idempotency.stores.sql_schema import METADATA, effect_model

__all__ = ["ledger_table", "read_or_insert", "store_ledger_id"]

_SLOT = 1
"""The one row's key: a table of one row whose primary key makes a second insert a conflict."""
_lock = threading.Lock()


def ledger_table(table_name: str) -> sa.Table:
    """The ledger table of the effects table ``table_name`` (built once on sagaguard's metadata).

    Raises:
        ConfigurationError: the name is not a valid effects table name.
    """
    effect_model(table_name)  # validates the name
    name = f"{table_name}_ledger"
    with _lock:
        found = METADATA.tables.get(name)
        if found is None:
            found = sa.Table(
                name, METADATA,
                sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
                sa.Column("ledger_id", sa.Text, nullable=False),
            )  # fmt: skip
        return found


def store_ledger_id(conn: sa.Connection, table_name: str, ledger: str) -> str:
    """Insert ``ledger`` as the ledger id unless one is kept already; return the kept one.

    Insert-if-absent then read back, so concurrent first opens agree on one id.
    """
    table = ledger_table(table_name)
    quoted = conn.dialect.identifier_preparer.quote(table.name)
    conn.execute(
        sa.text(
            f"INSERT INTO {quoted} (slot, ledger_id) VALUES (:slot, :ledger) ON CONFLICT (slot) DO NOTHING"
        ),
        {"slot": _SLOT, "ledger": check_ledger_id(ledger)},
    )
    kept = conn.execute(
        sa.text(f"SELECT ledger_id FROM {quoted} WHERE slot = :slot"), {"slot": _SLOT}
    ).scalar_one()
    return check_ledger_id(kept)


def read_or_insert(conn: sa.Connection, table_name: str) -> str:
    """The kept ledger id; where none is kept (the row was deleted), the one a ledger gets that
    holds records (the empty id) or, when it holds none, a fresh one.

    Raises:
        ConfigurationError: the kept id is malformed (written by hand).
    """
    table = ledger_table(table_name)
    quoted = conn.dialect.identifier_preparer.quote(table.name)
    kept = conn.execute(
        sa.text(f"SELECT ledger_id FROM {quoted} WHERE slot = :slot"), {"slot": _SLOT}
    ).first()
    if kept is not None:
        return check_ledger_id(kept[0])
    records = conn.dialect.identifier_preparer.quote(table_name)
    held = conn.execute(sa.text(f"SELECT 1 FROM {records} LIMIT 1")).first() is not None
    return store_ledger_id(conn, table_name, LEGACY_LEDGER if held else new_ledger_id())
