"""CrewAI adapter: tools that happen once and model calls that replay, across ``Crew.from_checkpoint``.

::

    crew_guard = CrewGuard(Guard(open_store("sqlite:///sagaguard.db")))
    crew = crew_guard.protect(Crew(agents=[...], tasks=[...], checkpoint=CheckpointConfig(
        location="./.checkpoints", on_events=["task_started", "task_completed"])))
    crew.kickoff()

    # after a crash, in a new process:
    crew = crew_guard.protect(Crew.from_checkpoint(CheckpointConfig(restore_from=path)))
    crew.kickoff()

A restored crew re-runs the task it was in from the task's first step (measured:
docs/frameworks/crewai.md). What survives the restore is the kickoff's event id (the ``crew_kickoff_started``
event, restored as the crew's event scope) and the task's id (``crewai.context.get_current_task_id``).
So, in a task of a kickoff:

- a tool run (``BaseTool._run`` / ``_arun``) is an effect keyed on (kickoff, task, tool name, argument
  hash, n): the n-th call of that tool with those arguments in this run of the task. No tool-call id
  reaches CrewAI tools, hence the argument hash. A re-run returns the recorded result without running
  the tool; inside the tool, a scope of the call is current, so ``guard.effect`` calls there are keyed
  on it too.
- a model call (``BaseLLM.call`` / ``acall``) is a journaled effect keyed on (kickoff, task, n): the
  n-th call in this run of the task. The re-run gets the recorded answers, hence the same tool calls,
  and pays nothing for them.

Checkpoint at task boundaries (``on_events=["task_started", "task_completed"]``): the counts start
again with each run of a task, which is what a restore at ``task_started`` replays. A checkpoint taken
mid-task (on tool or model events) resumes the agent from its saved messages, past calls the counts
no longer see; the model journal then refuses the shifted call (``KeyConflict``, its messages
differ) rather than replay the wrong answer. CrewAI writes checkpoints from its event-bus threads,
and 1.15 loses one now and then to a race in its own serialisation; a protected crew's tasks wait,
at their start, until their ``task_started`` checkpoint is written
(:mod:`sagaguard.connectors.frameworks._crewai_checkpoint`), so a crash inside the first task finds
it on disk, not a crew with nothing to restore (a new kickoff, new keys). A later checkpoint that
is missing (a ``task_completed`` one, or rarely a later task's start) sends the restore back one
more task boundary, and the keys, which do not depend on it, still match.

With ``CrewGuard(guard, saga=CrewSaga(...))`` each kickoff is also an agent saga run, and the calls
of tools declared with an undo or as the pivot are its steps
(:mod:`sagaguard.connectors.frameworks.crewai_saga`).

Objects are guarded in place (their ``_run`` / ``call`` are replaced on the instance), so a crew's
checkpoint is the same with sagaguard or without; a restored crew holds fresh objects, hence
``protect`` again after ``from_checkpoint``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Unpack

from crewai import Crew
from crewai.context import capture_execution_context, get_current_task_id
from crewai.llms.base_llm import BaseLLM
from crewai.tools import BaseTool
from pydantic import BaseModel

from sagaguard.connectors.declare import ToolDeclaration, declaration_of, recorded_output
from sagaguard.connectors.frameworks._crewai_checkpoint import wait_for_task_checkpoints
from sagaguard.connectors.frameworks._crewai_patch import is_marked, mark, shadow
from sagaguard.connectors.in_doubt import OnDoubt, Pending
from sagaguard.connectors.model_call import ajournaled_call, journaled_call
from sagaguard.connectors.toolcall import STOP, SagaMode, ToolCallSite, arun_tool_call, run_tool_call
from sagaguard.idempotency.effect import Policy
from sagaguard.idempotency.errors import CodecError, ConfigurationError, NoScope
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.keys import current_scope, fingerprint
from sagaguard.idempotency.options import PassedOptions

if TYPE_CHECKING:
    from sagaguard.connectors.frameworks.crewai_saga import CrewSaga

__all__ = [
    "ANSWER_TYPES",
    "CrewGuard",
    "UnknownAnswerType",
    "dump_answer",
    "kickoff_id",
    "load_answer",
    "task_scope_id",
]

_KICKOFF = "crew_kickoff_started"
_TASK_STARTED = "task_started"


# -- the task's identity ---------------------------------------------------------------------------


def _stack() -> tuple[tuple[str, str], ...]:
    # CrewAI's event scope stack, read through its public execution-context capture: (event id,
    # event type) pairs, outermost first; ``Crew.from_checkpoint`` restores the kickoff's entry.
    return tuple(capture_execution_context().event_id_stack)


def kickoff_id() -> str | None:
    """The event id of the current crew kickoff (stable across ``from_checkpoint``), or None."""
    return next((event_id for event_id, kind in _stack() if kind == _KICKOFF), None)


def _attempt() -> str:
    # The innermost task_started event: a new one each time a task (re)starts.
    return next((event_id for event_id, kind in reversed(_stack()) if kind == _TASK_STARTED), "")


def task_scope_id() -> str:
    """The scope id of the current task of a crew kickoff: kickoff event id + task id.

    Outside a crew kickoff (an agent run on its own), the current :func:`~sagaguard.idempotency.keys.scope`
    stands for the kickoff: name the run with ``with scope("run-7"):``.

    Raises:
        NoScope: neither inside a crew kickoff nor in a scope.
    """
    kickoff = kickoff_id()
    if kickoff is None:
        try:
            kickoff = "scope:" + current_scope().id
        except NoScope:
            raise NoScope(
                "not inside a CrewAI crew kickoff: run guarded tools and models in Crew.kickoff(), "
                "or name the run with `with scope(...)`"
            ) from None
    # JSON, so no id can forge another's by containing a separator.
    return json.dumps(["crewai", kickoff, get_current_task_id() or ""], separators=(",", ":"))


class _Counts:
    """Call counters per run of a task (kickoff, task, ``task_started`` event). Thread-safe, bounded."""

    def __init__(self, size: int = 4096) -> None:
        self._lock = threading.Lock()
        self._size = size
        self._runs: OrderedDict[tuple[str, str], dict[str, int]] = OrderedDict()

    def _run(self, unit: str) -> dict[str, int]:
        found = self._runs.get((unit, _attempt()))
        if found is None:
            found = self._runs[(unit, _attempt())] = {}
            while len(self._runs) > self._size:
                self._runs.popitem(last=False)
        return found

    def peek(self, unit: str, name: str) -> int:
        with self._lock:
            return self._run(unit).get(name, 0)

    def take(self, unit: str, name: str) -> int:
        with self._lock:
            counts = self._run(unit)
            n = counts[name] = counts.get(name, 0) + 1
            return n - 1

    def advance(self, unit: str, name: str, past: int) -> None:
        with self._lock:
            counts = self._run(unit)
            counts[name] = max(counts.get(name, 0), past + 1)

    def forget(self, kickoff: str) -> None:
        """Drop the counters of ``kickoff``: a restored crew runs its task again from call 0."""
        with self._lock:
            for unit in [u for u in self._runs if json.loads(u[0])[1] == kickoff]:
                del self._runs[unit]


# -- storable values -------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """``value`` as JSON types, for fingerprints: models by their JSON dump, anything else by str."""
    return json.loads(json.dumps(value, default=_default))


def _default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return str(value)


class UnknownAnswerType(CodecError):
    """A journaled model answer names a type the adapter was not given: it is never imported.

    Whoever can write to the ledger would otherwise choose what gets imported (the same class of
    hole as unpickling). Pass the type to ``CrewGuard(models=...)`` if it is yours.
    """


ANSWER_TYPES: tuple[tuple[str, str], ...] = (
    ("openai.types.chat", "ChatCompletionMessageFunctionToolCall"),
    ("openai.types.chat", "ChatCompletionMessageCustomToolCall"),
    ("openai.types.chat", "ChatCompletionMessageToolCall"),
    ("litellm.types.utils", "ChatCompletionMessageToolCall"),
    ("anthropic.types", "ToolUseBlock"),
)
"""The model clients' tool-call types a journaled answer may hold besides the crew's own models,
as (module, name) fixed here, never read from stored data. Those installed are registered."""


def _model_type(model: BaseModel | type[BaseModel]) -> str:
    cls = model if isinstance(model, type) else type(model)
    return f"{cls.__module__}:{cls.__qualname__}"


def _known_answer_types() -> dict[str, type[BaseModel]]:
    """The installed types of :data:`ANSWER_TYPES`, by the name a journaled answer gives them."""
    found: dict[str, type[BaseModel]] = {}
    for module_name, name in ANSWER_TYPES:
        try:
            module = importlib.import_module(module_name)  # a name from this file, not from data
        except ImportError:
            continue
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseModel):
            found[_model_type(cls)] = cls
    return found


def _load_model(spec: Mapping[str, Any], models: Mapping[str, type[BaseModel]]) -> BaseModel:
    name = str(spec.get("type"))
    cls = models.get(name)
    if cls is None:
        raise UnknownAnswerType(
            f"a journaled model answer names {name!r}, which this CrewGuard was not given "
            "(the crew's output models, a call's response_model, models=...): it is not imported"
        )
    # Rebuilt only through the model's own validation.
    return cls.model_validate(spec["data"])


def dump_answer(answer: Any) -> dict[str, Any]:
    """A model answer as JSON: text, pydantic models (tool calls, structured output), or JSON values.

    Raises:
        ConfigurationError: the answer is none of those.
    """
    if isinstance(answer, BaseModel):
        return {"model": {"type": _model_type(answer), "data": answer.model_dump(mode="json")}}
    if isinstance(answer, list) and answer and all(isinstance(a, BaseModel) for a in answer):
        return {"models": [{"type": _model_type(a), "data": a.model_dump(mode="json")} for a in answer]}
    try:
        return {"json": json.loads(json.dumps(answer))}
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"a {type(answer).__name__} model answer cannot be journaled") from exc


def load_answer(data: Mapping[str, Any], models: Mapping[str, type[BaseModel]] | None = None) -> Any:
    """The inverse of :func:`dump_answer`.

    Args:
        data: what :func:`dump_answer` stored.
        models: the pydantic types an answer may be rebuilt as, by ``"module:qualname"`` (a
            :class:`CrewGuard` passes its registry). A stored answer naming any other type is refused;
            nothing named by stored data is ever imported.

    Raises:
        UnknownAnswerType: the answer names a type not in ``models``.
    """
    known = models or {}
    if "model" in data:
        return _load_model(data["model"], known)
    if "models" in data:
        return [_load_model(spec, known) for spec in data["models"]]
    return data["json"]


# -- the guard ---------------------------------------------------------------------------------------


class CrewGuard:
    """Guards a crew's tools and journals its models, keyed on the kickoff and the task.

    Args:
        guard: the guard the calls run under.
        declare: tool name to :class:`~sagaguard.connectors.declare.ToolDeclaration`. Tools are read-only
            unless declared (here or with ``@changes_world`` on the tool or its function): a crash
            inside a read-only tool re-runs it; only a tool that changes the world is at most once.
        on_doubt: what a tool run does when it, or a guarded effect inside it, is in doubt
            (:mod:`sagaguard.connectors.in_doubt`: ``Stop()``, the default, raises ``OutcomeUnknown``, which
            the agent sees as a tool error; ``ReturnPending()``; ``WaitForOperator(...)``).
        policy: one policy for every tool instead of the declarations (``"at_most_once"`` gives
            the behaviour before declarations existed).
        journal_llm: journal the agents' model calls (default True).
        tool_prefix: prepended to a tool's name to make its effect's name.
        llm_effect: the effect name of the model calls.
        exclude: names of tools that are not guarded at all.
        models: pydantic types a journaled model answer may be rebuilt as, besides those the
            adapter finds itself: the tasks' ``output_pydantic`` / ``output_json`` (registered by
            :meth:`protect`), a call's ``response_model``, the model clients' tool-call types
            (:data:`ANSWER_TYPES`) and the types of answers this guard journaled. A journaled answer
            naming any other type raises :class:`UnknownAnswerType`; it is never imported.
        saga: run each kickoff as an agent run
            (:class:`~sagaguard.connectors.frameworks.crewai_saga.CrewSaga`): the calls of tools declared
            ``changes_world(undo=...)`` or ``changes_world(pivot=True)`` become its steps, undone when the
            kickoff fails. Without it those declarations only say that the tool changes the world.
        options: any other :meth:`Guard.run` option for the tool runs (``reconciler=``, ``lease=``).
    """

    def __init__(
        self,
        guard: Guard,
        *,
        declare: Mapping[str, ToolDeclaration] | None = None,
        on_doubt: OnDoubt = STOP,
        policy: Policy | str | None = None,
        journal_llm: bool = True,
        tool_prefix: str = "crewai.tool.",
        llm_effect: str = "crewai.llm",
        exclude: Collection[str] = (),
        models: Iterable[type[BaseModel]] = (),
        saga: CrewSaga | None = None,
        **options: Unpack[PassedOptions],
    ) -> None:
        self.guard = guard
        self.saga = saga
        self._models: dict[str, type[BaseModel]] = _known_answer_types()
        self._models_lock = threading.Lock()
        for model in models:
            self.register(model)
        self.journal_llm = journal_llm
        self.tool_prefix = tool_prefix
        self.llm_effect = llm_effect
        self.exclude = frozenset(exclude)
        self.declare = dict(declare or {})
        self.on_doubt = on_doubt
        self.policy = policy
        self._options: PassedOptions = {**options}
        self._counts = _Counts()

    # -- wiring ----------------------------------------------------------------------------------

    def register(self, model: Any) -> None:
        """Allow journaled answers to be rebuilt as ``model`` (a pydantic model class).

        Raises:
            ConfigurationError: ``model`` is not a pydantic model class.
        """
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigurationError(f"a CrewGuard rebuilds pydantic model classes only, not {model!r}")
        with self._models_lock:
            self._models[_model_type(model)] = model

    def _register_declared(self, model: Any) -> None:
        if isinstance(model, type) and issubclass(model, BaseModel):
            self.register(model)

    def protect(self, crew: Crew) -> Crew:
        """Guard the tools and journal the models of every agent and task of ``crew``, in place
        (and the crew's ``manager_llm``, ``function_calling_llm`` and ``planning_llm``).

        Call it on a new crew and on each one ``Crew.from_checkpoint`` returns (restored objects
        are new, unguarded ones). Guarding twice is harmless. With ``saga=``, the crew's
        ``kickoff`` and ``akickoff`` are wrapped too: each kickoff is an agent run.

        When the crew has a checkpoint configured, each of its tasks waits at its start until
        CrewAI's event bus has written the checkpoint of that start, so that one is on disk before
        the task's first model or tool call (one process-wide ``pre_step`` hook, registered once:
        :mod:`sagaguard.connectors.frameworks._crewai_checkpoint`).

        Returns:
            ``crew``.
        """
        restored = getattr(crew, "checkpoint_kickoff_event_id", None)
        if isinstance(restored, str):
            self._counts.forget(restored)  # a restore in this process counts the task's calls anew
        agents = list(crew.agents or [])
        if crew.manager_agent is not None:
            agents.append(crew.manager_agent)
        for agent in agents:
            self.protect_agent(agent)
        for task in crew.tasks or []:
            self.protect_tools(task.tools or [])
            for declared in (getattr(task, "output_pydantic", None), getattr(task, "output_json", None)):
                self._register_declared(declared)
        if self.journal_llm:
            for llm in (crew.manager_llm, crew.function_calling_llm, crew.planning_llm):
                if isinstance(llm, BaseLLM):
                    self.journal(llm)
        wait_for_task_checkpoints(crew)
        if self.saga is not None:
            self.saga.attach(crew)
        return crew

    def protect_agent(self, agent: Any) -> Any:
        """Guard one agent's tools and journal its models (``llm``, ``function_calling_llm``)."""
        self.protect_tools(agent.tools or [])
        if self.journal_llm:
            for llm in (agent.llm, getattr(agent, "function_calling_llm", None)):
                if isinstance(llm, BaseLLM):
                    self.journal(llm)
        return agent

    def protect_tools(self, tools: Iterable[BaseTool]) -> None:
        """Guard each tool (see :meth:`guard_tool`) not named in ``exclude``."""
        for tool in tools:
            if tool.name not in self.exclude:
                self.guard_tool(tool)

    def guard_tool(self, tool: BaseTool) -> BaseTool:
        """Make ``tool``'s runs guarded effects, in place; returns it. With ``saga=``, the runs of
        a tool declared with an undo or as the pivot are steps of the kickoff's run instead
        (:meth:`~sagaguard.connectors.frameworks.crewai_saga.CrewSaga.current`). Either way each
        run goes through the one pipeline (:mod:`sagaguard.connectors.toolcall`)."""
        if is_guarded(tool):
            return tool
        run = tool._run
        # A tool made with @tool runs its function through _run(*args, **kwargs): a step's
        # arguments are named after the function's own parameters.
        func = getattr(tool, "func", None)
        signature_of = func if callable(func) else run
        name = self.tool_prefix + str(tool.name)
        declaration = declaration_of(tool, str(tool.name), self.declare)
        saga: SagaMode = False if self.saga is None else self.saga.current

        def site(
            args: tuple[Any, ...], kwargs: Mapping[str, Any], named: Callable[..., Any]
        ) -> ToolCallSite[Any]:
            arguments, key, unit = self._tool_identity(name, args, kwargs)
            # The pipeline enters the body's scope: the call's own (``unit``) for a guarded call,
            # the step's key (``{run}/{call}``, what ``undoing().key`` gives its undo) for a step.
            return ToolCallSite(
                tool=str(tool.name), call_id=key, framework_call_id=False,
                arguments=named_arguments(named, args, kwargs), fingerprint=arguments,
                declaration=declaration, effect=name, scope_id=unit, key=key, pending=Pending.as_json,
                record=recorded_output, policy=self.policy, defaults=self._options,
            )  # fmt: skip

        @functools.wraps(run)
        def guarded_run(*args: Any, **kwargs: Any) -> Any:
            call = site(args, kwargs, signature_of)
            return run_tool_call(
                call, lambda: run(*args, **kwargs), guard=self.guard, saga=saga, on_doubt=self.on_doubt
            )

        shadow(tool, "_run", mark(guarded_run))
        # _arun only where the tool has one: BaseTool's raises NotImplementedError, which the guard
        # would take for an ambiguous failure.
        if type(tool)._arun is not BaseTool._arun:
            arun = tool._arun

            @functools.wraps(arun)
            async def guarded_arun(*args: Any, **kwargs: Any) -> Any:
                async def body() -> Any:
                    return await arun(*args, **kwargs)

                call = site(args, kwargs, arun)
                return await arun_tool_call(call, body, guard=self.guard, saga=saga, on_doubt=self.on_doubt)

            shadow(tool, "_arun", mark(guarded_arun))
        return tool

    def journal(self, llm: BaseLLM) -> BaseLLM:
        """Make ``llm.call`` / ``llm.acall`` journaled effects, in place; returns it."""
        if is_marked(llm, "call"):
            return llm
        call, acall = llm.call, llm.acall

        @functools.wraps(call)
        def journaled(messages: Any, tools: Any = None, *args: Any, **kwargs: Any) -> Any:
            unit, arguments, n = self._llm_identity(messages, tools, kwargs)
            data = journaled_call(
                self.guard, self.llm_effect, lambda: self._dump(call(messages, tools, *args, **kwargs)),
                arguments=arguments, key=self._llm_key(unit, n), result_type=dict[str, Any],
            )  # fmt: skip
            return self._answer(unit, n, data)

        @functools.wraps(acall)
        async def ajournaled(messages: Any, tools: Any = None, *args: Any, **kwargs: Any) -> Any:
            unit, arguments, n = self._llm_identity(messages, tools, kwargs)

            async def ask() -> dict[str, Any]:
                return self._dump(await acall(messages, tools, *args, **kwargs))

            data = await ajournaled_call(
                self.guard, self.llm_effect, ask, arguments=arguments, key=self._llm_key(unit, n),
                result_type=dict[str, Any],
            )  # fmt: skip
            return self._answer(unit, n, data)

        mark(journaled)
        mark(ajournaled)
        shadow(llm, "call", journaled)
        shadow(llm, "acall", ajournaled)
        return llm

    # -- identities ------------------------------------------------------------------------------

    def _tool_identity(
        self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], str, str]:
        unit = task_scope_id()
        arguments = {"args": _jsonable(list(args)), "kwargs": _jsonable(dict(kwargs))}
        digest = fingerprint(arguments)
        n = self._counts.take(unit, json.dumps([name, digest]))
        key = json.dumps([unit, name, digest, n], separators=(",", ":"))
        return arguments, key, key

    def _llm_identity(
        self, messages: Any, tools: Any, kwargs: Mapping[str, Any]
    ) -> tuple[str, dict[str, Any], int]:
        """The call's unit, fingerprinted request and ordinal; a ``response_model`` it names may be
        rebuilt from the journal."""
        self._register_declared(kwargs.get("response_model"))
        unit = task_scope_id()
        arguments = {"messages": _jsonable(messages), "tools": _tool_names(tools)}
        return unit, arguments, self._counts.peek(unit, self.llm_effect)

    def _llm_key(self, unit: str, n: int) -> str:
        return json.dumps([unit, self.llm_effect, n], separators=(",", ":"))

    def _answer(self, unit: str, n: int, data: Mapping[str, Any]) -> Any:
        # The count advances only when a call returns: a failed one is asked again under its key.
        self._counts.advance(unit, self.llm_effect, n)
        with self._models_lock:
            models = dict(self._models)
        return load_answer(data, models)

    def _dump(self, answer: Any) -> dict[str, Any]:
        """:func:`dump_answer`, registering the types of the answer the live model gave."""
        for model in answer if isinstance(answer, list) else [answer]:
            if isinstance(model, BaseModel):
                self._register_declared(type(model))
        return dump_answer(answer)


def _tool_names(tools: Any) -> list[str]:
    names: list[str] = []
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        names.append(str(function.get("name")) if isinstance(function, Mapping) else str(_jsonable(tool)))
    return sorted(names)


def is_guarded(tool: BaseTool) -> bool:
    """Whether ``tool``'s runs already go through a :class:`CrewGuard` (guarding it twice would
    make each run two effects)."""
    return is_marked(tool, "_run")


def named_arguments(
    run: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """A tool run's arguments by parameter name, defaults included (what a step's undo receives:
    the arguments the tool ran with, as LangGraph gives a tool call's ``args``); when they cannot
    be bound to the tool's signature, ``{"args": [...], **kwargs}``."""
    try:
        bound = inspect.signature(run).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {"args": list(args), **kwargs} if args else dict(kwargs)
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            named[name] = value
        elif value:
            named[name] = list(value)
    return named
