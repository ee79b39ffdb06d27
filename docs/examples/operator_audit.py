"""An operator settles an effect left in doubt through the Python API, and the audit trail says who.

The same call is behind ``sagaguard effects resolve`` and the console's Resolve button.
"""

import os

from sagaguard.idempotency import Guard, OutcomeUnknown, open_store, scope
from sagaguard.idempotency.audit import AuditFilter, open_audit
from sagaguard.idempotency.operator import resolve_effect
from sagaguard.idempotency.records import State

url = os.environ.get("SAGAGUARD_STORE", "sqlite:///sagaguard.db")
store = open_store(url)
guard = Guard(store)


@guard.effect(name="psp.charge")
def charge(amount: int) -> int:
    raise TimeoutError("read timed out")  # the reply is lost: did the charge happen?


with scope("order-77"):
    try:
        charge(420)
    except (TimeoutError, OutcomeUnknown):
        pass

(record,) = [r for r in store.list(states=[State.IN_DOUBT]) if r.scope == "order-77"]
audit = open_audit(url)  # the ledger's audit trail: a table beside the effects on SQL

# The provider's dashboard shows the charge: record it as applied, with its result.
resolve_effect(store, record.key, applied=True, result="420", actor="ana", audit=audit)
with scope("order-77"):
    print("replayed:", charge(420))  # the recorded result; nothing is sent again

for entry in audit.list(AuditFilter(target=record.key)):
    print(entry.actor, entry.action, entry.args, entry.outcome.value)
audit.close()
guard.close()
