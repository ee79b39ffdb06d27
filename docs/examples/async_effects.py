"""Async effects: the same guard drives coroutines; parallel calls are told apart by their key."""

import asyncio
import os

from sagaguard.idempotency import Guard, open_store, scope

outbox: list[str] = []

store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///async.db"))
guard = Guard(store)


# Calls that run concurrently in one scope have no stable order, so each gets a key of its own
# (an agent framework would use the model's tool_call_id).
@guard.effect("email.send", key=lambda to, subject: f"welcome/{to}")
async def send_email(to: str, subject: str) -> str:
    await asyncio.sleep(0)  # the SMTP round trip
    outbox.append(to)
    return f"<msg-{len(outbox)}@example.com>"


async def summarize(text: str) -> str:
    await asyncio.sleep(0)  # a paid model call, journaled so a replay costs nothing
    return text.upper()


async def onboard(team: list[str]) -> list[str]:
    ids = await asyncio.gather(*(send_email(to, "Welcome!") for to in team))
    with scope("onboarding/summary"):
        summary = await guard.arun(
            "llm.summarize",
            lambda: summarize("welcome sent"),
            arguments={"text": "welcome sent"},
            result_type=str,
        )
    return [*ids, summary]


team = ["ada@example.com", "grace@example.com"]
first = asyncio.run(onboard(team))
again = asyncio.run(onboard(team))  # a replay: no email is sent twice, the model is not paid twice
assert first == again and len(outbox) <= len(team)
print(f"{first}; emails sent by this process: {len(outbox)}")

guard.close()
store.close()
