"""Every connector's documented ``--result`` shape for ``sagaguard effects resolve --applied`` is
on its docs page, is accepted by the real CLI, and is replayed as the connector's own result type.

Each effect is left in doubt (its body loses the answer), resolved by the CLI with the JSON the docs
show, then called again under the same key and result type: the recorded value comes back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from openai.types.chat import ChatCompletion

from sagaguard.connectors.email import Sent
from sagaguard.connectors.http import HttpResult
from sagaguard.connectors.stripe import Payment, Refund
from sagaguard.idempotency import Guard, OutcomeUnknown
from sagaguard.idempotency.cli import main as cli
from sagaguard.idempotency.stores.sql import SqlStore

DOCS = Path(__file__).resolve().parent.parent / "docs"

PAYMENT = (
    '{"id": "pi_3Q", "amount": 1999, "currency": "eur", "status": "succeeded", "amount_received": 1999, '
    '"amount_capturable": 0, "customer": null, "latest_charge": "ch_3Q", "effect_key": null}'
)
REFUND = (
    '{"id": "re_3Q", "payment_intent": "pi_3Q", "amount": 1999, "currency": "eur", "status": "succeeded", '
    '"effect_key": null}'
)
SENT = '{"message_id": "<sg1p_0f3a@shop.example>", "accepted": ["ada@example.com"], "refused": {}}'
HTTP = (
    '{"status_code": 201, "headers": {"content-type": "application/json"}, "text": "{\\"id\\": \\"inv_7\\"}"}'
)
CHAT = (
    '{"id": "chatcmpl-7", "object": "chat.completion", "created": 1764547200, "model": "gpt-4o-mini", '
    '"choices": [{"index": 0, "finish_reason": "stop", '
    '"message": {"role": "assistant", "content": "Done."}}]}'
)
TOOL_MESSAGE = '{"content": "wired 42", "tool_call_id": "call_1", "name": "wire"}'
TOOL_OUTPUT = '"wired 42"'

Check = Callable[[Any], bool]
Shape = tuple[str, str, Any, Check]
SHAPES: list[Shape] = [
    ("connectors.md", PAYMENT, Payment, lambda p: p.id == "pi_3Q" and p.latest_charge == "ch_3Q"),
    ("connectors.md", REFUND, Refund, lambda r: r.payment_intent == "pi_3Q"),
    ("connectors.md", SENT, Sent, lambda s: s.accepted == ["ada@example.com"]),
    ("connectors.md", HTTP, HttpResult, lambda h: h.json() == {"id": "inv_7"}),
    ("connectors.md", CHAT, ChatCompletion, lambda c: c.choices[0].message.content == "Done."),
    ("frameworks/langgraph.md", TOOL_MESSAGE, ToolMessage, lambda m: m.tool_call_id == "call_1"),
    ("frameworks/langchain.md", TOOL_MESSAGE, ToolMessage, lambda m: m.content == "wired 42"),
    ("frameworks/openai_agents.md", TOOL_OUTPUT, Any, lambda o: o == "wired 42"),
    ("frameworks/crewai.md", TOOL_OUTPUT, Any, lambda o: o == "wired 42"),
]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'effects.db'}"


@pytest.fixture
def guard(url: str) -> Iterator[Guard]:
    store = SqlStore(url)
    g = Guard(store, namespace="shapes")
    yield g
    g.close()
    store.close()


def lose_the_answer() -> Any:
    raise ConnectionResetError("the answer was lost")


@pytest.mark.parametrize("documented", SHAPES, ids=lambda v: f"{v[0]}:{v[2]}")
def test_a_documented_result_shape_is_replayed_as_the_connector_s_type(
    guard: Guard, url: str, documented: Shape
) -> None:
    page, shape, result_type, check = documented
    assert shape in (DOCS / page).read_text(encoding="utf-8"), f"{page} does not show {shape}"
    with pytest.raises(OutcomeUnknown) as doubt:
        guard.run("effect", lose_the_answer, key="k-1", result_type=result_type)
    key = doubt.value.key
    assert cli(["--store", url, "effects", "resolve", key, "--applied", "--result", shape]) == 0
    replayed = guard.run("effect", lose_the_answer, key="k-1", result_type=result_type)
    if result_type is not Any:
        assert isinstance(replayed, result_type)
    assert check(replayed)
    assert json.loads(shape)  # valid JSON, as the CLI requires
