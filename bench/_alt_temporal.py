"""The Temporal workflow of bench/alternatives.py: one named activity run ``count`` times in a row.

Temporal's workflow sandbox re-imports this module, so it imports only temporalio and the standard
library; the activities are called by name (bench/_alt_subjects.py defines them).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

NOOP, CHARGE = "bench_noop", "bench_charge"
"""The activities' names."""


@workflow.defn(name="bench_activities_in_a_row")
class ActivitiesInARow:
    """``count`` activities one after the other, each awaited before the next is scheduled (the
    shape of a saga's steps); returns their results."""

    @workflow.run
    async def run(self, activity: str, count: int, key: str) -> list[str]:
        done: list[str] = []
        for k in range(count):
            done.append(
                await workflow.execute_activity(
                    activity, f"{key}-{k}", start_to_close_timeout=timedelta(seconds=60), result_type=str
                )
            )
        return done
