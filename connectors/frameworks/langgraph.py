"""LangGraph adapter: tool calls, node effects and model calls keyed on the graph's own identity.

LangGraph re-runs an interrupted task from its first line; a finished sibling task is not re-run
(measured: docs/frameworks/langgraph.md). So an effect's key is the task's durable identity,
``thread_id`` + ``checkpoint_ns`` (which holds the task id), plus the call's position in the task:
the ``tool_call_id`` for tool calls (a ToolNode re-runs all of its calls, in a thread pool), a
per-task counter for sequential code. ``node_attempt`` stays out of the key: a retry is the same call.

::

    guard = Guard(open_store("sqlite:///sagaguard.db"))
    tools = ToolGuard(guard)
    node = ToolNode([book_flight], wrap_tool_call=tools.wrap_tool_call,
                    awrap_tool_call=tools.awrap_tool_call)
    model = JournaledChatModel(inner=ChatOpenAI(...).bind_tools([book_flight]), guard=guard)

    @task_scoped                 # guard.effect calls inside are keyed on this task
    def notify(state: State) -> State:
        send_receipt(state["order"])
        return state

    graph.invoke(inputs, {"configurable": {"thread_id": "t-1"}}, durability="sync")

Tools are read-only unless declared with :func:`~sagaguard.connectors.declare.changes_world`: a crash inside
a read-only tool re-runs it; a declared one is at most once, and ``on_doubt``
(:mod:`sagaguard.connectors.in_doubt`) says what a tool call does when it, or an effect inside it, is left in
doubt.

The model call is journaled so that a crash inside the model node replays the recorded
``AIMessage``: the same tool calls with the same ids, so the tools' keys stay the same. Run graphs
with ``durability="sync"``: the default ``"async"`` may lose the parent checkpoint in a crash, and
with it the task id the keys are built on (:class:`DurabilityWarning`, or refused with
``strict=True``). Works with any checkpointer (in-memory, SQLite, Postgres): the keys only use what
the graph puts in the config.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar, Unpack, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langgraph.config import get_config
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.runtime import get_runtime
from langgraph.types import Command
from pydantic import ConfigDict

from sagaguard.connectors.declare import ToolDeclaration, declaration_of, is_step, recorded_output
from sagaguard.connectors.in_doubt import OnDoubt, Pending
from sagaguard.connectors.model_call import ajournaled_call, journaled_call
from sagaguard.connectors.scoped import ScopedDecorator, scoped_by
from sagaguard.connectors.toolcall import STOP, ToolCallSite, arun_tool_call, run_tool_call
from sagaguard.idempotency.effect import Policy
from sagaguard.idempotency.errors import ConfigurationError, NoScope
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.keys import Scope, scope
from sagaguard.idempotency.options import PassedOptions

__all__ = [
    "DurabilityWarning",
    "JournaledChatModel",
    "ToolFailed",
    "ToolGuard",
    "check_durability",
    "graph_scope",
    "task_scope",
    "task_scope_id",
    "task_scoped",
    "tool_output",
]

P = ParamSpec("P")
R = TypeVar("R")

_CONF = "configurable"
_DURABILITY = "__pregel_durability"
"""Where LangGraph 1.x puts the run's durability mode (``langgraph._internal._constants``); set only
when ``durability=`` was passed (or inherited by a subgraph), else the run is ``"async"``."""

ToolResult = ToolMessage | Command[Any]
Execute = Callable[[ToolCallRequest], ToolResult]
AsyncExecute = Callable[[ToolCallRequest], Awaitable[ToolResult]]


class DurabilityWarning(UserWarning):
    """The graph runs with a durability other than ``"sync"``: a crash may lose the parent
    checkpoint, the task then gets a new id on resume, and its effects new keys."""


# -- the task's identity ---------------------------------------------------------------------------


def _graph_config(config: RunnableConfig | None) -> RunnableConfig | None:
    if config is not None:
        return config
    try:
        return get_config()
    except RuntimeError:  # not inside a runnable
        return None


def _configurable(config: RunnableConfig) -> Mapping[str, Any]:
    return cast(Mapping[str, Any], config.get(_CONF) or {})


def check_durability(config: RunnableConfig | None = None, *, strict: bool = False) -> None:
    """Warn (or refuse, with ``strict``) when the running graph's durability is not ``"sync"``.

    Args:
        config: the task's config (default: the current one, via ``langgraph.config.get_config``).
        strict: raise instead of warning.

    Raises:
        ConfigurationError: ``strict`` and the durability is ``"async"`` or ``"exit"``.
    """
    found = _graph_config(config)
    if found is None:
        return
    conf = _configurable(found)
    if not conf.get("checkpoint_ns"):
        return  # not inside a graph task
    # Absent when invoke() was not given durability=: the run then uses "async" (pregel/main.py).
    mode = conf.get(_DURABILITY, "async")
    if mode == "sync":
        return
    message = (
        f"the graph runs with durability={mode!r}: a crash may lose the parent checkpoint and give "
        "the re-run task a new id, so its effects would run again; pass durability='sync'"
    )
    if strict:
        raise ConfigurationError(message)
    warnings.warn(message, DurabilityWarning, stacklevel=3)


def task_scope_id(config: RunnableConfig | None = None, *, strict: bool = False) -> str:
    """The scope id of the current LangGraph task: ``thread_id`` + ``checkpoint_ns``.

    Args:
        config: the task's config (default: the current one).
        strict: refuse a durability other than ``"sync"`` (see :func:`check_durability`).

    Raises:
        NoScope: not inside a graph task, or the graph has no checkpointer (no ``thread_id``).
        ConfigurationError: ``strict`` and the durability is not ``"sync"``.
    """
    found = _graph_config(config)
    if found is None:
        raise NoScope("not inside a LangGraph task: pass config= or use `with scope(...)`")
    conf = _configurable(found)
    thread_id, ns = conf.get("thread_id"), conf.get("checkpoint_ns")
    if thread_id is None or not ns:
        raise NoScope(
            "the graph has no thread_id/checkpoint_ns: compile it with a checkpointer and "
            "invoke it with config={'configurable': {'thread_id': ...}}"
        )
    check_durability(found, strict=strict)
    # JSON, so no thread id can forge another's namespace by containing a separator.
    return json.dumps(["langgraph", str(thread_id), str(ns)], separators=(",", ":"))


class _TaskScopes:
    """One :class:`Scope` per task *attempt*, for code that runs in a task without our decorator.

    Keyed by the attempt's ``Runtime`` object, which LangGraph builds anew for every attempt, so a
    retry or a resume in the same process counts from zero again. Bounded: old attempts drop out.
    """

    def __init__(self, size: int = 4096) -> None:
        self._lock = threading.Lock()
        self._size = size
        self._scopes: OrderedDict[int, tuple[object, Scope]] = OrderedDict()

    def get(self, config: RunnableConfig, scope_id: str) -> Scope:
        # Holding the runtime keeps its id from being reused while the entry lives.
        owner: object = _attempt(config)
        with self._lock:
            entry = self._scopes.get(id(owner))
            if entry is None or entry[0] is not owner or entry[1].id != scope_id:
                entry = (owner, Scope(scope_id))
                self._scopes[id(owner)] = entry
                while len(self._scopes) > self._size:
                    self._scopes.popitem(last=False)
            self._scopes.move_to_end(id(owner))
            return entry[1]


def _attempt(config: RunnableConfig) -> object:
    """What identifies the current task attempt: its ``Runtime`` (public
    ``langgraph.runtime.get_runtime``), which LangGraph builds anew for every attempt; the config's
    ``configurable`` mapping outside a running graph."""
    try:
        runtime = get_runtime()
    except RuntimeError:  # not inside a runnable
        runtime = None
    return runtime if runtime is not None else _configurable(config)


_TASK_SCOPES = _TaskScopes()
_BOUND: ContextVar[tuple[str, Scope] | None] = ContextVar("sagaguard_langgraph_scope", default=None)
"""The scope this adapter made current, with the ``checkpoint_ns`` it belongs to: a subgraph's
task inherits the context of its parent's node and must not take the parent's scope for its own."""


def task_scope(config: RunnableConfig | None = None, *, strict: bool = False) -> Scope:
    """The :class:`Scope` of the current task attempt (its per-name counters included).

    Raises:
        NoScope, ConfigurationError: as :func:`task_scope_id`.
    """
    found = _graph_config(config)
    scope_id = task_scope_id(found, strict=strict)
    bound = _BOUND.get()
    assert found is not None  # task_scope_id raised otherwise
    if bound is not None and bound[0] == _configurable(found).get("checkpoint_ns"):
        return bound[1]
    return _TASK_SCOPES.get(found, scope_id)


@contextlib.contextmanager
def _bound(ns: str, scope_id: str) -> Iterator[Scope]:
    with scope(scope_id) as unit:
        token = _BOUND.set((ns, unit))
        try:
            yield unit
        finally:
            _BOUND.reset(token)


@contextlib.contextmanager
def graph_scope(config: RunnableConfig | None = None, *, strict: bool = False) -> Iterator[Scope]:
    """Run a block of a node or ``@task`` as the current task's scope.

    ``guard.effect`` calls inside get ordinals from a fresh per-task counter, so the re-run of the
    task after a crash maps each call to its first run's record. Sequential code only: parallel
    calls need an explicit ``key=``.

    Raises:
        NoScope, ConfigurationError: as :func:`task_scope_id`.
    """
    found = _graph_config(config)
    scope_id = task_scope_id(found, strict=strict)
    assert found is not None
    with _bound(str(_configurable(found).get("checkpoint_ns")), scope_id) as unit:
        yield unit


task_scoped: ScopedDecorator = scoped_by(graph_scope)
"""Decorate a node or ``@task`` function (sync or async) to run in :func:`graph_scope`.

