"""A Temporal workflow as an agent saga, in the world of ``tests/_undokey.py``: run as a real worker
process by ``tests/test_agent_saga_lost_answers.py``. Its activities book a hotel, then charge the
card (killed there, ``$AGENT_KILL=in_charge``), each a declared tool of ``TemporalSagaTools``.
``python tests/_undokeytemporal.py ADDRESS QUEUE WORKFLOW_ID`` runs a worker and the workflow, its
effects and journal in ``$SAGAGUARD_STORE``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    import _undokey as world

    from sagaguard.connectors.declare import changes_world
    from sagaguard.connectors.frameworks.temporal_saga import TemporalSagaTools, run_agent
    from sagaguard.idempotency import Guard, open_store
    from sagaguard.saga.agent import AgentRunner
    from sagaguard.saga.journals import open_journal

DB = os.environ.get("SAGAGUARD_STORE", "sqlite:///trip.db")
guard = Guard(open_store(DB))
tools = TemporalSagaTools(AgentRunner(open_journal(DB), guard, lease=5.0), world.trip)
TIMEOUT = timedelta(seconds=10)


@activity.defn
@tools.tool
@changes_world(undo="cancel_booking", policy="at_least_once")
def book_hotel(hotel: str) -> dict[str, Any]:
    return world.book_hotel(hotel)


@activity.defn
@tools.tool
@changes_world(undo="refund_lost", policy="at_least_once")
def charge(amount: int) -> dict[str, Any]:
    return world.charge(guard, amount)


@workflow.defn
class Trip:
    @workflow.run
    async def run(self, hotel: str, amount: int) -> str:
        return await run_agent(world.trip.name, lambda: self.plan(hotel, amount))

    async def plan(self, hotel: str, amount: int) -> str:
        await workflow.execute_activity(book_hotel, hotel, start_to_close_timeout=TIMEOUT)
        await workflow.execute_activity(charge, amount, start_to_close_timeout=TIMEOUT)
        return "booked"


async def main(address: str, queue: str, workflow_id: str) -> None:
    client = await Client.connect(address)
    with ThreadPoolExecutor(4) as pool:
        async with Worker(
            client, task_queue=queue, workflows=[Trip], activities=[book_hotel, charge, *tools.activities()],
            activity_executor=pool,
        ):  # fmt: skip
            await client.execute_workflow(Trip.run, args=["ritz", 606], id=workflow_id, task_queue=queue)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
