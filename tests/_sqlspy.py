"""Helpers of the async-call tests on the SQL store (test_writes_now.py)."""

from __future__ import annotations

from typing import Any

from sagaguard.idempotency import Guard
from sagaguard.idempotency.stores.sql import SqlStore


class Spy(SqlStore):
    """The real store, counting the calls of the blocking forms (made only from a thread)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.blocking: list[str] = []

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        self.blocking.append("claim")
        return super().claim(*args, **kwargs)

    def complete(self, *args: Any, **kwargs: Any) -> Any:
        self.blocking.append("complete")
        return super().complete(*args, **kwargs)


def charge_effect(guard: Guard, runs: list[int]) -> Any:
    """An async effect on ``guard`` that records each amount it runs with in ``runs``."""

    @guard.effect("pay.charge")
    async def charge(amount: int) -> int:
        runs.append(amount)
        return amount

    return charge