Put it under ``@task`` (``@task`` then ``@task_scoped``), so it runs inside the task.
"""


# -- tool calls -------------------------------------------------------------------------------------


class ToolFailed(Exception):
    """A declared tool's call, a step of the agent run, failed, and ``ToolNode`` reported it only as
    an error message (``handle_tool_errors``): raised inside the step, so the step is a failure
    (never recorded as a success) and the run ends failed. The call may have applied (the
    message is all that is known): its undo runs with ``result=None``.

    Attributes:
        tool: the tool's name.
        message: the error text ``ToolNode`` made of the exception.
    """

    def __init__(self, tool: str, message: str) -> None:
        super().__init__(f"tool {tool!r} failed: {message}")
        self.tool = tool
        self.message = message


def _step_message(result: ToolResult, tool: str) -> ToolMessage:
    """A step's result: its ``ToolMessage``, or :class:`ToolFailed` for an error message."""
    message = _as_message(result)
    if message.status == "error":
        raise ToolFailed(tool, str(message.content))
    return message


def _as_message(result: ToolResult) -> ToolMessage:
    if isinstance(result, ToolMessage):
        return result
    raise ConfigurationError(
        f"a journaled tool returned {type(result).__name__}, not a ToolMessage: list the tool in "
        "ToolGuard(exclude=...) (Command results are not journaled)"
    )


