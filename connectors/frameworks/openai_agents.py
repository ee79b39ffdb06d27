"""OpenAI Agents SDK runs whose tools happen once and whose model calls replay after a crash.

::

    run = JournaledRun(guard, "ticket-881/turn-3")        # the run key: the caller's, stable across reruns
    result = await Runner.run(run.wrap(agent), "Refund order 42")

:meth:`JournaledRun.wrap` returns a copy of the agent (and of the agents it hands off to) in which:

- every ``FunctionTool`` is a guarded effect keyed on (run key, ``tool_call_id``): a rerun returns the
  recorded output without running the tool. Tools are read-only unless declared to change the world
  (:mod:`sagaguard.connectors.declare`): a crash inside a read-only tool re-runs it, a declared one is at most
  once. Inside the tool, the call's scope is current, so ``StripeEffects``, ``EmailEffects`` and
  ``ChatJournal`` calls there need no ``key=``; ``on_doubt`` (:mod:`sagaguard.connectors.in_doubt`) says what
  the call does when it, or an effect inside it, is left in doubt;
- the model is a :class:`JournaledModel`: ``get_response`` is a journaled effect keyed on (run key,
  model-call ordinal), so a rerun gets the recorded responses, hence the same tool calls with the same
  ``tool_call_id``\\ s, and pays nothing for them.

The SDK has no run id at tool time (``ToolContext`` carries ``tool_call_id``, ``tool_name``,
``tool_arguments``), so the caller names the run. Use one run key per ``Runner.run`` of a turn: with a
session, ``f"{session_id}/turn-{n}"``. Without a session, rerun a crashed turn with the same key and the same
input; with one, go on from the session (below).

Human approval: a tool with ``needs_approval`` interrupts the run; the model calls made so far are in
the ``RunState``. Resume it, in this process or another, with :meth:`JournaledRun.resume`
(``run.resume(await RunState.from_json(run.wrap(agent), saved))``, then ``state.approve(...)``).

Sessions: the SDK saves a turn's user input to the session when the run starts and each step (a
model answer and its tool outputs) as it finishes, so a turn killed mid-run left part of itself in the
session. Rerunning it with the same input would add that input twice (and change the journaled model
calls' input: a ``KeyConflict``). :meth:`JournaledRun.resume_turn` reads the session and says how to go on::

    run = JournaledRun(guard, f"{session_id}/turn-{n}")
    go_on = await run.resume_turn(session, n, "Refund order 42")  # sets run.model_calls
    if go_on is not None:                                          # None: the turn already finished
        result = await Runner.run(run.wrap(agent), go_on, session=session)

Streaming (``Runner.run_streamed``) is not journaled (see :class:`JournaledModel`). A
``RunConfig(model=...)`` overrides the agent's model and so bypasses the journal: leave it unset.
Only ``Agent`` handoffs are followed; a ``Handoff`` object's target is not wrapped.

A :class:`JournaledRun` makes a run's calls happen once; the agent saga's run is
:class:`sagaguard.saga.agent.AgentRun` (``AgentRun`` here is the deprecated old name of
``JournaledRun``). To undo a turn's tool calls when it fails or is rejected, run it as a
:class:`sagaguard.connectors.frameworks.openai_agents_saga.SagaTurn` (a ``JournaledRun`` in saga
mode inside).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Literal, TypeVar, Unpack

from agents import Agent, FunctionTool, RunState, function_tool
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseOutputItem, TResponseStreamEvent
from agents.memory import Session
from agents.model_settings import ModelSettings
from agents.models.interface import Model, ModelProvider, ModelTracing
from agents.models.multi_provider import MultiProvider
from agents.tool import Tool
from agents.tool_context import ToolContext
from agents.usage import deserialize_usage, serialize_usage
from openai.types.responses.response_prompt_param import ResponsePromptParam
from pydantic import BaseModel, TypeAdapter

from sagaguard.connectors.declare import ToolDeclaration, declaration_of, is_step
from sagaguard.connectors.in_doubt import OnDoubt, Pending
from sagaguard.connectors.model_call import LlmUsage, ajournaled_call
from sagaguard.connectors.toolcall import STOP, SagaMode, ToolCallSite, arun_tool_call
from sagaguard.idempotency.effect import Policy
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.options import PassedOptions, RunOptions

__all__ = [
    "MODEL_EFFECT",
    "AgentRun",
    "JournaledModel",
    "JournaledRun",
    "TurnProgress",
    "dump_response",
    "load_response",
    "model_call_key",
    "parsed_arguments",
    "tool_call_key",
    "turn_progress",
]

log = logging.getLogger("sagaguard.connectors.openai_agents")

TContext = TypeVar("TContext")


MODEL_EFFECT = "agents.model"
"""The effect name of journaled model calls."""

_MODEL_ITEMS = frozenset({"function_call", "message", "reasoning"})
_OUTPUT_ITEMS: TypeAdapter[list[TResponseOutputItem]] = TypeAdapter(list[TResponseOutputItem])


def tool_call_key(run_key: str, tool_call_id: str) -> str:
    """The explicit effect key of a tool call: the run key and the model's ``tool_call_id``.

    JSON-encoded, so no run key or call id can make two pairs read the same.
    """
    return json.dumps(["agents.tool", run_key, tool_call_id])


def model_call_key(run_key: str, ordinal: int) -> str:
    """The explicit effect key of the ``ordinal``-th model call (from 0) of a run."""
    return json.dumps([MODEL_EFFECT, run_key, ordinal])


def dump_response(response: ModelResponse) -> dict[str, Any]:
    """A model response as JSON types: output items by alias with only the fields that were set.

    By alias and without unset fields, so a replayed item sent back to the model as input is the
    item the provider sent (a plain dump would add fields such as ``async_`` that it never sent).
    """
    output = [
        item.model_dump(mode="json", by_alias=True, exclude_unset=True)
        if isinstance(item, BaseModel)
        else item
        for item in response.output
    ]
    return {
        "output": output,
        "usage": serialize_usage(response.usage),
        "response_id": response.response_id,
        "request_id": response.request_id,
    }


def load_response(data: Mapping[str, Any]) -> ModelResponse:
    """The inverse of :func:`dump_response`."""
    return ModelResponse(
        output=_OUTPUT_ITEMS.validate_python(data["output"]),
        usage=deserialize_usage(data.get("usage") or {}),
        response_id=data.get("response_id"),
        request_id=data.get("request_id"),
    )


@dataclasses.dataclass(frozen=True)
class TurnProgress:
    """How far a session got with one turn (see :func:`turn_progress`)."""

    started: bool
    """The session holds the turn's user message: the SDK saved the turn's input."""
    answers: int
    """Model answers the session holds for the turn: the model-call ordinal the turn goes on from."""
    finished: bool
    """The turn's items end with the agent's final message: nothing is left to run."""


def turn_progress(items: Sequence[Any], turn: int) -> TurnProgress:
    """How far the ``turn``-th turn (from 1) got in a session's items (``await session.get_items()``).

    A turn starts at its user message (the turns are counted by user messages, so each turn's input
    must be one user message: a string, or a list holding one) and runs to the next user message.
    An answer is a run of consecutive model output items (function calls, assistant messages,
    reasoning) between the inputs and tool outputs: the SDK saves one answer with its tool outputs
    per step, so the count is the ordinal of the turn's next model call. The turn is finished when
    its last item is an assistant message (the final output: no tool call follows it); a turn that
    ends on a tool's output (``tool_use_behavior="stop_on_first_tool"``) never reads as finished.

    Raises:
        ConfigurationError: ``turn`` is below 1, or turns before it are missing from the items
            (the session cannot be the one this turn ran in).
    """
    if turn < 1:
        raise ConfigurationError(f"turns are counted from 1, not {turn}")
    starts = [i for i, item in enumerate(items) if _is_user_message(item)]
    if len(starts) < turn - 1:
        raise ConfigurationError(f"the session holds {len(starts)} turns: turn {turn} cannot run yet")
    if len(starts) < turn:
        return TurnProgress(started=False, answers=0, finished=False)
    end = starts[turn] if len(starts) > turn else len(items)
    own = [_as_dict(item) for item in items[starts[turn - 1] + 1 : end]]
    answers, inside = 0, False
    for item in own:
        produced = item.get("type") in _MODEL_ITEMS and item.get("role", "assistant") == "assistant"
        if produced and not inside:
            answers += 1
        inside = produced
    last = own[-1] if own else {}
    finished = last.get("type", "message") == "message" and last.get("role") == "assistant"
    return TurnProgress(started=True, answers=answers, finished=finished)


def _as_dict(item: Any) -> Mapping[str, Any]:
    return item if isinstance(item, Mapping) else {}


def _is_user_message(item: Any) -> bool:
    data = _as_dict(item)
    return data.get("role") == "user" and data.get("type", "message") == "message"


class JournaledModel(Model):
    """A ``Model`` whose ``get_response`` is a journaled effect of a :class:`JournaledRun`.

    The n-th call of the run (counted across every agent of the run, whose model calls are
    sequential) has the key :func:`model_call_key` ``(run_key, n)``. The counter advances only when
    a call returns. A model call changes nothing in the world (the tools it picks are effects of
    their own), so a call that raised leaves no record (the SDK's retries, configured in its
    ``ModelSettings``, and a rerun ask again under the same key), and a call left in doubt by a
    crash between the answer and its record is asked again (``at_least_once``).

    Args:
        inner: the model that answers.
        run: the run this model belongs to.
        stream: ``"error"`` (default): ``stream_response`` raises; ``"passthrough"``: it streams
            from ``inner`` without a record.
    """

    def __init__(
        self, inner: Model, run: JournaledRun, *, stream: Literal["error", "passthrough"] = "error"
    ) -> None:
        self.inner = inner
        self.run = run
        self.stream = stream

    async def get_response(  # noqa: PLR0917 - the SDK's Model signature
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        """The inner model's response, or the one recorded for this call of the run."""
        run = self.run
        ordinal = run.model_calls

        async def call() -> dict[str, Any]:
            response = await self.inner.get_response(
                system_instructions=system_instructions, input=input, model_settings=model_settings,
                tools=tools, output_schema=output_schema, handoffs=handoffs, tracing=tracing,
                previous_response_id=previous_response_id, conversation_id=conversation_id, prompt=prompt,
            )  # fmt: skip
            return dump_response(response)

        arguments: dict[str, Any] = {}
        if run.fingerprint_model:
            arguments = {
                "instructions": system_instructions,
                "input": input,
                "tools": sorted(tool.name for tool in tools),
                "handoffs": sorted(h.tool_name for h in handoffs),
                "previous_response_id": previous_response_id,
                "conversation_id": conversation_id,
            }
        data = await ajournaled_call(
            run.guard, MODEL_EFFECT, call, result_type=dict[str, Any], arguments=arguments,
            key=model_call_key(run.run_key, ordinal), tokens=_response_tokens, usage=run.usage,
        )  # fmt: skip
        run.model_calls = ordinal + 1
        return load_response(data)

    async def stream_response(  # noqa: PLR0917 - the SDK's Model signature
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        """Streams from the inner model unrecorded when ``stream="passthrough"``.

        Raises:
            ConfigurationError: ``stream="error"`` (the default): a stream is not journaled.
        """
        if self.stream != "passthrough":
            raise ConfigurationError(
                "streamed model calls are not journaled: use Runner.run, "
                "or JournaledRun(..., stream='passthrough')"
            )
        async for event in self.inner.stream_response(
            system_instructions=system_instructions, input=input, model_settings=model_settings,
            tools=tools, output_schema=output_schema, handoffs=handoffs, tracing=tracing,
            previous_response_id=previous_response_id, conversation_id=conversation_id, prompt=prompt,
        ):  # fmt: skip
            yield event

    async def close(self) -> None:
        """Close the inner model."""
        await self.inner.close()


class JournaledRun:
    """One run of an agent (one ``Runner.run`` of a turn), named by the caller's run key.

    Each tool call goes through the one pipeline (:mod:`sagaguard.connectors.toolcall`): a guarded
    effect keyed on :func:`tool_call_key` or, in saga mode, a step of the open agent run.

    Args:
        guard: the guard tool calls and model calls run under.
        run_key: the run's durable name; a rerun after a crash passes the same one.
        model_calls: model calls already made in this run (see :meth:`resume` and :meth:`resume_turn`).
        tools: names of the function tools to guard (default: all of them).
        declare: tool name to :class:`~sagaguard.connectors.declare.ToolDeclaration`. Tools are read-only
            unless declared (here or with ``@changes_world`` on the function or the tool): a crash
            inside a read-only tool re-runs it; only a tool that changes the world is at most once.
        on_doubt: what a tool call does when it, or a guarded effect inside it, is in doubt
            (:mod:`sagaguard.connectors.in_doubt`: ``Stop()``, the default, ``ReturnPending()`` or
            ``WaitForOperator(...)``).
        policy: one policy for every tool instead of the declarations (``"at_most_once"`` gives
            the behaviour before declarations existed).
        tool_options: per tool name, :meth:`Guard.effect` options (``policy``, ``reconciler``,
            ``provider_idempotent``, ``permanent``, ...) for its effect, over its declaration's.
        provider: resolves an agent's model given by name or left unset (default ``MultiProvider``).
        fingerprint_model: whether a model call's instructions and input must match on replay
            (default True: a changed prompt is a ``KeyConflict``, never a silent replay). Turn off
            for instructions that change on every run (a timestamp).
        stream: see :class:`JournaledModel`.
        usage: where to total model usage, paid and saved (default: a new one, as ``self.usage``).
        saga: saga mode (:data:`sagaguard.connectors.toolcall.SagaMode`): the calls of tools declared
            with an undo or as the pivot are steps of the open agent run (``True``: the one open in
            this context; :class:`~sagaguard.connectors.frameworks.openai_agents_saga.SagaTurn` passes
            its own). Default False: every call is a guarded effect.
        options: any other :meth:`Guard.run` option for every tool (``reconciler=``, ``lease=``,
            ...), under a declaration's own options and ``tool_options`` (the one precedence rule:
            :func:`sagaguard.connectors.toolcall.call_options`).

    Raises:
        ConfigurationError: the run key is empty.
    """

    def __init__(
        self,
        guard: Guard,
        run_key: str,
        *,
        model_calls: int = 0,
        tools: Collection[str] | None = None,
        declare: Mapping[str, ToolDeclaration] | None = None,
        on_doubt: OnDoubt = STOP,
        policy: Policy | str | None = None,
        tool_options: Mapping[str, RunOptions] | None = None,
        provider: ModelProvider | None = None,
        fingerprint_model: bool = True,
        stream: Literal["error", "passthrough"] = "error",
        usage: LlmUsage | None = None,
        saga: SagaMode = False,
        **options: Unpack[PassedOptions],
    ) -> None:
        if not run_key:
            raise ConfigurationError("an agent run needs a non-empty run key")
        self.guard = guard
        self.run_key = run_key
        self.model_calls = model_calls
        self.tools = None if tools is None else frozenset(tools)
        self.declare = dict(declare or {})
        self.on_doubt = on_doubt
        self.policy = policy
        self.tool_options: dict[str, RunOptions] = {
            name: {**options} for name, options in (tool_options or {}).items()
        }
        self.provider = provider if provider is not None else MultiProvider()
        self.fingerprint_model = fingerprint_model
        self.stream: Literal["error", "passthrough"] = stream
        self.usage = usage if usage is not None else LlmUsage()
        self.saga = saga
        self._options: PassedOptions = {**options}

    def resume(self, state: RunState[Any, Any]) -> RunState[Any, Any]:
        """Continue this run's model-call ordinals after the model responses ``state`` holds.

        Call it before ``Runner.run(agent, state)`` resumes a run interrupted for approval, with
        ``state`` loaded against this run's wrapped agent (``RunState.from_json(run.wrap(agent),
        ...)``: the SDK resumes with the state's current agent, so its model must be this run's).
        The resumed run's next model call then gets a new key, and a rerun of the resume from the
        same saved state replays it.

        Returns:
            ``state``, for chaining.

        Raises:
            ConfigurationError: the state's serialization lists no model responses.
            agents.exceptions.UserError: the state cannot be serialized (``RunState.to_json``).
        """
        # The SDK's public serialization lists the state's model responses (schema 1.x).
        responses = state.to_json().get("model_responses")
        if not isinstance(responses, list):  # pragma: no cover - a schema without them
            raise ConfigurationError("this RunState does not list its model responses; set model_calls")
        self.model_calls = len(responses)
        return state

    async def resume_turn(
        self, session: Session, turn: int, input: str | list[TResponseInputItem]
    ) -> str | list[TResponseInputItem] | None:
        """What to pass ``Runner.run(..., session=session)`` to run or go on with a session's turn.

        The SDK saves the turn's input when the run starts and each step as it finishes, so a turn
        killed mid-run left part of itself in ``session``. Call this before running the turn, first
        time or rerun alike, with this run's key for the turn (``f"{session_id}/turn-{turn}"``).

        Args:
            session: the turn's session (any agents ``Session``).
            turn: the turn's position in the session, from 1 (see :func:`turn_progress`).
            input: the turn's user input (one user message).

        Returns:
            ``input`` when the session does not hold the turn yet (a first run, or a crash before the
            SDK saved the input); ``[]`` when it holds part of it, with :attr:`model_calls` set to
            the answers saved, so the next model call is the one the killed run was making (replayed
            when it was recorded, asked again when it was in flight) and the tools it asks for find
            their records; ``None`` when the session holds the turn's final answer (do not run it).

        Raises:
            ConfigurationError: the session holds fewer than ``turn - 1`` turns.
        """
        progress = turn_progress(await session.get_items(), turn)
        if not progress.started:
            self.model_calls = 0
            return input
        self.model_calls = progress.answers
        return None if progress.finished else []

    def wrap(self, agent: Agent[TContext]) -> Agent[TContext]:
        """A copy of ``agent`` and of the agents it hands off to, guarded and journaled.

        The original agents are not changed. Agents reached through several handoffs (cycles
        included) are copied once.
        """
        return self._wrap(agent, {})

    def _wrap(self, agent: Agent[Any], done: dict[int, Agent[Any]]) -> Agent[Any]:
        if id(agent) in done:
            return done[id(agent)]
        copy = agent.clone(model=self._model(agent), tools=[self._tool(tool) for tool in agent.tools])
        done[id(agent)] = copy
        copy.handoffs = [self._wrap(h, done) if isinstance(h, Agent) else h for h in agent.handoffs]
        return copy

    def _model(self, agent: Agent[Any]) -> JournaledModel:
        model = agent.model
        if isinstance(model, JournaledModel):
            model = model.inner
        inner = model if isinstance(model, Model) else self.provider.get_model(model)
        return JournaledModel(inner, self, stream=self.stream)

    def _tool(self, tool: Tool) -> Tool:
        if not isinstance(tool, FunctionTool) or (self.tools is not None and tool.name not in self.tools):
            return tool
        declaration = declaration_of(tool, tool.name, self.declare)
        options: RunOptions = self.tool_options.get(tool.name, {})
        inner = _raising(tool) if self.saga is not False and is_step(declaration) else tool.on_invoke_tool

        async def invoke(ctx: ToolContext[Any], arguments: str) -> Any:
            key = tool_call_key(self.run_key, ctx.tool_call_id)
            parsed = parsed_arguments(arguments)
            site: ToolCallSite[Any] = ToolCallSite(
                tool=tool.name, call_id=ctx.tool_call_id,
                arguments=parsed if isinstance(parsed, dict) else {"arguments": parsed},
                fingerprint={"arguments": parsed}, declaration=declaration, effect=tool.name,
                scope_id=key, key=key, pending=Pending.as_json, policy=self.policy, defaults=self._options,
                options=options,
            )  # fmt: skip
            body = functools.partial(inner, ctx, arguments)
            return await arun_tool_call(site, body, guard=self.guard, saga=self.saga, on_doubt=self.on_doubt)

        return dataclasses.replace(tool, on_invoke_tool=invoke)


def _raising(tool: FunctionTool) -> Callable[[ToolContext[Any], str], Awaitable[Any]]:
    """How a step runs ``tool``: its exception raised, never turned into text for the model.

    A ``function_tool`` catches the function's exception and returns its
    ``failure_error_function``'s text (the SDK's default does), which a step would record as the
    tool's output: a failure kept as a success. So a step's body is the same function made a tool
    again with ``failure_error_function=None`` (the SDK's public ``__wrapped__`` is the function
    ``function_tool`` was given); only its invoker is used, every other setting stays the tool's.
    A hand-made ``FunctionTool`` (no ``__wrapped__``) runs as it is: its ``on_invoke_tool`` must
    raise on failure.
    """
    try:
        fn = tool.__wrapped__
    except AttributeError:
        return tool.on_invoke_tool
    strict = function_tool(
        fn, name_override=tool.name, description_override=tool.description,
        failure_error_function=None, strict_mode=tool.strict_json_schema,
    )  # fmt: skip
    return strict.on_invoke_tool


class AgentRun(JournaledRun):
    """Deprecated name of :class:`JournaledRun` (it was named like :class:`sagaguard.saga.agent.AgentRun`,
    the agent saga's run). Takes the same arguments; warns (``DeprecationWarning``)."""

    def __init__(self, guard: Guard, run_key: str, **options: Any) -> None:
        warnings.warn(
            "sagaguard.connectors.frameworks.openai_agents.AgentRun is deprecated: use JournaledRun",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(guard, run_key, **options)


def _response_tokens(data: Mapping[str, Any]) -> tuple[int, int]:
    usage = deserialize_usage(data.get("usage") or {})
    return usage.input_tokens, usage.output_tokens


def parsed_arguments(arguments: str) -> Any:
    """A tool call's arguments as the model sent them (JSON text), read as JSON (as they are when
    they are not JSON): fingerprinted by their meaning, not their spelling (white space, key order)."""
    try:
        return json.loads(arguments) if arguments else None
    except ValueError:
        return arguments
