"""The model-call journal (connectors/llm.py): the real ``openai`` SDK, sync and async, against a
local OpenAI-compatible server (``sagaguard.connectors.testing.LocalChatModel``) that counts what it answered.

The server gives every answer fresh tool-call ids, so "the resumed run sees the same tool calls with
the same ids" is an assertion, and "pays nothing" is its completion counter standing still.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tenacity
from _connectorutil import after_lease, crash_before_record, crashing_guard
from conftest import FakeClock, closed_port
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from sagaguard.connectors import cli
from sagaguard.connectors.errors import ProviderRejected, ProviderUnavailable
from sagaguard.connectors.llm import AsyncChatJournal, ChatJournal, LlmUsage, journal_model, map_error
from sagaguard.connectors.testing import LocalChatModel
from sagaguard.idempotency import ConfigurationError, Guard, MemoryStore, Retry, State, scope
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores import open_store

LEASE = 30.0
FAST = Retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_none())
TOOLS: Any = [
    {"type": "function", "function": {"name": "refund", "parameters": {"type": "object", "properties": {}}}}
]
ASK: Any = [{"role": "user", "content": "refund order 42"}]

pytestmark = pytest.mark.timeout(60)

_READER = InMemoryMetricReader()


@pytest.fixture(scope="module")
def reader() -> InMemoryMetricReader:
    """A metric reader on the global meter provider (set once for the test session)."""
    metrics.set_meter_provider(MeterProvider(metric_readers=[_READER]))
    return _READER


@pytest.fixture(scope="module")
def model() -> Iterator[LocalChatModel]:
    with LocalChatModel() as running:
        yield running


@pytest.fixture(autouse=True)
def fresh(model: LocalChatModel) -> None:
    model.reset()


@pytest.fixture
def memory(clock: FakeClock) -> MemoryStore:
    return MemoryStore(clock=clock)


def client(model: LocalChatModel, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(api_key="sk-local", base_url=model.base_url, **options)


def journal(model: LocalChatModel, store: IdempotencyStore, **options: Any) -> ChatJournal:
    guard = options.pop("guard", None) or Guard(store, lease=LEASE, sleep=lambda s: None)
    options.setdefault("retry", FAST)
    return ChatJournal(guard, client(model, timeout=options.pop("timeout", 5.0)), **options)


def call_id(reply: Any) -> str:
    return str(reply.choices[0].message.tool_calls[0].id)


def test_a_replay_returns_the_same_tool_calls_and_pays_nothing(
    model: LocalChatModel, store: IdempotencyStore
) -> None:
    chat = journal(model, store)
    with scope("run-1/turn-1"):
        first = chat.chat.completions.create(model="local", messages=ASK, tools=TOOLS)
    with scope("run-1/turn-1"):
        again = chat.completions.create(model="local", messages=ASK, tools=TOOLS)

    assert again == first and call_id(again) == call_id(first)
    counters = model.counters()
    assert counters["completions"] == 1
    assert first.usage is not None
    assert chat.usage.calls == 1 and chat.usage.saved_calls == 1
    assert (
        chat.usage.saved_tokens
        == first.usage.total_tokens
        == counters["prompt_tokens"] + counters["completion_tokens"]
    )


def test_a_resumed_agent_loop_follows_the_recorded_path(model: LocalChatModel, memory: MemoryStore) -> None:
    """Two turns (tool call, then answer) run, then the whole loop runs again: nothing is asked."""

    def loop(chat: ChatJournal) -> list[str]:
        with scope("run-2"):
            messages = list(ASK)
            first = chat.create(model="local", messages=messages, tools=TOOLS)
            tool_call = first.choices[0].message
            messages += [tool_call.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call_id(first), "content": "refunded"}]  # fmt: skip
            second = chat.create(model="local", messages=messages, tools=TOOLS)
            return [call_id(first), str(second.choices[0].message.content)]

    chat = journal(model, memory)
    assert loop(chat) == loop(chat)
    assert model.counters()["completions"] == 2 and chat.usage.saved_calls == 2


def test_transport_options_are_not_fingerprinted(model: LocalChatModel, memory: MemoryStore) -> None:
    chat = journal(model, memory)
    with scope("run-3"):
        first = chat.create(model="local", messages=ASK, timeout=5.0)
    with scope("run-3"):
        assert chat.create(model="local", messages=ASK, timeout=9.0, extra_headers={"X-Trace": "1"}) == first


def test_an_in_doubt_call_is_asked_again_by_default(
    model: LocalChatModel, memory: MemoryStore, clock: FakeClock
) -> None:
    crashed = journal(model, memory, guard=crashing_guard(memory))
    with scope("run-4"):
        crash_before_record(lambda: crashed.create(model="local", messages=ASK, tools=TOOLS))
    after_lease(clock)
    with scope("run-4"):
        reply = journal(model, memory).create(model="local", messages=ASK, tools=TOOLS)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert model.counters()["completions"] == 2, "at least once: the lost answer is paid for again"


def test_with_stored_completions_the_lost_answer_is_found(
    model: LocalChatModel, memory: MemoryStore, clock: FakeClock
) -> None:
    crashed = journal(model, memory, guard=crashing_guard(memory), store_at_provider=True)
    with scope("run-5"):
        crash_before_record(lambda: crashed.create(model="local", messages=ASK, tools=TOOLS))
    after_lease(clock)
    with scope("run-5"):
        reply = journal(model, memory, store_at_provider=True).create(
            model="local", messages=ASK, tools=TOOLS
        )

    counters = model.counters()
    assert counters["completions"] == 1 and counters["lists"] == 1
    identity = EffectIdentity.of("default", "run-5", "llm.chat", 0, memory.ledger_id())
    key = identity.key
    assert reply.metadata == {"sagaguard_key": identity.search_key}
    record = memory.get(key)
    assert record is not None and record.state is State.SUCCEEDED


def test_a_bad_request_is_recorded_and_replayed(model: LocalChatModel, memory: MemoryStore) -> None:
    chat = journal(model, memory)
    with scope("run-6"), pytest.raises(ProviderRejected) as bad:
        chat.create(model="local", messages=[])
    assert bad.value.status == 400 and not bad.value.retryable
    with scope("run-6"), pytest.raises(ProviderRejected):
        chat.create(model="local", messages=[])
    assert model.counters()["requests"] == 1


@pytest.mark.parametrize("status", [429, 500, 503])
def test_rate_limits_and_server_errors_are_retried(
    model: LocalChatModel, memory: MemoryStore, status: int
) -> None:
    model.fault("fail", "/v1/chat/completions", method="POST", status=status, times=2)
    with scope("run-7"):
        reply = journal(model, memory).create(model="local", messages=ASK)
    assert reply.choices[0].finish_reason == "stop"
    assert model.counters()["faults_fired"] == 2 and model.counters()["completions"] == 1


def test_an_unreachable_model_is_released_not_in_doubt(memory: MemoryStore) -> None:
    guard = Guard(memory, lease=LEASE, sleep=lambda s: None)
    raw = openai.OpenAI(api_key="sk-local", base_url=f"http://127.0.0.1:{closed_port()}/v1", timeout=1.0)
    with scope("run-8"), pytest.raises(ProviderUnavailable):
        ChatJournal(guard, raw, retry=FAST).create(model="local", messages=ASK)
    assert memory.get(EffectIdentity.of("default", "run-8", "llm.chat", 0).key) is None


def test_streaming_is_refused(model: LocalChatModel, memory: MemoryStore) -> None:
    with scope("run-9"), pytest.raises(ConfigurationError, match="stream"):
        journal(model, memory).create(model="local", messages=ASK, stream=True)


def test_async_replay_returns_the_same_tool_calls(
    model: LocalChatModel, memory: MemoryStore, clock: FakeClock
) -> None:
    async def scenario() -> tuple[Any, Any, Any]:
        guard = Guard(memory, lease=LEASE)
        raw = openai.AsyncOpenAI(api_key="sk-local", base_url=model.base_url)
        chat = AsyncChatJournal(guard, raw, store_at_provider=True)
        with scope("run-10"):
            first = await chat.chat.completions.create(model="local", messages=ASK, tools=TOOLS)
        with scope("run-10"):
            again = await chat.create(model="local", messages=ASK, tools=TOOLS)
        return first, again, chat.usage

    first, again, usage = asyncio.run(scenario())
    assert call_id(first) == call_id(again)
    assert model.counters()["completions"] == 1 and usage.saved_calls == 1


def test_any_model_callable_can_be_journaled(memory: MemoryStore) -> None:
    guard = Guard(memory, lease=LEASE)
    usage = LlmUsage()
    asked: list[str] = []

    @journal_model(guard, "llm.plan", usage=usage)
    def plan(goal: str) -> dict[str, Any]:
        asked.append(goal)
        return {"steps": [goal.upper()], "usage": {"input_tokens": 7, "output_tokens": 3}}

    @journal_model(guard, "llm.aplan", usage=usage)
    async def aplan(goal: str) -> dict[str, Any]:
        asked.append(goal)
        return {"steps": [goal], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}

    for _ in range(2):
        with scope("run-11"):
            assert plan("ship") == {"steps": ["SHIP"], "usage": {"input_tokens": 7, "output_tokens": 3}}
            asyncio.run(aplan("pack"))
    assert asked == ["ship", "pack"]
    assert (usage.calls, usage.saved_calls, usage.saved_input_tokens, usage.saved_output_tokens) == (
        2,
        2,
        12,
        5,
    )


def test_metrics_count_paid_and_saved_tokens(
    model: LocalChatModel, memory: MemoryStore, reader: InMemoryMetricReader
) -> None:
    chat = journal(model, memory, name="llm.metered")
    for _ in range(3):
        with scope("run-12"):
            reply = chat.create(model="local", messages=ASK)
    assert reply.usage is not None

    seen: dict[tuple[str, str, str], int] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scoped in resource.scope_metrics:
            for metric in scoped.metrics:
                for point in metric.data.data_points:  # type: ignore[union-attr]
                    attrs = dict(point.attributes or {})
                    if (
                        not metric.name.startswith("sagaguard.llm.")
                        or attrs.get("sagaguard.effect.name") != "llm.metered"
                    ):
                        continue
                    label = (
                        metric.name,
                        str(attrs["sagaguard.llm.source"]),
                        str(attrs.get("gen_ai.token.type", "")),
                    )
                    seen[label] = int(point.value)  # type: ignore[union-attr]
    assert seen[("sagaguard.llm.calls", "provider", "")] == 1
    assert seen[("sagaguard.llm.calls", "journal", "")] == 2
    assert seen[("sagaguard.llm.tokens", "journal", "input")] == 2 * reply.usage.prompt_tokens
    assert seen[("sagaguard.llm.tokens", "journal", "output")] == 2 * reply.usage.completion_tokens


def test_the_cli_reports_what_the_journal_saves(
    model: LocalChatModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'llm.db'}"
    store = open_store(url)
    try:
        chat = journal(model, store)
        for turn in range(3):
            with scope(f"run-13/turn-{turn}"):
                chat.create(model="local", messages=[*ASK, {"role": "user", "content": f"turn {turn}"}])
    finally:
        store.close()

    assert cli.main(["llm", "savings", "--store", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    counters = model.counters()
    assert report["total"]["calls"] == 3
    assert report["total"]["input_tokens"] == counters["prompt_tokens"]
    assert report["total"]["output_tokens"] == counters["completion_tokens"]
    assert report["rows"][0]["effect"] == "llm.chat" and report["rows"][0]["model"] == "local"

    assert cli.main(["llm", "savings", "--store", url]) == 0
    table = capsys.readouterr().out
    assert (
        "llm.chat" in table
        and f"saves 3 calls and {report['total']['input_tokens'] + report['total']['output_tokens']} tokens"
        in table
    )


def test_error_mapping() -> None:
    request: Any = httpx.Request("POST", "http://x/v1/chat/completions")

    def status(code: int) -> openai.APIStatusError:
        response: Any = httpx.Response(code, request=request, json={"error": {"message": "m"}})
        return openai.APIStatusError("m", response=response, body=None)

    assert type(map_error(status(400))) is ProviderRejected and not map_error(status(400)).retryable  # type: ignore[attr-defined]
    assert map_error(status(429)).retryable  # type: ignore[attr-defined]
    assert map_error(status(401)).retryable  # type: ignore[attr-defined]
    assert type(map_error(status(500))) is ProviderUnavailable
    assert type(map_error(openai.APIConnectionError(request=request))) is ProviderUnavailable