class ToolGuard:
    """``wrap_tool_call`` / ``awrap_tool_call`` handlers for ``ToolNode``: each tool call is an
    effect keyed on ``thread_id`` + ``checkpoint_ns`` + ``tool_call_id`` or, in saga mode, a step of
    the open agent run. Both go through the one pipeline, :mod:`sagaguard.connectors.toolcall`.

    A re-run of the task returns the recorded ``ToolMessage`` without running the tool. Inside the
    tool, the call's scope is current, so ``guard.effect`` calls in the tool body are keyed on the
    tool call too (and ``gen_ai.tool.call.id`` is on their spans).

    Tools are read-only unless declared otherwise (:mod:`sagaguard.connectors.declare`): a crash or an error
    inside a read-only tool never parks the run, its next run asks again. A tool declared
    :func:`~sagaguard.connectors.declare.changes_world` is at most once: a crash inside it leaves it in doubt,
    and ``on_doubt`` says what the run does then (as for an in-doubt effect inside any tool).

    **Saga mode** (``saga=True``): the calls of tools declared with an undo
    (``@changes_world(undo="cancel_booking")``) or as the pivot (``@changes_world(pivot=True)``) are
    steps of the agent run open in the calling context (``with runner.run(saga, thread_id)``, or
    ``async with`` for the async handler): one journal commit registers the call with its undo,
    then it runs under the run's guard, keyed on the run id and the ``tool_call_id``. The undo
    receives the call's arguments and the tool's output (:func:`tool_output`). A step's failure
    ends the run whatever ``ToolNode`` does with it: an exception escaping the graph undoes the run
    as it leaves the block; an error message (``handle_tool_errors=True``) is raised inside the
    step as :class:`ToolFailed` (the step fails, maybe applied), and the run, failing, refuses new
    steps and is undone when the block ends (:meth:`sagaguard.saga.agent.AgentRun.fail_on_exit`).

    Args:
        guard: the guard the calls run under (a step runs under its run's guard).
        saga: make the calls of tools declared with an undo or as the pivot steps of the open run.
        declare: tool name to :class:`~sagaguard.connectors.declare.ToolDeclaration`, for tools not declared
            where they are defined (a mapping entry wins over a decorator).
        on_doubt: what a tool call does when it, or a guarded effect inside it, is in doubt:
            :class:`~sagaguard.connectors.in_doubt.Stop` (default: raise ``OutcomeUnknown``),
            :class:`~sagaguard.connectors.in_doubt.ReturnPending` or
            :class:`~sagaguard.connectors.in_doubt.WaitForOperator`.
        policy: one policy for every tool, declared or not, instead of the declarations
            (``"at_most_once"`` gives the behaviour before declarations existed).
        prefix: prepended to the tool's name to make the effect's name.
        exclude: names of tools that are not journaled (tools returning a ``Command``).
        strict: refuse a durability other than ``"sync"`` instead of warning.
        options: any other :meth:`Guard.run` option for every tool (``lease=``, ...).
    """

    def __init__(
        self,
        guard: Guard | None,
        *,
        saga: bool = False,
        declare: Mapping[str, ToolDeclaration] | None = None,
        on_doubt: OnDoubt = STOP,
        policy: Policy | str | None = None,
        prefix: str = "langgraph.tool.",
        exclude: Collection[str] = (),
        strict: bool = False,
        **options: Unpack[PassedOptions],
    ) -> None:
        self.guard = guard
        self.saga = saga
        self.declare = dict(declare or {})
        self.on_doubt = on_doubt
        self.policy = policy
        self.prefix = prefix
        self.exclude = frozenset(exclude)
        self.strict = strict
        self._options: PassedOptions = {**options}

    def site(self, request: ToolCallRequest) -> ToolCallSite[ToolMessage] | None:
        """The call as the pipeline sees it; None for an excluded tool (it runs as it is).

        Raises:
            ConfigurationError: the call has no id, or ``strict`` and the durability is not ``"sync"``.
            NoScope: a guarded call outside a graph task with a checkpointer.
        """
        call = request.tool_call
        name = call["name"]
        if name in self.exclude:
            return None
        call_id = call.get("id")
        if not call_id:
            raise ConfigurationError(f"tool call {name!r} has no id: it cannot be keyed")
        declaration = declaration_of(request.tool, name, self.declare)
        config = request.runtime.config
        ns = str(_configurable(config).get("checkpoint_ns") or "")
        if self.saga and is_step(declaration):
            scope_id = ""  # a step is keyed on its run, not on the task
        else:
            task = task_scope_id(config, strict=self.strict)
            scope_id = json.dumps([task, "tool_call", call_id], separators=(",", ":"))

        def message(pending: Pending) -> ToolMessage:
            return ToolMessage(content=pending.as_json(), tool_call_id=call_id, name=name)

        return ToolCallSite(
            tool=name, call_id=call_id, arguments=dict(call["args"]), fingerprint={"args": call["args"]},
            declaration=declaration, effect=self.prefix + name, scope_id=scope_id, pending=message,
            result_type=ToolMessage, record=tool_output, policy=self.policy, defaults=self._options,
            enter=functools.partial(_bound, ns),
        )  # fmt: skip

    def wrap_tool_call(self, request: ToolCallRequest, execute: Execute) -> ToolResult:
        """The sync handler: ``ToolNode(wrap_tool_call=tool_guard.wrap_tool_call)``.

        Raises:
            LookupError: in saga mode, a declared tool is called with no agent run open.
            ConfigurationError: a tool call has no id, or a journaled tool returned a ``Command``.
        """
        site = self.site(request)
        if site is None:
            return execute(request)
        read = self._reader(site)
        return run_tool_call(
            site, lambda: read(execute(request)), guard=self.guard, saga=self.saga, on_doubt=self.on_doubt
        )

    async def awrap_tool_call(self, request: ToolCallRequest, execute: AsyncExecute) -> ToolResult:
        """The async handler: ``ToolNode(awrap_tool_call=tool_guard.awrap_tool_call)`` (in saga
        mode, steps through :meth:`sagaguard.saga.agent.AgentRun.acall`: ``async with`` the run).
        It raises what :meth:`wrap_tool_call` raises.
        """
        site = self.site(request)
        if site is None:
            return await execute(request)
        read = self._reader(site)

        async def body() -> ToolMessage:
            return read(await execute(request))

        return await arun_tool_call(site, body, guard=self.guard, saga=self.saga, on_doubt=self.on_doubt)


    def _reader(self, site: ToolCallSite[ToolMessage]) -> Callable[[ToolResult], ToolMessage]:
        """How a call's result is read: a step's error message is a failure (:class:`ToolFailed`)."""
        if self.saga is not False and is_step(site.declaration):
            return functools.partial(_step_message, tool=site.tool)
        return _as_message


