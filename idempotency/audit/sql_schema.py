"""The audit table: its SQLModel class, in the metadata that holds sagaguard's other tables.

One row per operator action (:class:`~sagaguard.idempotency.audit.records.AuditEntry`), with an
index on ``(target, at)`` for a saga's timeline and one on ``at`` for the newest-first listing.
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa
from sqlmodel import Field

from sagaguard.idempotency.stores.sql_schema import METADATA, _SagaguardModel

__all__ = ["AUDIT_TABLE", "METADATA", "SCHEMA_VERSION", "AuditRow"]

SCHEMA_VERSION: Final = 1
"""Version of the audit table layout."""

AUDIT_TABLE: Final = "sagaguard_audit"
"""The audit table's name."""


class AuditRow(_SagaguardModel, table=True):
    """The audit table, ``sagaguard_audit``: args is the JSON text of the entry's arguments."""

    __tablename__ = AUDIT_TABLE
    __table_args__ = (
        sa.Index(f"ix_{AUDIT_TABLE}_target", "target", "at"),
        sa.Index(f"ix_{AUDIT_TABLE}_at", "at"),
    )

    id: int | None = Field(
        default=None, primary_key=True, sa_type=sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    )
    at: float = Field(sa_type=sa.Double)
    actor: str = Field(sa_type=sa.Text)
    action: str = Field(max_length=64)
    kind: str = Field(max_length=16)
    target: str = Field(sa_type=sa.Text)
    args: str = Field(sa_type=sa.Text)
    outcome: str = Field(max_length=16)
    error: str | None = Field(default=None, sa_type=sa.Text)
    message: str | None = Field(default=None, sa_type=sa.Text)
    source: str = Field(max_length=16)
