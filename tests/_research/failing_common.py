"""What the failing agents of every framework share (:mod:`_research.failing`): the agent saga and
its undos, the review desk and the publisher, the hooked stores, and the worker side.

The undos are registered here at import, so the children of every framework, and the worker that
sweeps their journals, find the same ones: ``refund`` (the charge ``pay`` made, through
:class:`sagaguard.connectors.stripe.StripeEffects`, a guarded effect with its reconciler) and
``cancel_review`` (the booking ``book_review`` made, at the desk, under the undo effect's own
``Idempotency-Key``). Nothing here starts a thread or opens anything at import (the zygote forks
from modules that imported it); :func:`configure` gives the undos their clients for the run.

Kill points (:func:`_research.points.reach`) reached here: ``enter:undo:<undo>`` (an undo's first
line, before the provider is called), ``refund_applied`` / ``cancel_applied`` (the provider answered,
before any record), ``undone:<undo>`` (the undo returned, before its record), ``charge_applied``
(Stripe answered the charge), ``booked`` (the desk answered the booking), ``model_answered#k`` (a
model answer arrived), ``recorded:<effect>#k`` (the effect store recorded an outcome) and
``saga_commit#k`` (the saga journal committed a step or a state).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import stripe

from _research.points import reach
from _research.world import write_prompt
from sagaguard.connectors.declare import ToolDeclaration, changes_world
from sagaguard.connectors.stripe import StripeEffects
from sagaguard.idempotency import Guard, current_effect, scope
from sagaguard.idempotency.records import Record, State
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.saga import SagaRegistry, SagaState, recover
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals.sql import SqlJournal
from sagaguard.saga.records import Phase, SagaRecord

__all__ = [
    "DECLARE",
    "INSTRUCTIONS",
    "LEASE",
    "MODEL",
    "HookedJournal",
    "HookedRequestsClient",
    "HookedStore",
    "PlanTools",
    "PublishFailed",
    "SagaSide",
    "cancel_review",
    "configure",
    "get_json",
    "on_model_response",
    "payments_client",
    "refund",
    "registry",
    "research_agent",
    "undos",
]

MODEL = "research-model"
INSTRUCTIONS = (
    "TASK agent_failing. You are a research agent: search, fetch the first page, write the report, "
    "book a reviewer, pay for the report and publish it."
)
"""The agents' system prompt: the world's model follows its ``TASK agent_failing`` plan."""
LEASE = 30.0
"""The agent runs' saga lease (``AgentRunner(lease=...)``): its default, as users get it. A kill in
the middle of a compensation does not wait for it: the resume at once on this host takes the dead
process's run over (its holder is provably dead). The effects' claims keep Guard's defaults too."""
RECOVER_FOR = 60.0
"""Seconds a resume waits for a killed compensation's lease to run out before it gives up."""

DECLARE: dict[str, ToolDeclaration] = {
    "book_review": changes_world(undo="cancel_review"),  # at least once, the compensatable default
    "pay": changes_world(undo="refund"),
}
"""The steps of the agent saga, declared by name at the adapter (``SagaTools(DECLARE)``,
``SagaTurn(declare=DECLARE)``): what the two tools do inside is guarded on its own (the booking by
the desk's ``Idempotency-Key``, the charge a :class:`~sagaguard.connectors.stripe.StripeEffects` effect with
its reconciler), so a call left in doubt by a crash runs its body again (at least once)."""

undos = UndoRegistry()
research_agent = AgentSaga("research_agent", undos)
registry = SagaRegistry(research_agent)
"""What the worker is given (``sagaguard sagas worker --app _research.failing_common:registry``)."""

_clients: dict[str, Any] = {}


def configure(payments: StripeEffects | None, tools_url: str) -> None:
    """Give the undos their clients for this run (each run is a fresh process)."""
    _clients.update(payments=payments, tools_url=tools_url)


class PublishFailed(RuntimeError):
    """The publisher refused the report: the agent's run fails here."""


# ---------------------------------------------------------------------------------- the undos


@undos.register
def refund(arguments: Any, result: Any | None) -> None:
    """Refund the charge ``pay`` made: by its PaymentIntent id when the call's output is recorded,
    else every succeeded PaymentIntent with the call's description (what its arguments say)."""
    reach("enter:undo:refund", numbered=False)
    payments: StripeEffects = _clients["payments"]
    if isinstance(result, str) and result.startswith("pi_"):
        payments.refund(result)
    else:
        listed = payments.client.v1.payment_intents.list({"limit": 100})
        for intent in listed.data:
            if intent.description == arguments["description"] and intent.status == "succeeded":
                payments.refund(intent.id)
    reach("undone:refund", numbered=False)