def tool_output(message: ToolMessage) -> Any:
    """What a tool returned, read back from its ``ToolMessage``: the content as JSON when it is
    JSON, else as it is (:func:`~sagaguard.connectors.declare.recorded_output`)."""
    return recorded_output(message.content)


# -- model calls ------------------------------------------------------------------------------------


def _message_args(
    messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    # Message ids are left out: they say where a message is stored, not what the model was asked.
    dumped = [m.model_dump(mode="json", exclude={"id"}) for m in messages]
    return {"messages": dumped, "stop": stop, **kwargs}


def _ai(message: Any) -> AIMessage:
    if isinstance(message, AIMessage):
        return message
    raise ConfigurationError(f"the journaled model returned {type(message).__name__}, not an AIMessage")


def _tokens(message: AIMessage) -> tuple[int, int]:
    usage = message.usage_metadata
    return (usage["input_tokens"], usage["output_tokens"]) if usage else (0, 0)


class JournaledChatModel(BaseChatModel):
    """A chat model whose calls are journaled: a re-run returns the recorded ``AIMessage``.

    Inside a graph the key is the task's scope plus the model call's ordinal in the task attempt
    (inside a journaled tool call: the tool call's scope); outside a graph, the current
    :func:`~sagaguard.idempotency.keys.scope`. The recorded message keeps its tool calls and their ids, so
    the tools the resumed run calls have the keys of the first run's.

    A call is journaled as every adapter's model call is
    (:data:`~sagaguard.connectors.model_call.MODEL_OPTIONS`): a call that raised has no answer to
    act on, so its claim is dropped and it is not retried inside the claim (the graph's retry
    policy, or the re-run, asks again under the same key).

    Attributes:
        inner: the model to ask: a chat model, or one with tools bound (``model.bind_tools(...)``).
        guard: the guard the calls run under.
        effect_name: the effect's name.
        policy: what a call left in doubt does (default ``at_least_once``: ask again; a model call
            changes nothing in the world, the tools it picks are effects of their own).
        strict: refuse a durability other than ``"sync"`` instead of warning.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    inner: Runnable[LanguageModelInput, BaseMessage]
    guard: Guard
    effect_name: str = "langgraph.model"
    policy: Policy = Policy.AT_LEAST_ONCE
    strict: bool = False

    @property
    def _llm_type(self) -> str:
        return "sagaguard-journaled"

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | Any],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind the tools on the inner model and journal the result."""
        bind = getattr(self.inner, "bind_tools", None)
        if bind is None:
            raise ConfigurationError("the inner model has no bind_tools: bind them before wrapping it")
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return self.model_copy(update={"inner": bind(tools, **kwargs)})

    def _key(self) -> str | None:
        """An explicit key for a call in a task not scoped by this adapter, else None (scope + ordinal)."""
        config = _graph_config(None)
        if config is None or not _configurable(config).get("thread_id"):
            return None
        unit = task_scope(config, strict=self.strict)
        return json.dumps(
            [unit.id, self.effect_name, unit.next_ordinal(self.effect_name)], separators=(",", ":")
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        message = journaled_call(
            self.guard, self.effect_name, lambda: _ai(self.inner.invoke(messages, stop=stop, **kwargs)),
            result_type=AIMessage, key=self._key(), arguments=_message_args(messages, stop, kwargs),
            tokens=_tokens, policy=self.policy,
        )  # fmt: skip
        return ChatResult(generations=[ChatGeneration(message=message)])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        async def call() -> AIMessage:
            return _ai(await self.inner.ainvoke(messages, stop=stop, **kwargs))

        message = await ajournaled_call(
            self.guard, self.effect_name, call, result_type=AIMessage, key=self._key(),
            arguments=_message_args(messages, stop, kwargs), tokens=_tokens, policy=self.policy,
        )  # fmt: skip
        return ChatResult(generations=[ChatGeneration(message=message)])
