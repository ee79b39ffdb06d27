"""The child side of ``tests/test_connector_crash.py``: one connector call in a process that may die.

Run as ``python tests/_connectorchild.py '<json>'`` with ``$SAGAGUARD_CRASH_AT`` naming where to die
(``before_complete``: the provider applied the call, its record is not written). The JSON holds the
store ``spec`` (``StoreFactory.spec``), the ``connector`` (stripe, http, llm, email), the local
server's ``url`` (for email: ``host`` and ``port``), the ``scope`` and the ``lease``.

Prints one JSON line and exits :data:`EXIT_OK` with what the call returned, or :data:`EXIT_UNKNOWN`
when the call is in doubt (``OutcomeUnknown``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from _procs import open_backend

from sagaguard.idempotency import Guard, OutcomeUnknown, scope
from sagaguard.idempotency.testing import CrashingStore

EXIT_OK = 0
EXIT_UNKNOWN = 3
NAMESPACE = "connector-crash"
TOOLS: Any = [
    {"type": "function", "function": {"name": "refund", "parameters": {"type": "object", "properties": {}}}}
]


def call(connector: str, guard: Guard, config: dict[str, Any]) -> dict[str, Any]:
    """Make the connector's call; returns what the test compares across runs."""
    if connector == "stripe":
        from sagaguard.connectors.stripe import StripeEffects

        payments = StripeEffects(guard, api_key="sk_test_local", api_base=config["url"], timeout=5.0)
        payment = payments.charge(4200, "usd", payment_method="pm_card_visa")
        return {"id": payment.id, "status": payment.status}
    if connector == "http":
        import httpx

        from sagaguard.connectors.http import IdempotentHttp

        api = IdempotentHttp(guard, httpx.Client(base_url=config["url"], timeout=5.0))
        result = api.post("/orders", json={"order": config["scope"]})
        return {"id": result.json()["id"], "status": result.status_code}
    if connector == "llm":
        import openai

        from sagaguard.connectors.llm import ChatJournal

        client = openai.OpenAI(api_key="sk-local", base_url=config["url"] + "/v1")
        chat = ChatJournal(guard, client, store_at_provider=True)
        reply = chat.create(model="local", messages=[{"role": "user", "content": "refund"}], tools=TOOLS)
        tool_call = reply.choices[0].message.tool_calls[0]  # type: ignore[index]
        return {"id": reply.id, "tool_call": tool_call.id}
    if connector == "email":
        from sagaguard.connectors.email import Email, EmailEffects, SmtpSettings

        settings = SmtpSettings(config["host"], config["port"], timeout=config.get("smtp_timeout", 10.0))
        mail = EmailEffects(guard, settings, sender="shop@shop.example")
        sent = mail.send_now(Email(to=["ada@example.com"], subject="Receipt", text="Thanks"))
        return {"id": sent.message_id}
    raise ValueError(f"unknown connector {connector!r}")


def main(config: dict[str, Any]) -> int:
    spec = config["spec"]
    inner = open_backend(
        spec["backend"], spec["url"], clock=None, table_name=spec["table_name"], prefix=spec["prefix"]
    )
    store = CrashingStore(inner)  # dies where $SAGAGUARD_CRASH_AT says
    guard = Guard(store, namespace=NAMESPACE, lease=config["lease"], wait=20.0, sleep=time.sleep)
    try:
        with scope(config["scope"]):
            result = call(config["connector"], guard, config)
    except OutcomeUnknown as exc:
        print(json.dumps({"outcome": "unknown", "key": exc.key}), flush=True)
        return EXIT_UNKNOWN
    finally:
        guard.close()
        store.close()
    print(json.dumps({"outcome": "ok", **result}), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