@undos.register
def cancel_review(arguments: Any, result: Any | None) -> None:
    """Cancel the booking ``book_review`` made: by its id when the call's output is recorded, else
    by the reference it was booked under. The desk's ``Idempotency-Key`` is the undo effect's own,
    so a cancellation sent again after a crash is the same request."""
    reach("enter:undo:cancel_review", numbered=False)
    booking = result.get("booking") if isinstance(result, dict) else None
    body = {"booking": booking} if booking else {"reference": arguments["reference"]}
    _post(f"{_clients['tools_url']}/bookings/cancel", body, current_effect().provider_key)
    reach("cancel_applied", numbered=False)
    reach("undone:cancel_review", numbered=False)


# ---------------------------------------------------------------------------- the world's tools


def get_json(url: str) -> Any:
    """GET ``url``, its JSON answer."""
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


def _post(url: str, body: Mapping[str, Any], key: str | None = None) -> Any:
    headers = {"Content-Type": "application/json", **({"Idempotency-Key": key} if key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


class PlanTools:
    """What the six tools of the ``TASK agent_failing`` plan do, the same in every framework: each
    makes its tools from these methods (``tool(plan.search)``, ``function_tool(plan.search)``).

    Args:
        tools_url: the world's search, fetch, desk and publisher.
        payments: the plain Stripe client (the framework alone charges through it).
        effects: sagaguard's Stripe effects (None: the framework alone); with them the charge is a
            guarded effect in the tool call's scope and the booking carries the tool call's key.
        ask: ``ask(user_message)``: the report's model call (``TASK write``), its text.
    """

    def __init__(
        self, tools_url: str, payments: Any, effects: StripeEffects | None, ask: Callable[[str], str]
    ) -> None:
        self.tools_url = tools_url
        self.payments = payments
        self.effects = effects
        self.ask = ask

    def all(self) -> list[Callable[..., Any]]:
        """The six tools, in plan order."""
        return [self.search, self.fetch, self.write_report, self.book_review, self.pay, self.publish]

    def search(self, query: str) -> str:
        """Search the literature; returns the result URLs, one a line."""
        reach("enter:search", numbered=False)
        found = get_json(f"{self.tools_url}/search?" + urllib.parse.urlencode({"q": query}))
        reach("searched", numbered=False)
        return "\n".join(r["url"] for r in found["results"])

    def fetch(self, url: str) -> str:
        """Fetch a page; returns its text."""
        reach("enter:fetch", numbered=False)
        text = str(get_json(f"{self.tools_url}/fetch?" + urllib.parse.urlencode({"url": url}))["text"])
        reach("fetched", numbered=False)
        return text

    def write_report(self, topic: str, summaries: list[str], verdicts: list[str]) -> str:
        """Write the report from the summaries and the verdicts."""
        reach("enter:write_report", numbered=False)
        report = self.ask(write_prompt(topic, summaries, verdicts))
        reach("exit:write_report", numbered=False)
        return report

    def book_review(self, reviewer: str, slot: str, reference: str) -> dict[str, Any]:
        """Book a reviewer for the report; returns the booking."""
        reach("enter:book_review", numbered=False)
        # The tool call's own effect key names the booking: a call run again after a crash sends
        # the same Idempotency-Key, and the desk answers with the first booking.
        key = current_effect().provider_key if self.effects is not None else None
        body = {"reviewer": reviewer, "slot": slot, "reference": reference}
        booking = dict(_post(f"{self.tools_url}/bookings", body, key))
        reach("booked", numbered=False)
        return booking

    def pay(self, amount: int, currency: str, description: str) -> str:
        """Pay for the report (amount in cents); returns the payment id."""
        reach("enter:pay", numbered=False)
        if self.effects is not None:
            with scope(current_effect().key):  # the charge is keyed on the tool call
                charged = self.effects.charge(
                    amount, currency, payment_method="pm_card_visa", description=description
                )
            paid = charged.id
        else:
            params = {"amount": amount, "currency": currency, "payment_method": "pm_card_visa",
                      "confirm": True, "description": description}  # fmt: skip
            paid = str(self.payments.v1.payment_intents.create(params).id)
        reach("exit:pay", numbered=False)
        return paid

    def publish(self, reference: str, report: str) -> str:
        """Publish the report.

        Raises:
            PublishFailed: always: the world's publisher is down (HTTP 503).
        """
        reach("enter:publish", numbered=False)
        try:
            _post(f"{self.tools_url}/publish", {"reference": reference, "report": report})
        except urllib.error.HTTPError as exc:
            raise PublishFailed(f"the publisher refused {reference!r}: HTTP {exc.code}") from None
        return "published"


def on_model_response(response: httpx.Response) -> None:
    """httpx response hook: the kill point ``model_answered#k`` once a model answer arrived."""
    if response.request.method == "POST" and response.request.url.path.endswith("/chat/completions"):
        reach("model_answered")


# ------------------------------------------------------------------------------ hooked stores


class HookedStore(SqlStore):
    """The effect store with a kill point after each recorded outcome, named by its effect (on
    every path that records one: the sync, the async and the write-at-once one)."""

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        record = super().complete(key, token, result, retention)
        reach(f"recorded:{record.name}")
        return record

    async def acomplete(self, key: str, token: int, result: str, retention: float) -> Record | None:
        record = await super().acomplete(key, token, result, retention)
        if record is not None:
            reach(f"recorded:{record.name}")
        return record

    def complete_now(self, key: str, token: int, result: str, retention: float) -> Record | None:
        record = super().complete_now(key, token, result, retention)
        if record is not None:
            reach(f"recorded:{record.name}")
        return record


class HookedJournal(SqlJournal):
    """The saga journal with a kill point after each commit that writes a step or a state (lease
    renewals alone, which come on the renewer's clock, are not numbered)."""

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        record = super().commit(saga_id, token, phase)
        if phase.steps or phase.state is not None:
            reach("saga_commit")
        return record


class HookedRequestsClient(stripe.RequestsClient):
    """The Stripe SDK's HTTP client with kill points once a charge or a refund was answered."""

    def request(self, method: str, url: str, headers: Mapping[str, str] | None, post_data: Any = None) -> Any:
        answer = super().request(method, url, headers, post_data)
        path = urllib.parse.urlsplit(url).path
        if method.lower() == "post" and path in ("/v1/payment_intents", "/v1/refunds"):
            reach("charge_applied" if path == "/v1/payment_intents" else "refund_applied", numbered=False)
        return answer


def payments_client(config: Mapping[str, Any]) -> stripe.StripeClient:
    """The real Stripe SDK at the world's local Stripe, hooked (no SDK retries: the guard's own)."""
    return stripe.StripeClient(
        config["stripe_api_key"],
        base_addresses={"api": config["stripe_api_base"]},
        max_network_retries=0,
        http_client=HookedRequestsClient(timeout=30),
    )


# ------------------------------------------------------------------------------ the saga side


class SagaSide:
    """The effect store, guard, saga journal and agent runner of a sagaguard child, in ``folder``.

    Attributes:
        store: the effect store (``effects.db``).
        guard: ``Guard(store)`` with its defaults.
        journal: the saga journal (``sagas.db``).
        runner: ``AgentRunner(journal, guard, lease=LEASE)``.
    """

    def __init__(self, folder: Path) -> None:
        self.store = HookedStore(f"sqlite:///{folder / 'effects.db'}")
        self.guard = Guard(self.store, namespace="research")  # the defaults, as the framework pages
        self.journal = HookedJournal(f"sqlite:///{folder / 'sagas.db'}")
        self.runner = AgentRunner(self.journal, self.guard, lease=LEASE)

    def state(self, run_id: str) -> str:
        """The run's saga state in the journal (``""`` when it has none)."""
        found = self.journal.load(run_id)
        return "" if found is None else found.saga.state.value

    def in_doubt(self) -> list[str]:
        """The effects left in doubt for an operator, by name."""
        return sorted(r.name for r in self.store.list(states=[State.IN_DOUBT], limit=1000))

    def sweep(self) -> str:
        """One sweep of the worker API (``sagaguard sagas worker --once``); its errors, as JSON."""
        return json.dumps(dict(recover(self.journal, self.guard, registry, lease=LEASE).errors))

    def recover_until_ended(self, run_id: str) -> None:
        """The worker API, until the run's compensation is no longer held by the dead process: a
        sweep claims it once its lease ran out (:data:`LEASE`), and finishes it."""
        deadline = time.monotonic() + RECOVER_FOR
        while time.monotonic() < deadline:
            recover(self.journal, self.guard, registry, lease=LEASE)
            if self.state(run_id) not in (SagaState.RUNNING.value, SagaState.COMPENSATING.value):
                return
            time.sleep(0.1)  # the dead process's saga lease has not run out yet

    def close(self) -> None:
        """Close the runner, journal, guard and store."""
        self.runner.close()
        self.journal.close()
        self.guard.close()
        self.store.close()
