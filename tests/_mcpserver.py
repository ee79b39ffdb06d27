"""A payments MCP server written with the SDK's server API, for the MCP tests (stdio or HTTP).

Its tools charge the local Stripe-compatible server through the real ``stripe`` SDK and send mail
through the SMTP sink, passing on the idempotency key a client sends in the request's ``_meta``
(Stripe's ``Idempotency-Key``, the mail's ``Message-ID``):

- ``charge(amount, customer)``: destructive, not idempotent (a PaymentIntent, confirmed);
  ``pm_card_chargeDeclined`` as ``customer`` is declined and answered ``isError``;
- ``refund(payment_intent?, charge_key?)``: idempotent; finds the charge by its id, or by the key
  it was made under (its metadata) when the caller never learnt the id;
- ``find_charge(charge_key)``: read-only; whether a charge was made under that key;
- ``send_email(to, subject)``: destructive; ``balance()``: read-only (counts its calls).

Environment: ``MCP_STRIPE`` (the Stripe server's URL), ``MCP_SMTP`` (``host:port``), ``MCP_KILL``
(``before_charge``: SIGKILL this server as the charge starts, nothing charged; ``after_charge``:
once the charge is made, before it answers; ``in_refund``: the same after the refund) with
``MCP_MARKS`` (a folder: each kill happens once, marked there); ``MCP_HOLD`` (an amount: the charge
of that amount, once made, marks ``held-AMOUNT`` in ``MCP_MARKS`` and answers only once the test
wrote ``release-AMOUNT`` there: a call held in flight, the effect made).

``python tests/_mcpserver.py`` serves stdio; ``python tests/_mcpserver.py http PORT`` serves
streamable HTTP on 127.0.0.1:PORT at ``/mcp``.
"""

from __future__ import annotations

import os
import signal
import smtplib
import sys
import time
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import stripe
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

from sagaguard.idempotency.errors import ConfigurationError

# sagaguard.connectors.mcp.IDEMPOTENCY_META_KEY: a server needs no sagaguard.
KEY = "io.sagaguard/idempotency-key"
server = MCPServer("payments")
_balance_calls = [0]


def _kill(point: str) -> None:
    if os.environ.get("MCP_KILL") != point:
        return
    mark = Path(os.environ["MCP_MARKS"]) / f"server-{point}"
    if mark.exists():
        return
    mark.write_text("killed")
    os.kill(os.getpid(), signal.SIGKILL)


def _hold(amount: int) -> None:
    if os.environ.get("MCP_HOLD") != str(amount):
        return
    marks = Path(os.environ["MCP_MARKS"])
    (marks / f"held-{amount}").write_text("held")
    while not (marks / f"release-{amount}").exists():  # the test's signal, polled
        time.sleep(0.02)


def _stripe() -> stripe.StripeClient:
    return stripe.StripeClient(
        "sk_test_sagaguard_local", base_addresses={"api": os.environ["MCP_STRIPE"]}, max_network_retries=0
    )


def _key(ctx: Context) -> str | None:
    meta = ctx.request_context.meta or {}
    found = meta.get(KEY)
    return found if isinstance(found, str) else None


@server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=False, open_world_hint=True))
def charge(amount: int, customer: str, ctx: Context) -> dict[str, Any]:
    """Charge the customer's card."""
    _kill("before_charge")
    key = _key(ctx)
    options: Any = {"idempotency_key": key} if key else {}
    try:
        intent = _stripe().v1.payment_intents.create(
            params={"amount": amount, "currency": "eur", "payment_method": customer, "confirm": True,
                    "metadata": {"mcp_key": key or ""}},
            options=options,
        )  # fmt: skip
    except stripe.CardError as exc:
        raise ToolError(f"card declined: {exc.user_message}") from exc  # an isError result
    _kill("after_charge")
    _hold(amount)
    return {"id": intent.id, "amount": intent.amount, "status": intent.status}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def find_charge(charge_key: str) -> dict[str, Any]:
    """Whether a charge was made under this idempotency key (and which)."""
    found = _stripe().v1.payment_intents.search(params={"query": f"metadata['mcp_key']:'{charge_key}'"})
    if not found.data:
        return {"found": False}
    return {"found": True, "id": found.data[0].id, "amount": found.data[0].amount}


@server.tool(annotations=ToolAnnotations(destructive_hint=False, idempotent_hint=True))
def refund(ctx: Context, payment_intent: str | None = None, charge_key: str | None = None) -> dict[str, Any]:
    """Refund a charge, found by its id or by the idempotency key it was made under."""
    client = _stripe()
    if payment_intent is None and charge_key:
        found = client.v1.payment_intents.search(params={"query": f"metadata['mcp_key']:'{charge_key}'"})
        if not found.data:
            return {"refunded": False, "reason": "no charge was made under that key"}
        payment_intent = found.data[0].id
    if payment_intent is None:
        raise ConfigurationError("refund needs payment_intent or charge_key")
    key = _key(ctx)
    refunded = client.v1.refunds.create(
        params={"payment_intent": payment_intent}, options={"idempotency_key": key} if key else {}
    )
    _kill("in_refund")
    return {"refunded": True, "id": refunded.id, "payment_intent": payment_intent}


@server.tool(annotations=ToolAnnotations(destructive_hint=True, open_world_hint=True))
def send_email(to: str, subject: str, ctx: Context) -> dict[str, Any]:
    """Send an email."""
    host, port = os.environ["MCP_SMTP"].rsplit(":", 1)
    message = EmailMessage()
    message["From"], message["To"], message["Subject"] = "shop@example.com", to, subject
    key = _key(ctx)
    if key:
        message["Message-ID"] = f"<{key}@sagaguard.test>"
    message.set_content(subject)
    with smtplib.SMTP(host, int(port), timeout=10) as smtp:
        smtp.send_message(message)
    return {"sent": True, "to": to}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def balance() -> dict[str, Any]:
    """How often this server process was asked for the balance."""
    _balance_calls[0] += 1
    return {"calls": _balance_calls[0]}


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
