"""A ledger on Redis Cluster: the same guarded calls as on one server, under a cluster URL.

Any node is enough to discover the cluster; list several so a client can start while one is down.
"""

import os

from sagaguard.idempotency import Guard, open_store

url = os.environ.get("SAGAGUARD_STORE", "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002")
store = open_store(url)  # on a cluster, each record's script runs on the primary of its slot
guard = Guard(store, namespace="billing")
sent: list[str] = []


def send_invoice(customer: str) -> str:
    sent.append(customer)
    return f"inv_{customer}"


customers = [f"cus_{n}" for n in range(6)]  # their records land on different primaries
for _ in range(2):  # the second pass replays every record
    for customer in customers:
        guard.run("billing.send_invoice", lambda c=customer: send_invoice(c), key=f"invoice/{customer}")

records = store.list(namespace="billing", limit=100)  # on a cluster: a SCAN of every primary
assert len(sent) <= len(customers) and len(records) == len(customers)
print(f"{len(records)} records; invoices sent by this process: {len(sent)}")
guard.close()
store.close()
