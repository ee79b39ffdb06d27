"""A new adapter's model call: the framework's own part (the request, the answer's type, the call's
name) and one call of journaled_call, which makes it a guarded, at-least-once, journaled effect."""

import os
import uuid

from sagaguard.connectors.model_call import LlmUsage, journaled_call
from sagaguard.idempotency import Guard, open_store

guard = Guard(open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///model_call.db")))
usage = LlmUsage()
asked = []


def ask_model(prompt: str) -> dict[str, str]:
    """Stands for a framework's model: a fresh answer id each time it is asked."""
    asked.append(prompt)
    return {"answer": f"plan-{uuid.uuid4().hex[:8]}"}


def plan(run_id: str, turn: int, prompt: str) -> dict[str, str]:
    return journaled_call(
        guard, "myframework.model", lambda: ask_model(prompt), result_type=dict[str, str],
        key=f"{run_id}/turn-{turn}", arguments={"prompt": prompt}, usage=usage,
    )  # fmt: skip


run_id = f"run-{uuid.uuid4().hex[:8]}"
first = plan(run_id, 1, "book a room")
again = plan(run_id, 1, "book a room")  # the run resumed after a crash: the answer is replayed
assert again == first and len(asked) == 1
print(f"{first['answer']} both times; paid {usage.calls}, saved {usage.saved_calls}")
guard.close()
