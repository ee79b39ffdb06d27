"""The trip agent as a Temporal workflow, run as a real worker process by tests/test_temporal_saga.py.

``python tests/_temporalsagachild.py ADDRESS QUEUE WORKFLOW_ID start`` runs a worker and starts the
workflow; ``... resume`` runs a worker (Temporal retries what a killed worker left) and waits for
it. Either prints ``{"result": ...}`` or ``{"error": ...}`` as JSON on its last line. Sync
activities, on the worker's thread pool.
"""

from __future__ import annotations

import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from _enginesagaworld import book_flight, book_hotel, charge, die_once, runner, trip_agent

    from connectors.declare import changes_world
    from connectors.temporal_saga import TemporalSagaTools, run_agent

tools = TemporalSagaTools(runner(), trip_agent)
# A killed worker's activity is retried after this (tools do not heartbeat; the end activity does).
TOOL_TIMEOUT = timedelta(seconds=8)
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
    async def run(self, hotel: str, amount: int) -> str:
        return await run_agent(
            trip_agent.name, lambda: self.trip(hotel, amount), retry_policy=RETRY,
            heartbeat_timeout=timedelta(seconds=3),
        )  # fmt: skip

    async def trip(self, hotel: str, amount: int) -> str:
        run = workflow.info().workflow_id
        options: Any = {"start_to_close_timeout": TOOL_TIMEOUT, "retry_policy": RETRY}
        await workflow.execute_activity(book_hotel_activity, args=[run, hotel], **options)
        await workflow.execute_activity(charge_activity, amount, **options)
        once = RetryPolicy(maximum_attempts=1)
        return await workflow.execute_activity(
            book_flight_activity, run, start_to_close_timeout=TOOL_TIMEOUT, retry_policy=once
        )


async def main(address: str, queue: str, workflow_id: str, mode: str) -> int:
    client = await Client.connect(address)
    activities = [book_hotel_activity, charge_activity, book_flight_activity, *tools.activities()]
    with ThreadPoolExecutor(4) as pool:
        async with Worker(
            client, task_queue=queue, workflows=[TripWorkflow], activities=activities, activity_executor=pool
        ):
            if mode == "start":
                handle = await client.start_workflow(
                    TripWorkflow.run, args=["ritz", 420], id=workflow_id, task_queue=queue
                )
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
