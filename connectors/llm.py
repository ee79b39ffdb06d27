"""Model calls as journaled effects: a replay returns the recorded response and costs nothing.

::

    chat = ChatJournal(guard, openai.OpenAI())

    with scope("run-7/turn-3"):
        reply = chat.completions.create(model="gpt-5-mini", messages=messages, tools=tools)

The first run asks the model and records the response (a ``ChatCompletion``). A resumed run of the
same scope gets the recorded response back: the same tool calls with the same ids, so it follows the
recorded path, and it pays nothing. Any model callable can be journaled with :func:`journal_model`.

Policy: a model call changes nothing in the world (the tools it picks are effects of their own), so
an in-doubt call (a crash between the answer and its record) is asked again by default
(``at_least_once``), and timeouts, 5xx and rate limits are retried in the claim. To get the lost
answer back instead of paying for a new one, pass ``store_at_provider=True``: the call is made with
``store=true`` and the effect key in its ``metadata``, and the reconciler finds the stored completion
(``GET /v1/chat/completions?metadata[sagaguard_key]=...``). That stores prompts at the provider:
opt in knowingly.

Usage: every call's token usage is in its recorded response. :class:`LlmUsage` totals what was paid
and what replays saved, in this process; the metrics ``sagaguard.llm.calls`` and
``sagaguard.llm.tokens`` (:mod:`sagaguard.connectors.telemetry`) report the same by source, and
``sagaguard llm savings`` (:mod:`sagaguard.connectors.cli`) reads what the journal holds.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Generic, ParamSpec, TypeVar, Unpack, cast, overload

import openai
from openai.types.chat import ChatCompletion

from sagaguard.connectors.errors import ProviderRejected, ProviderUnavailable, classify, replayable
from sagaguard.connectors.model_call import (
    LlmUsage,
    Tokens,
    account,
    ajournaled_call,
    journaled_call,
    mark_paid,
    paid_box,
)
from sagaguard.connectors.telemetry import usage_of
from sagaguard.idempotency.checks import count
from sagaguard.idempotency.effect import (
    NOT_APPLIED,
    Applied,
    NotAppliedResolution,
    Policy,
    ReconcileRequest,
    Retry,
)
from sagaguard.idempotency.effect import current_effect as _current_effect
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.options import EffectOptions, RunOptions
from sagaguard.idempotency.records import Disposition

__all__ = [
    "AsyncChatJournal",
    "ChatJournal",
    "LlmUsage",
    "METADATA_KEY",
    "journal_model",
    "map_error",
    "usage_of",
]

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", openai.OpenAI, openai.AsyncOpenAI)

METADATA_KEY = "sagaguard_key"
"""The metadata field holding the effect key on completions stored at the provider."""
_TRANSPORT = frozenset({"extra_headers", "extra_query", "extra_body", "timeout"})
"""``create`` options that do not change the answer: left out of the fingerprint."""


def map_error(exc: openai.OpenAIError) -> Exception:
    """The connector error for an exception of the openai SDK.

    400, 404, 422: ``ProviderRejected`` (not applied, recorded); 401, 403, 408, 409, 429:
    ``ProviderRejected(retryable)``; 5xx, timeouts, connection errors: ``ProviderUnavailable``,
    which model calls retry (asking a model again changes nothing in the world).
    """
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        code = getattr(exc, "code", None)
        if status in (401, 403, 408, 409, 429):
            return ProviderRejected(exc.message, "llm", status, code, True)
        if 400 <= status < 500:
            return ProviderRejected(exc.message, "llm", status, code)
        return ProviderUnavailable(exc.message, "llm", status, code)
    return ProviderUnavailable(f"{type(exc).__name__}: {exc}", "llm")


def _classify(exc: BaseException) -> Disposition | None:
    # A model call that may have been answered is simply asked again: nothing in the world changed.
    if isinstance(exc, ProviderUnavailable):
        return Disposition.RETRYABLE
    return classify(exc)


def _options(policy: Policy | str, retry: Retry | None) -> RunOptions:
    # Unlike a framework's model call, a chat completion's timeouts, 5xx and rate limits are retried
    # in the claim. The Retry is built here once, not by the guard on every call.
    return {"policy": policy, "classify": _classify, "permanent": replayable, "retry": retry or Retry()}


class _Completions:
    """``journal.chat.completions``, so a journal reads like the client it wraps."""

    def __init__(self, create: Callable[..., Any]) -> None:
        self.create = create


class _Chat:
    def __init__(self, create: Callable[..., Any]) -> None:
        self.completions = _Completions(create)


class _ChatBase(Generic[C]):
    create: Callable[..., Any]

    def __init__(
        self,
        guard: Guard,
        client: C,
        *,
        name: str = "llm.chat",
        store_at_provider: bool = False,
        max_retries: int = 0,
        policy: Policy | str = Policy.AT_LEAST_ONCE,
        retry: Retry | None = None,
        usage: LlmUsage | None = None,
    ) -> None:
        self.guard = guard
        self.name = name
        self.store_at_provider = store_at_provider
        self.usage = usage if usage is not None else LlmUsage()
        self._options = _options(policy, retry)
        self.client: C = client.with_options(max_retries=count("max_retries", max_retries, minimum=0))
        self.chat = _Chat(self.create)
        self.completions = self.chat.completions

    def _run_options(self, reconciler: Callable[[ReconcileRequest], Any]) -> RunOptions:
        # A reconciler only when the answers are stored at the provider (an attribute a caller may
        # change between calls).
        return {**self._options, "reconciler": reconciler if self.store_at_provider else None}

    def _request(self, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The fingerprinted arguments, and the SDK's keyword arguments (without the key metadata)."""
        if kwargs.get("stream"):
            raise ConfigurationError("a journaled chat completion cannot be streamed (stream=True)")
        arguments = {k: v for k, v in kwargs.items() if k not in _TRANSPORT}
        return arguments, dict(kwargs)

    def _keyed(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.store_at_provider:
            key = _current_effect().identity.search_key
            kwargs = {
                **kwargs,
                "store": True,
                "metadata": {**(kwargs.get("metadata") or {}), METADATA_KEY: key},
            }
        return kwargs


class ChatJournal(_ChatBase[openai.OpenAI]):
    """Journals ``client.chat.completions.create`` (non-streaming) as the effect ``name``.

    Args:
        guard: the guard the calls run under.
        client: an ``openai.OpenAI`` (any OpenAI-compatible server via ``base_url``).
        name: the effect's name.
        store_at_provider: make calls with ``store=true`` and the effect key in ``metadata``, so an
            in-doubt call's answer is found at the provider instead of being paid for again.
        max_retries: the SDK's own retries (default 0: the guard's ``retry`` is the only budget).
        policy: what settles an in-doubt call (default ``at_least_once``: ask again).
        retry: the guard's retry budget for timeouts, 5xx and rate limits.
        usage: where to total usage (default: a new :class:`LlmUsage`, as ``self.usage``).
    """

    def create(self, *, key: str | None = None, **kwargs: Any) -> ChatCompletion:
        """``client.chat.completions.create(**kwargs)``, once per effect identity.

        Args:
            key: an explicit effect key instead of scope + ordinal.
            kwargs: what ``chat.completions.create`` takes (``model``, ``messages``, ``tools``, ...).

        Raises:
            ProviderRejected: refused (bad request: recorded and replayed; auth, rate limit: retried).
            ProviderUnavailable: no answer within the retry budget (nothing recorded).
        """
        arguments, sdk_kwargs = self._request(kwargs)

        def call() -> ChatCompletion:
            try:
                return cast(ChatCompletion, self.client.chat.completions.create(**self._keyed(sdk_kwargs)))
            except openai.OpenAIError as exc:
                raise map_error(exc) from exc

        return journaled_call(
            self.guard, self.name, call, result_type=ChatCompletion, key=key, arguments=arguments,
            tokens=usage_of, usage=self.usage, **self._run_options(self.reconcile),
        )  # fmt: skip

    def reconcile(self, request: ReconcileRequest) -> Applied[ChatCompletion] | NotAppliedResolution:
        """The stored completion made under the in-doubt call's effect key, if the provider has it."""
        page = self.client.chat.completions.list(
            metadata={METADATA_KEY: request.identity.search_key}, limit=1
        )
        return Applied(page.data[0]) if page.data else NOT_APPLIED


class AsyncChatJournal(_ChatBase[openai.AsyncOpenAI]):
    """The async twin of :class:`ChatJournal`, over an ``openai.AsyncOpenAI``."""

    async def create(self, *, key: str | None = None, **kwargs: Any) -> ChatCompletion:
        """See :meth:`ChatJournal.create`."""
        arguments, sdk_kwargs = self._request(kwargs)

        async def call() -> ChatCompletion:
            try:
                return cast(
                    ChatCompletion, await self.client.chat.completions.create(**self._keyed(sdk_kwargs))
                )
            except openai.OpenAIError as exc:
                raise map_error(exc) from exc

        return await ajournaled_call(
            self.guard, self.name, call, result_type=ChatCompletion, key=key, arguments=arguments,
            tokens=usage_of, usage=self.usage, **self._run_options(self.reconcile),
        )  # fmt: skip

    async def reconcile(self, request: ReconcileRequest) -> Applied[ChatCompletion] | NotAppliedResolution:
        """See :meth:`ChatJournal.reconcile`."""
        page = await self.client.chat.completions.list(
            metadata={METADATA_KEY: request.identity.search_key}, limit=1
        )
        return Applied(page.data[0]) if page.data else NOT_APPLIED


class _ModelDecorator:
    """A model callable journaled through :meth:`Guard.effect` (its arguments bound, fingerprinted
    and keyed as the decorator's), with the options and accounting of every journaled model call
    (:mod:`sagaguard.connectors.model_call`)."""

    def __init__(
        self, guard: Guard, name: str, usage: LlmUsage, tokens: Tokens, options: Mapping[str, Any]
    ) -> None:
        self.guard, self.name, self.usage, self.tokens, self.options = guard, name, usage, tokens, options

    @overload
    def __call__(self, fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]: ...

    def __call__(self, fn: Callable[P, Any]) -> Callable[P, Any]:
        if inspect.iscoroutinefunction(fn):
            afn: Callable[..., Awaitable[Any]] = fn

            @functools.wraps(fn)
            async def abody(*args: Any, **kwargs: Any) -> Any:
                mark_paid()
                return await afn(*args, **kwargs)

            aguarded: Callable[..., Awaitable[Any]] = self.guard.effect(self.name, **self.options)(abody)

            @functools.wraps(fn)
            async def aouter(*args: Any, **kwargs: Any) -> Any:
                with paid_box() as box:
                    result = await aguarded(*args, **kwargs)
                account(self.name, result, paid=box[0], tokens=self.tokens, usage=self.usage)
                return result

            return aouter

        @functools.wraps(fn)
        def body(*args: Any, **kwargs: Any) -> Any:
            mark_paid()
            return fn(*args, **kwargs)

        guarded: Callable[..., Any] = self.guard.effect(self.name, **self.options)(body)

        @functools.wraps(fn)
        def outer(*args: Any, **kwargs: Any) -> Any:
            with paid_box() as box:
                result = guarded(*args, **kwargs)
            account(self.name, result, paid=box[0], tokens=self.tokens, usage=self.usage)
            return result

        return outer


def journal_model(
    guard: Guard,
    name: str = "llm.call",
    *,
    usage: LlmUsage | None = None,
    tokens: Callable[[Any], tuple[int, int]] = usage_of,
    policy: Policy | str = Policy.AT_LEAST_ONCE,
    **effect_options: Unpack[EffectOptions],
) -> _ModelDecorator:
    """Journal any model callable (sync or async): a replay returns its recorded response.

    ::

        @journal_model(guard, "llm.plan")
        def plan(prompt: str) -> PlanResponse: ...

    Args:
        guard: the guard the calls run under.
        name: the effect's name.
        usage: where to total usage (tokens from ``tokens(result)``).
        tokens: (input, output) tokens of a result; default :func:`usage_of` (OpenAI shapes).
        policy: what settles an in-doubt call (default ``at_least_once``: ask again).
        effect_options: any other :meth:`Guard.effect` option (``fingerprint=``, ``key=``, ...),
            checked by mypy (:class:`~sagaguard.idempotency.options.EffectOptions`); ``retry`` is the
            guard's retry budget for ``ProviderUnavailable`` and retryable rejections.
    """
    retry = effect_options.pop("retry", None)
    options: dict[str, Any] = {**_options(policy, retry), **effect_options}
    return _ModelDecorator(guard, name, usage if usage is not None else LlmUsage(), tokens, options)
