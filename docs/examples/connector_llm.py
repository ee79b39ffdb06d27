"""Model calls: a journaled chat completion replays its recorded answer, so a resumed run sees the
same tool calls with the same ids and pays nothing (here the local OpenAI-compatible test server)."""

import os

import openai

from sagaguard.connectors.llm import ChatJournal
from sagaguard.connectors.testing import LocalChatModel
from sagaguard.idempotency import Guard, open_store, scope

store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///llm.db"))
guard = Guard(store)
tools = [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}]
messages = [{"role": "user", "content": "Refund order 5005."}]

with LocalChatModel(in_process=True) as model:
    chat = ChatJournal(guard, openai.OpenAI(api_key="sk-local", base_url=model.base_url))
    with scope("run/5005/turn-1"):
        first = chat.completions.create(model="local", messages=messages, tools=tools)
    with scope("run/5005/turn-1"):  # the run resumed after a crash: the answer is replayed
        again = chat.completions.create(model="local", messages=messages, tools=tools)

    first_call, again_call = first.choices[0].message.tool_calls[0], again.choices[0].message.tool_calls[0]
    assert first_call.id == again_call.id
    assert model.counters()["completions"] == 1
    print(f"tool call {first_call.function.name} ({first_call.id}) both times")
    usage = chat.usage
    print(f"model calls paid: {usage.calls}, saved: {usage.saved_calls} ({usage.saved_tokens} tokens)")

guard.close()
store.close()
