"""sagaguard.connectors.frameworks.openai_agents: inside a ``function_tool`` run by ``AgentRun`` the tool
call's scope is current, so the Stripe, email and model connectors work there with no ``key=`` and a rerun of
the tool call replays each of them (the local Stripe-compatible server, an SMTP sink and the local
OpenAI-compatible chat server, all real servers on real sockets)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from _agentschild import NAMESPACE, ScriptedModel
from agents import Agent, Runner, function_tool
from agents.exceptions import UserError

from sagaguard.connectors.email import Email, EmailEffects, SmtpSettings
from sagaguard.connectors.frameworks.openai_agents import AgentRun, tool_call_key
from sagaguard.connectors.llm import ChatJournal
from sagaguard.connectors.stripe import StripeEffects
from sagaguard.connectors.testing import LocalChatModel, LocalStripe
from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency import Guard, current_scope
from sagaguard.idempotency.stores.sql import SqlStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[Guard]:
    store = SqlStore(f"sqlite:///{tmp_path / 'effects.db'}")
    g = Guard(store, namespace=NAMESPACE)
    yield g
    g.close()
    store.close()


def test_stripe_email_and_model_inside_a_function_tool_need_no_key(guard: Guard) -> None:
    with LocalStripe(in_process=True) as stripe, SmtpSink() as smtp, LocalChatModel(in_process=True) as llm:
        payments = StripeEffects(guard, api_key=stripe.api_key, api_base=stripe.api_base)
        mail = EmailEffects(guard, SmtpSettings(smtp.host, smtp.port), sender="trips@example.com")
        chat = ChatJournal(guard, openai.OpenAI(api_key="sk-local", base_url=llm.base_url))
        scopes: list[str] = []
        outputs: list[str] = []
        crash = [True]

        @function_tool(failure_error_function=None)
        def book(order: str) -> str:
            """Charge, confirm by email and summarise a booking."""
            scopes.append(current_scope().id)
            payment = payments.charge(1999, "eur", payment_method="pm_card_visa")
            sent = mail.send_now(Email(to=["ada@example.com"], subject=f"Booked {order}", text="See you."))
            summary = chat.completions.create(
                model="local", messages=[{"role": "user", "content": f"Summarise booking {order}"}]
            )
            outputs.append(f"{payment.id} {sent.message_id} {summary.id}")
            if crash:  # the worker dies after all three, before the tool call's record
                crash.pop()
                raise RuntimeError("the worker died")
            return outputs[-1]

        model = ScriptedModel(tool="book")
        agent: Agent[Any] = Agent(name="trips", instructions="Book.", model=model, tools=[book])
        with pytest.raises(UserError, match="worker died"):  # the SDK wraps what a tool raises
            Runner.run_sync(AgentRun(guard, "trip-7/turn-1").wrap(agent), "Book order 42")
        done = Runner.run_sync(AgentRun(guard, "trip-7/turn-1").wrap(agent), "Book order 42")

        assert scopes == [tool_call_key("trip-7/turn-1", model.call_ids[0])] * 2
        assert outputs[0] == outputs[1]  # the rerun replayed all three records
        assert done.final_output == f"done: {outputs[0]}"
        assert stripe.counters()["charges"] == 1
        assert smtp.count() == 1
        assert llm.counters()["completions"] == 1
