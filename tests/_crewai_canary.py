"""A module whose import leaves a mark: the CrewAI answer tests check stored data never imports it."""

import os
from pathlib import Path

from pydantic import BaseModel

_MARK = os.environ.get("SAGAGUARD_CANARY_FILE")
if _MARK:
    Path(_MARK).write_text("imported")


class Planted(BaseModel):
    """The type a forged ledger record names."""

    value: str = ""
