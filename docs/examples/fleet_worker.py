"""One worker of a fleet: the same code on every host, against the database the fleet shares.

Every worker runs sagas and sweeps for sagas whose worker died: any number of them may sweep at
once, and each due saga goes to exactly one. A saga whose worker died on another host is continued
at most one saga lease plus one sweep interval after the death (65 s with these settings).
"""

import os

from sagaguard.idempotency import Guard, open_store
from sagaguard.saga import RecoveryReport, RecoveryWorker, Saga, SagaRunner, SagaState, StepContext
from sagaguard.saga.journals import open_journal

url = os.environ.get(
    "SAGAGUARD_STORE", "postgresql://app@db-a:5432,db-b:5432/app?target_session_attrs=read-write"
)
# An effect's claim: renewed every third of its lease while the effect runs; a claim whose holder
# died on another host blocks a retry of that effect for at most the lease.
store = open_store(url)
guard = Guard(store, lease=5.0, wait=10.0)
journal = open_journal(url)  # the journal can share the store's database
shipped: list[str] = []

fulfil: Saga[str] = Saga("fulfil_order", version=1, input=str)


@fulfil.step(compensate=None)
def reserve(ctx: StepContext, order: str) -> str:
    return f"res_{order}"


@fulfil.step(compensate=None)
def ship(ctx: StepContext, order: str) -> str:
    shipped.append(order)
    return f"shp_{order}"


# A saga's lease: renewed by a commit once a fifth of it has passed, and every third of it while a step runs.
runner = SagaRunner(journal, guard, lease=60.0, wait=10.0)
done = runner.run(fulfil, "order-7", "order-7")
assert done.state is SagaState.COMPLETED, done

# The sweep; a real worker runs until SIGTERM: worker.run(), or `sagaguard sagas worker`.
reports: list[RecoveryReport] = []
worker = RecoveryWorker(journal, guard, fulfil, interval=5.0, lease=60.0, on_report=reports.append)
worker.run(sweeps=1)
print(f"order-7: {done.state.value}; sagas due: {reports[0].found}; shipped by this process: {len(shipped)}")

runner.close()
journal.close()
guard.close()
store.close()
