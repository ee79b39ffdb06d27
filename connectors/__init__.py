"""Connectors to the outside world: the effects users wrap first (docs/connectors.md).

Each connector lives in its own module and imports its SDK there only, so ``import connectors``
needs none of them:

- :mod:`connectors.stripe` (``stripe``): charge, capture, cancel, refund, sync and async
  (``_async`` methods); reconciler; refund compensation.
- :mod:`connectors.email` (standard library SMTP): send through the outbox or inline; correction
  compensation, never delivered ahead of its original (:mod:`connectors.email_correction`).
- :mod:`connectors.http` (``httpx``): writes with the IETF ``Idempotency-Key`` header, sync and async.
- :mod:`connectors.llm` (``openai``): journaled model calls, sync and async, and any model callable.
- Framework adapters, each importing its framework only in its own module:
  :mod:`connectors.langgraph`, :mod:`connectors.langchain` (``create_agent`` middleware),
  :mod:`connectors.openai_agents`, :mod:`connectors.crewai`, :mod:`connectors.dbos`,
  :mod:`connectors.temporal`.
- Shared by every framework adapter, with no framework import: :mod:`connectors.declare` (which
  tools change the world: ``@changes_world``) and :mod:`connectors.in_doubt` (what a tool call does
  when an effect is left in doubt: ``Stop``, ``ReturnPending``, ``WaitForOperator``).
- :mod:`connectors.testing`: local servers (Stripe, IETF-draft API, OpenAI-compatible chat, SMTP)
  with fault injection and counters, for your own tests.

Every connector raises the errors of :mod:`connectors.errors`, re-exported here.
"""

from connectors.declare import ToolDeclaration, changes_world, read_only
from connectors.errors import (
    ConnectorError,
    ProviderBusy,
    ProviderKeyConflict,
    ProviderRejected,
    ProviderUnavailable,
    ProviderUnreachable,
    classify,
    replayable,
)
from connectors.in_doubt import Pending, ReturnPending, Stop, WaitForOperator

__all__ = [
    "ConnectorError",
    "Pending",
    "ProviderBusy",
    "ProviderKeyConflict",
    "ProviderRejected",
    "ProviderUnavailable",
    "ProviderUnreachable",
    "ReturnPending",
    "Stop",
    "ToolDeclaration",
    "WaitForOperator",
    "changes_world",
    "classify",
    "read_only",
    "replayable",
]
