"""Journal backends. The SQL journal imports SQLAlchemy only in its own module:
``from saga.journals.sql import SqlJournal``."""

from __future__ import annotations

from saga.journals.memory import MemoryJournal

__all__ = ["MemoryJournal"]
