"""The one place a model call becomes a guarded, journaled effect, for every adapter.

:class:`~sagaguard.connectors.llm.ChatJournal`, :func:`~sagaguard.connectors.llm.journal_model`,
LangGraph's and ``create_agent``'s journaled chat model, the Agents SDK's ``JournaledModel`` and
CrewAI's journaled ``BaseLLM.call`` each keep only what is their framework's own: how they get the
model's request, what type its answer is recorded as, how they name the call (an explicit key, or
the current scope and the effect's ordinal in it). :func:`journaled_call` / :func:`ajournaled_call`
do the rest, the same way for all of them:

1. The call is a guarded effect under :data:`MODEL_OPTIONS` (the caller's options win): a model call
   changes nothing in the world (the tools it picks are effects of their own), so a call left in
   doubt by a crash between the answer and its record is asked again (``at_least_once``); a call
   that raised has no answer to act on, so its claim is dropped (:func:`not_applied`) and it is not
   retried inline (the framework decides about retries).
2. A replay returns the recorded answer; whether the model was asked (paid) or the journal answered
   (saved) is counted with the answer's tokens in :class:`~sagaguard.connectors.llm.LlmUsage` (when
   given) and in the ``sagaguard.llm.*`` metrics (:func:`~sagaguard.connectors.telemetry.record_llm_call`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar, Unpack

from sagaguard.connectors.telemetry import record_llm_call
from sagaguard.idempotency.effect import NO_RETRY, Policy
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.options import RunOptions
from sagaguard.idempotency.records import Disposition

__all__ = [
    "MODEL_OPTIONS",
    "LlmUsage",
    "Tokens",
    "account",
    "ajournaled_call",
    "journaled_call",
    "mark_paid",
    "no_tokens",
    "not_applied",
    "paid_box",
]

T = TypeVar("T")

Tokens = Callable[[Any], tuple[int, int]]
"""(input, output) tokens of a recorded answer."""


def not_applied(exc: BaseException) -> Disposition | None:
    """A failed model call has no answer to act on: its claim is dropped (``RETRYABLE``), so the
    next ask, the framework's retry or a rerun, asks the model again under the same key."""
    return Disposition.RETRYABLE if isinstance(exc, Exception) else None


MODEL_OPTIONS: RunOptions = {"policy": Policy.AT_LEAST_ONCE, "classify": not_applied, "retry": NO_RETRY}
"""The options of a journaled model call, under the caller's own."""


def no_tokens(result: Any) -> tuple[int, int]:
    """For answers that carry no token counts (CrewAI's): (0, 0)."""
    return 0, 0


@dataclass
class LlmUsage:
    """Model calls and tokens paid, and saved by replays, in this process. Thread-safe."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    saved_calls: int = 0
    saved_input_tokens: int = 0
    saved_output_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, paid: bool, input_tokens: int, output_tokens: int) -> None:
        """Count one call."""
        with self._lock:
            if paid:
                self.calls += 1
                self.input_tokens += input_tokens
                self.output_tokens += output_tokens
            else:
                self.saved_calls += 1
                self.saved_input_tokens += input_tokens
                self.saved_output_tokens += output_tokens

    @property
    def saved_tokens(self) -> int:
        """Input plus output tokens that replays did not pay for."""
        return self.saved_input_tokens + self.saved_output_tokens


def account(name: str, result: Any, *, paid: bool, tokens: Tokens, usage: LlmUsage | None) -> None:
    """Count one model call of the effect ``name``: paid (the model was asked) or saved (the
    journal answered), with ``tokens(result)``, in ``usage`` (if any) and the metrics."""
    tokens_in, tokens_out = tokens(result)
    if usage is not None:
        usage.add(paid=paid, input_tokens=tokens_in, output_tokens=tokens_out)
    record_llm_call(name, paid=paid, input_tokens=tokens_in, output_tokens=tokens_out)


_PAID: ContextVar[list[bool] | None] = ContextVar("sagaguard_llm_paid", default=None)


@contextlib.contextmanager
def paid_box() -> Iterator[list[bool]]:
    """A box that :func:`mark_paid`, called by a model call's body in this context, sets to True:
    how a caller that cannot wrap the body itself (a decorated function) learns the model was asked."""
    box = [False]
    token = _PAID.set(box)
    try:
        yield box
    finally:
        _PAID.reset(token)


def mark_paid() -> None:
    """Say that the model is being asked (see :func:`paid_box`)."""
    box = _PAID.get()
    if box is not None:
        box[0] = True


def journaled_call(
    guard: Guard,
    name: str,
    call: Callable[[], T],
    *,
    result_type: Any,
    key: str | None = None,
    arguments: Mapping[str, Any] | None = None,
    tokens: Tokens = no_tokens,
    usage: LlmUsage | None = None,
    **options: Unpack[RunOptions],
) -> T:
    """Ask the model once per effect identity: ``call()`` the first time, the recorded answer after.

    Args:
        guard: the guard the call runs under.
        name: the effect's name.
        call: asks the model (its request bound), returning the answer to record.
        result_type: the type the answer is recorded as.
        key: an explicit key (the adapter's name for the call), else the current scope and the
            effect's ordinal in it.
        arguments: what must match on replay (the request): a changed prompt is a ``KeyConflict``.
        tokens: (input, output) tokens of an answer, for the usage counts.
        usage: where to total the call's usage (None: the metrics only).
        options: :meth:`Guard.run` options over :data:`MODEL_OPTIONS`.

    Raises:
        KeyConflict, AlreadyInProgress, OutcomeUnknown, StoreError: as :meth:`Guard.run`; and what
            ``call`` raises (its claim dropped unless ``classify`` says otherwise).
    """
    paid = False

    def ask() -> T:
        nonlocal paid
        paid = True
        return call()

    merged: RunOptions = {**MODEL_OPTIONS, **options}
    result = guard.run(name, ask, arguments=arguments, key=key, result_type=result_type, **merged)
    account(name, result, paid=paid, tokens=tokens, usage=usage)
    return result


async def ajournaled_call(
    guard: Guard,
    name: str,
    call: Callable[[], Awaitable[T]],
    *,
    result_type: Any,
    key: str | None = None,
    arguments: Mapping[str, Any] | None = None,
    tokens: Tokens = no_tokens,
    usage: LlmUsage | None = None,
    **options: Unpack[RunOptions],
) -> T:
    """The async twin of :func:`journaled_call`."""
    paid = False

    async def ask() -> T:
        nonlocal paid
        paid = True
        return await call()

    merged: RunOptions = {**MODEL_OPTIONS, **options}
    result = await guard.arun(name, ask, arguments=arguments, key=key, result_type=result_type, **merged)
    account(name, result, paid=paid, tokens=tokens, usage=usage)
    return result
