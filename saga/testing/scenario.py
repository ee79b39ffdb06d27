"""What a child runs and where it keeps it: scenario factories named ``module:attr`` and the
:class:`Storage` its journal and store live in.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga.definition import Saga
from sagaguard.saga.journal import SagaJournal


@dataclass(frozen=True, slots=True)
class Scenario:
    """What a scenario factory returns: the saga to run and its input."""

    saga: Saga[Any]
    input: Any


ScenarioFactory = Callable[[Guard, Mapping[str, str]], Scenario]
"""``factory(guard, params) -> Scenario``: declares the saga's effects on ``guard``."""


def load_factory(ref: str) -> ScenarioFactory:
    """Import the scenario factory ``module:attr``.

    Raises:
        ValueError: ``ref`` is not ``module:attr`` or does not name a callable.
    """
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"a scenario is named module:attr, not {ref!r}")
    found = getattr(importlib.import_module(module_name), attr, None)
    if not callable(found):
        raise ValueError(f"{ref} is not a callable scenario factory")
    factory: ScenarioFactory = found
    return factory


@dataclass(frozen=True, slots=True)
class Storage:
    """Where a child keeps its journal and its effect store (both must outlive the child).

    Attributes:
        journal_url: a SQLite file or Postgres URL for :class:`~sagaguard.saga.journals.sql.SqlJournal`.
        store_url: the same for :class:`~sagaguard.idempotency.stores.sql.SqlStore` (or any ``open_store``
            URL when ``store_table`` is None).
        journal_prefix: the journal's table prefix.
        store_table: the store's table name; None opens ``store_url`` with ``open_store``.
    """

    journal_url: str
    store_url: str
    journal_prefix: str = "sagaguard_"
    store_table: str | None = "sagaguard_effects"

    @classmethod
    def sqlite(cls, path: str | os.PathLike[str]) -> Storage:
        """Journal and store in one SQLite file."""
        url = f"sqlite:///{Path(path).resolve()}"
        return cls(url, url)

    def journal(self) -> SagaJournal:
        """Open the journal (tables are created when missing)."""
        from sagaguard.saga.journals.sql import SqlJournal

        return SqlJournal(self.journal_url, table_prefix=self.journal_prefix)

    def store(self) -> IdempotencyStore:
        """Open the store (tables are created when missing)."""
        if self.store_table is None:
            from sagaguard.idempotency.stores import open_store

            return open_store(self.store_url)
        from sagaguard.idempotency.stores.sql import SqlStore

        return SqlStore(self.store_url, table_name=self.store_table)

    def args(self) -> list[str]:
        """The child's command-line arguments for this storage."""
        out = [
            "--journal",
            self.journal_url,
            "--journal-prefix",
            self.journal_prefix,
            "--store",
            self.store_url,
        ]
        if self.store_table is not None:
            out += ["--store-table", self.store_table]
        return out
