"""The trip agent as a Temporal workflow, run as a real worker process by tests/test_temporal_saga.py.

``python tests/_temporalsagachild.py ADDRESS QUEUE WORKFLOW_ID start`` runs a worker and starts
the workflow; ``... cancel`` starts it too and cancels it once the charge is recorded (it then
waits at an approval that never comes); ``... resume`` runs a worker (Temporal retries what a
killed worker left) and waits for the workflow. Each prints ``{"result": ...}`` or
``{"error": ...}`` as JSON on its last line. Sync activities, on the worker's thread pool.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from _enginesagaworld import DB, MODE, book_flight, book_hotel, charge, die_once, runner, trip_agent

    from sagaguard.connectors.declare import changes_world
    from sagaguard.connectors.frameworks.temporal_saga import TemporalSagaTools, run_agent
    from sagaguard.saga.journals import open_journal
    from sagaguard.saga.records import StepState

tools = TemporalSagaTools(runner(), trip_agent)
# A killed worker's activity is retried after this (tools do not heartbeat; the end activity does).
TOOL_TIMEOUT = timedelta(seconds=4)
RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_interval=timedelta(seconds=1))


@activity.defn
@tools.tool
@changes_world(undo="cancel_booking")
def book_hotel_activity(run: str, hotel: str) -> dict[str, Any]:
    return book_hotel(run, hotel)


@tools.tool(name="charge")
@changes_world(undo="refund")
def _charge(amount: int) -> dict[str, Any]:
    return charge(amount)


@activity.defn
def charge_activity(amount: int) -> dict[str, Any]:
    value = _charge(amount)
    die_once("after_charge")  # the tool's row is recorded, Temporal has not recorded the activity
    return value


@activity.defn
@tools.tool
def book_flight_activity(run: str) -> str:  # read-only: nothing to undo
    return book_flight(run)


@workflow.defn
class TripWorkflow:
    @workflow.run
    async def run(self, hotel: str, amount: int, wait: bool = False, parallel: bool = False) -> str:
        return await run_agent(
            trip_agent.name, lambda: self.trip(hotel, amount, wait, parallel), retry_policy=RETRY,
            heartbeat_timeout=timedelta(seconds=3),
        )  # fmt: skip

    async def trip(self, hotel: str, amount: int, wait: bool, parallel: bool) -> str:
        run = workflow.info().workflow_id
        options: Any = {"start_to_close_timeout": TOOL_TIMEOUT, "retry_policy": RETRY}
        book = workflow.execute_activity(book_hotel_activity, args=[run, hotel], **options)
        if parallel:  # two tool activities of one run at once, on the worker's thread pool
            await asyncio.gather(book, workflow.execute_activity(charge_activity, amount, **options))
        else:
            await book
            await workflow.execute_activity(charge_activity, amount, **options)
        if wait:  # an approval that never comes: the test cancels the workflow here
            await workflow.wait_condition(lambda: False)
        once = RetryPolicy(maximum_attempts=1)
        return await workflow.execute_activity(
            book_flight_activity, run, start_to_close_timeout=TOOL_TIMEOUT, retry_policy=once
        )


async def charged(run_id: str) -> None:
    """Wait until the run's charge is recorded (a condition, not a duration)."""
    journal = open_journal(DB)
    try:
        while True:
            found = journal.load(run_id)
            rows = [] if found is None else found.steps
            if any(row.name.startswith("tool.charge.") and row.state is StepState.SUCCEEDED for row in rows):
                return
            await asyncio.sleep(0.1)
    finally:
        journal.close()


async def main(address: str, queue: str, workflow_id: str, mode: str) -> int:
    client = await Client.connect(address)
    activities: list[Callable[..., Any]] = [
        book_hotel_activity,
        charge_activity,
        book_flight_activity,
        *tools.activities(),
    ]
    with ThreadPoolExecutor(4) as pool:
        async with Worker(
            client,
            task_queue=queue,
            workflows=[TripWorkflow],
            activities=activities,
            activity_executor=pool,
            max_cached_workflows=0,  # no sticky queue: a killed worker's workflow tasks go on at once
        ):
            if mode in ("start", "cancel"):
                handle = await client.start_workflow(
                    TripWorkflow.run,
                    args=["ritz", 420, mode == "cancel", MODE == "complete"],
                    id=workflow_id,
                    task_queue=queue,
                )
                if mode == "cancel":
                    await charged(workflow_id)
                    await handle.cancel()
            else:
                handle = client.get_workflow_handle(workflow_id)
            try:
                print(json.dumps({"result": await handle.result()}), flush=True)
            except WorkflowFailureError as exc:
                causes, cause = [], exc.__cause__
                while cause is not None:  # the workflow's failure <- the activity's <- the tool's
                    causes.append(f"{type(cause).__name__}: {cause}")
                    cause = cause.__cause__
                print(json.dumps({"error": " <- ".join(causes)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(*sys.argv[1:5])))
