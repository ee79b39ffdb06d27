"""The one pipeline where an agent's tool call becomes a guarded effect or a step of the open run.

Every framework adapter (LangGraph's ``ToolNode`` handler, ``create_agent``'s middleware, the Agents
SDK's tools, ...) keeps only what is its framework's own: how it names the run and the call, and how
it intercepts a tool. It describes one call as a :class:`ToolCallSite` and hands it, with the tool's
body, to :func:`run_tool_call` (sync) or :func:`arun_tool_call` (async). Those decide and do the rest,
the same way for every framework:

1. :func:`decide` (pure, no I/O): a call of a tool declared with an undo or as the pivot is a
   :class:`Step` of the open agent run when the adapter runs in saga mode; any other call is a
   guarded :class:`Effect`; either way under the options :func:`call_options` merges, the one
   precedence rule: the adapter's options for this tool, over the declaration's own, over the
   adapter's options for every tool, over the defaults of the declaration's kind, over the guard's.
2. The call's id is current (``gen_ai.tool.call.id`` on the spans) and the effect is marked a tool
   call, so its span is the GenAI ``execute_tool {name}`` span (docs/telemetry.md).
3. Each attempt runs the body in a fresh scope named after the call, so the guarded effects inside
   the tool get the same keys on every attempt (an attempt after an operator's resolution included).
4. The effect runs under the guard, or the step through
   :meth:`sagaguard.saga.agent.AgentRun.call` (its undo registered with the claim, in one commit).
5. An in-doubt answer is settled as ``on_doubt`` says (:mod:`sagaguard.connectors.in_doubt`).
6. A step's exception that reaches the framework marks its run failing
   (:meth:`sagaguard.saga.agent.AgentRun.fail_on_exit`): whatever the framework does with it (a
   message for its model), no new step runs and the run ends failed.

Decide once, drive twice: the two drivers differ only in ``Guard.run``/``arun``, ``call``/``acall``
and ``settle``/``asettle``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypedDict, TypeVar, cast

from sagaguard.connectors.declare import ToolDeclaration, is_step, kind_options, recorded_output
from sagaguard.connectors.in_doubt import OnDoubt, Pending, Stop, asettle, settle
from sagaguard.idempotency.effect import Policy
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.keys import Scope, scope
from sagaguard.idempotency.options import PassedOptions, RunArguments, RunOptions
from sagaguard.idempotency.telemetry import TOOL_CALL_ID
from sagaguard.saga.agent import AgentRun, current_run

__all__ = [
    "STOP",
    "SagaMode",
    "Effect",
    "Step",
    "ToolCallSite",
    "arun_tool_call",
    "call_options",
    "decide",
    "run_tool_call",
]

T = TypeVar("T")

STOP = Stop()
"""The default ``on_doubt``: an in-doubt call raises ``OutcomeUnknown``."""

_EMPTY = cast(RunOptions, MappingProxyType({}))
"""No options (read-only: one shared instance is every site's default)."""

SagaMode = bool | Callable[[], AgentRun]
"""An adapter's saga mode: False (every call is a guarded effect), True (the calls of tools declared
with an undo or as the pivot are steps of the run open in this context,
:func:`~sagaguard.saga.agent.current_run`), or a function returning the run they are steps of (an
adapter that knows its run, and says so when it is not open)."""


def _enter(scope_id: str) -> contextlib.AbstractContextManager[Scope]:
    return scope(scope_id)


@dataclass(frozen=True)
class ToolCallSite(Generic[T]):
    """One tool call as a framework adapter names it: everything the pipeline needs, no behaviour.

    Build one per call; :func:`run_tool_call` / :func:`arun_tool_call` run it.
    """

    tool: str
    """The tool's name (a step's name in the run, and what the declaration was looked up by)."""
    call_id: str
    """The call's stable id: the framework's (the model's ``tool_call_id``), or one the adapter
    derives where the framework has none (see :attr:`framework_call_id`)."""
    arguments: Mapping[str, Any]
    """The call's arguments as a step records them: fingerprinted, and given to its undo."""
    declaration: ToolDeclaration
    """What the tool does to the world (:func:`~sagaguard.connectors.declare.declaration_of`)."""
    effect: str
    """The guarded effect's name (a step's effect is named by the run)."""
    scope_id: str
    """The scope a guarded call's attempt runs in (its key, when :attr:`key` is None, is this
    scope's first call of :attr:`effect`)."""
    pending: Callable[[Pending], T]
    """Turns an in-doubt answer into the framework's tool result (``ReturnPending``)."""
    fingerprint: Mapping[str, Any] | None = None
    """What a guarded call's fingerprint covers (default: :attr:`arguments`)."""
    key: str | None = None
    """An explicit key for the guarded effect (else scope + ordinal in :attr:`scope_id`)."""
    result_type: Any = Any
    """The type the result is stored as."""
    record: Callable[[T], Any] = recorded_output
    """What a step records of the result for its undo (the tool's own output)."""
    policy: Policy | str | None = None
    """The adapter's one policy for every tool, over the declarations (None: the declarations)."""
    defaults: PassedOptions = field(default_factory=lambda: _EMPTY)
    """The adapter's :meth:`Guard.run` options for every tool: over the defaults of the
    declaration's kind, under the declaration's own options (:func:`call_options`)."""
    options: RunOptions = field(default_factory=lambda: _EMPTY)
    """The adapter's options for this tool by name: over every other layer (:func:`call_options`)."""
    framework_call_id: bool = True
    """:attr:`call_id` is the framework's own tool-call id, put on the spans as
    ``gen_ai.tool.call.id``; False for an id the adapter derived (a key: never on a span)."""
    enter: Callable[[str], contextlib.AbstractContextManager[Scope]] = _enter
    """How an attempt enters its scope (default :func:`~sagaguard.idempotency.keys.scope`; LangGraph
    also remembers which task the scope belongs to)."""

    def __post_init__(self) -> None:
        if not self.call_id:
            raise ConfigurationError(f"tool call {self.tool!r} has no id: it cannot be keyed")


@dataclass(frozen=True)
class Effect:
    """The call is a guarded effect: ``Guard.run(name, body, key=key, **options)``."""

    name: str
    key: str | None
    options: RunOptions


@dataclass(frozen=True)
class Step:
    """The call is a step of the open agent run (:meth:`sagaguard.saga.agent.AgentRun.call`)."""

    undo: str | None
    pivot: bool
    options: RunOptions


def call_options(
    declaration: ToolDeclaration,
    *,
    policy: Policy | str | None = None,
    adapter: PassedOptions = _EMPTY,
    call: RunOptions = _EMPTY,
) -> RunOptions:
    """The :meth:`Guard.run` options of one tool call: the one precedence rule of every adapter.

    Highest first, each option taken from the first layer that gives it:

    1. ``call``: the options the adapter was given for this tool by name (the Agents SDK's
       ``tool_options={name: {...}}``);
    2. the declaration's own options (``changes_world(reconciler=..., policy=...)``);
    3. ``adapter``: the adapter's options for every tool (its ``**options``: ``retry=``,
       ``classify=``, ``lease=``, ...), and its ``policy=``;
    4. the defaults of the declaration's kind (:func:`~sagaguard.connectors.declare.kind_options`:
       read-only at least once, a compensatable step at least once, any other world-changing call
       at most once, none retried inside its claim);
    5. the guard's own defaults (whatever no layer gives).

    The call is always marked a tool call (``tool=True``).
    """
    # A declaration's own options are the caller's Guard.run options, kept as a plain mapping: the
    # guard checks their names when it runs the call.
    kind = cast(RunOptions, kind_options(declaration, policy))
    declared = cast(RunOptions, declaration.options)
    return {**kind, **adapter, **declared, **call, "tool": True}


def decide(site: ToolCallSite[Any], *, saga: SagaMode) -> Effect | Step:
    """What the call is, from its declaration and the adapter's mode (no I/O).

    Args:
        site: the call.
        saga: the adapter's saga mode (:data:`SagaMode`).
    """
    declaration = site.declaration
    options = call_options(declaration, policy=site.policy, adapter=site.defaults, call=site.options)
    if saga is not False and is_step(declaration):
        return Step(declaration.undo, declaration.pivot, options)
    return Effect(site.effect, site.key, options)


@contextlib.contextmanager
def _call_id(site: ToolCallSite[Any]) -> Iterator[None]:
    token = TOOL_CALL_ID.set(site.call_id if site.framework_call_id else None)
    try:
        yield
    finally:
        TOOL_CALL_ID.reset(token)


def run_tool_call(
    site: ToolCallSite[T],
    body: Callable[[], T],
    *,
    guard: Guard | None,
    saga: SagaMode,
    on_doubt: OnDoubt = STOP,
) -> T:
    """Run one tool call through the pipeline (see the module docstring).

    Args:
        site: the call, as the adapter names it.
        body: runs the tool (the framework's own execution) and returns its result.
        guard: the guard a guarded call runs under (a step runs under its run's guard).
        saga: the adapter's saga mode (:data:`SagaMode`).
        on_doubt: what the call does when it, or a guarded effect inside it, is in doubt.

    Raises:
        LookupError: a step with no agent run open.
        ConfigurationError: a guarded call with no guard.
        OutcomeUnknown: the call is in doubt and ``on_doubt`` says to stop.
        and whatever the tool, the guard or the run raises.
    """
    plan = decide(site, saga=saga)
    if isinstance(plan, Step):
        run = _run_of(saga)

        def step_body() -> T:
            with site.enter(run.call_key(site.call_id)):  # a fresh scope per attempt
                return body()

        def step() -> T:
            return run.call(site.tool, step_body, site.arguments, **_step_options(site, plan))

        with _call_id(site), _failing(run):
            return settle(step, on_doubt, run.runner.guard.store, site.pending)
    effect_guard = _guarded(guard, site)

    def call() -> T:
        with site.enter(site.scope_id):  # a fresh scope per attempt
            return effect_guard.run(plan.name, body, **_effect_options(site, plan))

    with _call_id(site):
        return settle(call, on_doubt, effect_guard.store, site.pending)


async def arun_tool_call(
    site: ToolCallSite[T],
    body: Callable[[], Awaitable[T]],
    *,
    guard: Guard | None,
    saga: SagaMode,
    on_doubt: OnDoubt = STOP,
) -> T:
    """The async twin of :func:`run_tool_call`: ``body`` is awaited under ``Guard.arun`` or
    :meth:`sagaguard.saga.agent.AgentRun.acall` (``async with`` the run).
    It raises what :func:`run_tool_call` raises.
    """
    plan = decide(site, saga=saga)
    if isinstance(plan, Step):
        # An adapter's own lookup may open its run (a journal commit): off the event loop.
        run = await asyncio.to_thread(saga) if callable(saga) else current_run()

        async def step_body() -> T:
            with site.enter(run.call_key(site.call_id)):
                return await body()

        async def step() -> T:
            return await run.acall(site.tool, step_body, site.arguments, **_step_options(site, plan))

        with _call_id(site), _failing(run):
            return await asettle(step, on_doubt, run.runner.guard.store, site.pending)
    effect_guard = _guarded(guard, site)

    async def call() -> T:
        with site.enter(site.scope_id):
            return await effect_guard.arun(plan.name, body, **_effect_options(site, plan))

    with _call_id(site):
        return await asettle(call, on_doubt, effect_guard.store, site.pending)


@contextlib.contextmanager
def _failing(run: AgentRun) -> Iterator[None]:
    """A step's exception reaches the framework, which may turn it into a message for its model
    and go on: the run is told, so it ends failed whatever the framework does
    (:meth:`~sagaguard.saga.agent.AgentRun.fail_on_exit`). An answer ``on_doubt`` gave instead
    (``ReturnPending``) is not a failure."""
    try:
        yield
    except Exception as exc:
        run.fail_on_exit(exc)
        raise


class _StepOptions(TypedDict, Generic[T]):
    """The keyword arguments of :meth:`~sagaguard.saga.agent.AgentRun.call` and ``acall`` for a step."""

    undo: str | None
    pivot: bool
    call_id: str
    result_type: Any
    record: Callable[[T], Any]
    options: RunOptions


def _step_options(site: ToolCallSite[T], plan: Step) -> _StepOptions[T]:
    """What both drivers pass a step's ``call``/``acall`` (pure, no I/O)."""
    return _StepOptions(
        undo=plan.undo, pivot=plan.pivot, call_id=site.call_id, result_type=site.result_type,
        record=site.record, options=plan.options,
    )  # fmt: skip


def _effect_options(site: ToolCallSite[Any], plan: Effect) -> RunArguments:
    """What both drivers pass ``Guard.run``/``arun`` for a guarded call (pure, no I/O): its
    fingerprinted arguments (:attr:`ToolCallSite.fingerprint`, else the call's), key and options."""
    fingerprinted = site.arguments if site.fingerprint is None else site.fingerprint
    return {"arguments": fingerprinted, "key": plan.key, "result_type": site.result_type, **plan.options}


def _run_of(saga: SagaMode) -> AgentRun:
    return saga() if callable(saga) else current_run()


def _guarded(guard: Guard | None, site: ToolCallSite[Any]) -> Guard:
    if guard is None:
        raise ConfigurationError(f"tool {site.tool!r} is not a step of a run and has no guard to run under")
    return guard
