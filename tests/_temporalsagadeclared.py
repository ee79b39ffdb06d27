"""The Temporal agent-saga recipe with the declarations exactly as docs/agent_sagas.md writes them,
run as a real worker process for tests/test_agent_saga_declared.py.

A workflow books a hotel, then charges a card: the trip succeeds. Its activities are declared as
the page declares them (``@activity.defn`` over ``@tools.tool`` over an undo by name, no
``policy=``), the runner has the page's short lease, and the tools' bodies and undos are the
booking world's (``tests/_declaredworld.py``, killed at ``in_booking``: Temporal has not recorded
the activity). The effects and the journal live in ``$AGENT_DIR``.

``python tests/_temporalsagadeclared.py ADDRESS QUEUE WORKFLOW_ID start`` runs a worker and starts
the workflow; ``... resume`` runs a worker (Temporal retries the activity a killed worker left)
and waits for the workflow. Each prints the workflow's result and the run's state as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from _declaredworld import DB, book, guard, pay, undos

    from sagaguard.connectors.declare import changes_world
    from sagaguard.connectors.frameworks.temporal_saga import TemporalSagaTools, run_agent
    from sagaguard.saga import SagaRegistry
    from sagaguard.saga.agent import AgentRunner, AgentSaga
    from sagaguard.saga.journals import open_journal

trip_agent = AgentSaga("temporal_trip", undos)
registry = SagaRegistry(trip_agent)
journal = open_journal(DB)
tools = TemporalSagaTools(AgentRunner(journal, guard, lease=5.0), trip_agent)
# A killed worker's activity is retried after this (tools do not heartbeat).
RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_interval=timedelta(seconds=1))
OPTIONS: Any = {"start_to_close_timeout": timedelta(seconds=4), "retry_policy": RETRY}


@activity.defn
@tools.tool
@changes_world(undo="cancel_booking")
def book_hotel(hotel: str) -> dict[str, Any]:
    return book(hotel)


@activity.defn
@tools.tool
@changes_world(undo="refund")
def charge(amount: int) -> dict[str, Any]:
    return pay(amount)


@workflow.defn
class Trip:
    @workflow.run
    async def run(self, hotel: str, amount: int) -> str:
        return await run_agent(trip_agent.name, lambda: self.plan(hotel, amount))

    async def plan(self, hotel: str, amount: int) -> str:
        await workflow.execute_activity(book_hotel, hotel, **OPTIONS)
        await workflow.execute_activity(charge, amount, **OPTIONS)
        return "booked"


async def main(address: str, queue: str, workflow_id: str, mode: str) -> int:
    client = await Client.connect(address)
    with ThreadPoolExecutor(4) as pool:
        async with Worker(
            client, task_queue=queue, workflows=[Trip], activities=[book_hotel, charge, *tools.activities()],
            activity_executor=pool, max_cached_workflows=0,  # a killed worker's workflow goes on at once
        ):  # fmt: skip
            if mode == "start":
                handle = await client.start_workflow(
                    Trip.run, args=["ritz", 420], id=workflow_id, task_queue=queue
                )
            else:
                handle = client.get_workflow_handle(workflow_id)
            result = await handle.result()
    found = journal.load(workflow_id)
    print(json.dumps({"result": result, "state": found.saga.state.value if found else "?"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(*sys.argv[1:5])))
