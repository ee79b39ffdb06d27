"""Connectors to the outside world: the effects users wrap first (docs/connectors.md).

Each connector lives in its own module and imports its SDK there only, so ``import sagaguard.connectors``
needs none of them:

- :mod:`sagaguard.connectors.stripe` (``stripe``): charge, capture, cancel, refund, sync and async
  (``_async`` methods); reconciler; refund compensation.
- :mod:`sagaguard.connectors.email` (standard library SMTP): send through the outbox or inline; correction
  compensation, never delivered ahead of its original (:mod:`sagaguard.connectors.email_correction`).
- :mod:`sagaguard.connectors.http` (``httpx``): writes with the IETF ``Idempotency-Key`` header, sync and
  async.
- :mod:`sagaguard.connectors.llm` (``openai``): journaled model calls, sync and async, and any model callable.
- Framework adapters, each importing its framework only in its own module:
  :mod:`sagaguard.connectors.frameworks.langgraph`, :mod:`sagaguard.connectors.frameworks.langchain`
  (``create_agent`` middleware), :mod:`sagaguard.connectors.frameworks.openai_agents`,
  :mod:`sagaguard.connectors.frameworks.crewai`, :mod:`sagaguard.connectors.frameworks.dbos`,
  :mod:`sagaguard.connectors.frameworks.temporal`.
- Shared by every framework adapter, with no framework import: :mod:`sagaguard.connectors.declare` (which
  tools change the world: ``@changes_world``) and :mod:`sagaguard.connectors.in_doubt` (what a tool call does
  when an effect is left in doubt: ``Stop``, ``ReturnPending``, ``WaitForOperator``).
- :mod:`sagaguard.connectors.testing`: local servers (Stripe, IETF-draft API, OpenAI-compatible chat, SMTP)
  with fault injection and counters, for your own tests.

Every connector raises the errors of :mod:`sagaguard.connectors.errors`, re-exported here.
"""

from sagaguard.connectors.declare import ToolDeclaration, changes_world, read_only
from sagaguard.connectors.errors import (
    ConnectorError,
    ProviderBusy,
    ProviderKeyConflict,
    ProviderRejected,
    ProviderUnavailable,
    ProviderUnreachable,
    classify,
    replayable,
)
from sagaguard.connectors.in_doubt import Pending, ReturnPending, Stop, WaitForOperator

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
