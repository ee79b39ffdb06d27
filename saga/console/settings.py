"""The console's settings: where it reads, who may act, what it shows."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from sagaguard.idempotency.errors import ConfigurationError

__all__ = ["ConsoleSettings"]


@dataclass(frozen=True)
class ConsoleSettings:
    """How a console runs.

    Attributes:
        store_url: the ledger (effects and audit trail); shown password-masked on every page.
        journal_url: the saga journal (default: the store's URL).
        token: the operators' token; None makes the console read-only.
        read_only: refuse every action even with a token.
        show_payloads: show arguments, results, inputs and payloads (they may hold personal data).
        trace_url: a trace viewer's URL with ``{trace_id}`` in it, to link trace ids.
        refresh: seconds between the pages' own reloads (0: never).
        namespace: the guard namespace of the agent runs' tool calls.
        secret: signs the session cookie (random per process unless given).
    """

    store_url: str
    journal_url: str | None = None
    token: str | None = None
    read_only: bool = False
    show_payloads: bool = False
    trace_url: str | None = None
    refresh: int = 15
    namespace: str = "default"
    secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)

    def __post_init__(self) -> None:
        if self.token is not None and len(self.token) < 16:
            raise ConfigurationError("the console token must be at least 16 characters")
        if self.trace_url is not None and "{trace_id}" not in self.trace_url:
            raise ConfigurationError("--trace-url must contain {trace_id}")
        if self.refresh < 0:
            raise ConfigurationError("refresh must be 0 or more seconds")

    @property
    def can_act(self) -> bool:
        """Whether actions are possible at all (a token and not read-only)."""
        return self.token is not None and not self.read_only

    def trace_link(self, trace_id: str | None) -> str | None:
        """The trace viewer's URL for ``trace_id``, or None."""
        if not trace_id or self.trace_url is None:
            return None
        return self.trace_url.replace("{trace_id}", trace_id)
