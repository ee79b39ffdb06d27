"""Which tools change the world: one declaration, read by every framework adapter.

A tool is **read-only** unless declared otherwise. A read-only tool (a search, a read, a model call
made from a tool) never parks a run: a crash inside it, or an error it raises, leaves no record that
stops a re-run (it is journaled ``at_least_once``, so a finished call replays its recorded result).
A tool that changes the world is declared so, next to the tool or in a mapping given to the
adapter; only those can be left in doubt::

    @tool                          # LangGraph / LangChain (or @function_tool, or a CrewAI tool)
    @changes_world
    def send_invoice(order: str) -> str: ...

    @changes_world(reconciler=find_invoice)     # any Guard.run option for its effect
    def charge(order: str) -> str: ...

    ToolGuard(guard, declare={"book_flight": changes_world()})   # or by name, at the adapter

A tool whose world-changing calls are guarded effects of their own (``StripeEffects``,
``EmailEffects``, ``guard.effect``) may stay read-only: those calls replay or are reconciled as
effects do, and one left in doubt is resolved on its own record.

A tool that changes the world can also say how an agent saga undoes it (:mod:`sagaguard.saga.agent`): the
name of its undo in the agent saga's ``UndoRegistry`` (``@changes_world(undo="cancel_booking")``,
a compensatable step), or that it is the run's pivot (``@changes_world(pivot=True)``: after it the
run only goes forward). The same declaration serves every framework; the adapters that run agent
sagas (:class:`sagaguard.connectors.frameworks.langgraph_saga.SagaTools`,
:class:`sagaguard.connectors.frameworks.langchain_saga.SagaMiddleware`,
:class:`sagaguard.connectors.frameworks.openai_agents_saga.SagaTurn`) read it, the others ignore it. Each
gives the undo the call's arguments and the tool's output as :func:`recorded_output` reads it, so the same
undo serves every framework.

A compensatable step is **at least once**: a crash inside it and the resumed run runs its body
again, in the same scope, so the guarded effects inside it (a connector's call, ``guard.run``)
replay or are reconciled and the run goes on with no operator. A tool whose body changes the world
outside a guarded effect is at most once only when it says so
(``changes_world(undo="name", policy="at_most_once")``); a pivot and a tool without an undo are
at most once already.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar, overload

from sagaguard.idempotency.effect import NO_RETRY, Policy
from sagaguard.idempotency.errors import ConfigurationError, OutcomeUnknown
from sagaguard.idempotency.records import Disposition

__all__ = [
    "ToolDeclaration",
    "changes_world",
    "declaration_of",
    "is_step",
    "kind_options",
    "read_only",
    "recorded_output",
    "tool_options",
]

T = TypeVar("T")

_ATTRIBUTE = "__sagaguard_tool__"
"""Where a declaration is kept on the function (or tool object) it was applied to."""
_INNER = ("func", "coroutine", "__wrapped__")
"""Attributes under which frameworks keep the function a tool object was built from."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,99}")


@dataclass(frozen=True)
class ToolDeclaration:
    """What a tool does to the world. Build it with :func:`changes_world` or use :data:`read_only`.

    Applied to a function or tool object (``declaration(fn)``), it is kept on it and returned by
    :func:`declaration_of`; it returns what it was given, so it works as a decorator.
    """

    changes_world: bool = False
    """The tool changes the world: at most once (a crash inside it leaves it in doubt), unless it
    has an undo (a compensatable step runs again after a crash, see :func:`tool_options`)."""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """:meth:`Guard.run` options for the tool's effect (``reconciler=``, ``policy=``, ...)."""
    undo: str | None = None
    """In an agent saga: the name of the tool's undo (its calls are compensatable steps)."""
    pivot: bool = False
    """In an agent saga: the tool is the run's pivot (a step with nothing to undo, after which the
    run only goes forward)."""

    @property
    def kind(self) -> str:
        """The tool call's kind in an agent saga: ``"compensatable"`` (it has an undo), ``"pivot"``
        or ``"nothing_to_undo"`` (not a step)."""
        if self.undo is not None:
            return "compensatable"
        return "pivot" if self.pivot else "nothing_to_undo"

    def __call__(self, tool: T) -> T:
        """Keep this declaration on ``tool`` (a function, a coroutine function or a tool object)."""
        try:
            setattr(tool, _ATTRIBUTE, self)
        except (AttributeError, TypeError, ValueError):
            # Pydantic tool objects (LangChain, CrewAI) refuse unknown attributes through
            # __setattr__; an instance attribute stays out of their dumps.
            object.__setattr__(tool, _ATTRIBUTE, self)
        return tool


read_only = ToolDeclaration()
"""The default, said explicitly: ``@read_only`` or ``declare={"search": read_only}``."""


@overload
def changes_world(tool: T, /) -> T: ...


@overload
def changes_world(
    tool: None = None, /, *, undo: str | None = None, pivot: bool = False, **options: Any
) -> ToolDeclaration: ...


def changes_world(
    tool: Any = None, /, *, undo: str | None = None, pivot: bool = False, **options: Any
) -> Any:
    """Declare a tool that changes the world: its calls are at most once, except a compensatable
    step's (``undo=``), which runs again after a crash (see :func:`tool_options`).

    Use it bare (``@changes_world``), with :meth:`Guard.run` options for the tool's effect
    (``@changes_world(reconciler=...)``), or as a value (``declare={"pay": changes_world()}``).

    Args:
        undo: in an agent saga, the name of the tool's undo in the agent saga's ``UndoRegistry``.
        pivot: in an agent saga, the tool is the run's pivot (nothing to undo; forward only after).
        options: :meth:`Guard.run` options for the tool's effect.

    Raises:
        ConfigurationError: an option names something the adapter sets itself (``key``,
            ``arguments``, ``result_type``), ``kind=`` (say ``undo=`` or ``pivot=``), a malformed
            undo name, or both ``undo=`` and ``pivot=``.
    """
    for fixed in ("key", "arguments", "result_type"):
        if fixed in options:
            raise ConfigurationError(f"changes_world({fixed}=...): the adapter sets a tool's {fixed}")
    if "kind" in options:
        raise ConfigurationError("changes_world(kind=...): say undo=NAME (compensatable) or pivot=True")
    if undo is not None and (not isinstance(undo, str) or not _NAME.fullmatch(undo)):
        raise ConfigurationError(f"changes_world(undo={undo!r}): an undo's registered name")
    if undo is not None and pivot:
        raise ConfigurationError("changes_world(undo=..., pivot=True): a pivot has nothing to undo")
    declaration = ToolDeclaration(
        changes_world=True, options=MappingProxyType(dict(options)), undo=undo, pivot=bool(pivot)
    )
    return declaration if tool is None else declaration(tool)


def declaration_of(
    tool: Any, name: str, declared: Mapping[str, ToolDeclaration] | None = None
) -> ToolDeclaration:
    """The declaration of ``tool``: by ``name`` in ``declared``, else kept on the tool (or on the
    function it was built from), else :data:`read_only`."""
    if declared and name in declared:
        return declared[name]
    for holder in (tool, *(getattr(tool, inner, None) for inner in _INNER)):
        found = getattr(holder, _ATTRIBUTE, None) if holder is not None else None
        if isinstance(found, ToolDeclaration):
            return found
    return read_only


def is_step(declaration: ToolDeclaration) -> bool:
    """Whether calls of a tool with this declaration are steps of an agent saga's run (it has an
    undo, or it is the pivot)."""
    return declaration.undo is not None or declaration.pivot


def recorded_output(output: Any) -> Any:
    """What an agent saga records of a tool's output for its undo: text that is JSON read back as
    JSON (a framework hands the model a tool's dict as JSON text), anything else as it is."""
    if isinstance(output, str):
        try:
            return json.loads(output)
        except ValueError:
            return output
    return output


def _not_applied(exc: BaseException) -> Disposition | None:
    # A read-only tool changed nothing: whatever it raised, the next run asks again. Interrupts
    # and cancellation fall through (they are not Exceptions).
    return Disposition.RETRYABLE if isinstance(exc, Exception) else None


def _doubt_elsewhere(exc: BaseException) -> Disposition | None:
    # An effect inside the tool is in doubt and holds that doubt in its own record: the tool's
    # claim is released so that resolving that one record settles the tool's next run too.
    return Disposition.RETRYABLE if isinstance(exc, OutcomeUnknown) else None


def tool_options(declaration: ToolDeclaration, policy: Policy | str | None = None) -> dict[str, Any]:
    """The :meth:`Guard.run` options of a tool call with this declaration: the defaults of its kind
    (:func:`kind_options`) under the declaration's own options.
    """
    return {**kind_options(declaration, policy), **declaration.options}


def kind_options(declaration: ToolDeclaration, policy: Policy | str | None = None) -> dict[str, Any]:
    """The defaults of a tool call of this declaration's kind (its own options not included).

    - :data:`read_only` (the default): ``at_least_once``; a call a crash interrupted is asked again.
    - ``changes_world(undo="name")``, a compensatable step: ``at_least_once``; its body runs again
      in the same scope, so the guarded effects inside it replay or are reconciled and the run
      goes on, with no operator.
    - ``changes_world(pivot=True)`` and ``changes_world()``: ``at_most_once``; a call a crash
      interrupted is in doubt until it is reconciled or an operator settles it.

    No call is retried inside its claim: the framework (or the model) decides about a failed tool.
    A compensatable tool whose body changes the world *outside* a guarded effect (a plain HTTP
    call with no idempotency key, an SDK call of its own) must say
    ``changes_world(undo="name", policy="at_most_once")``, or guard that call: run again, it would
    happen twice. The declaration's own options, and the adapter's, win over these defaults
    (:func:`sagaguard.connectors.toolcall.call_options`).

    Args:
        declaration: the tool's declaration.
        policy: the adapter's ``policy=``, which when given applies to every tool (the behaviour
            before declarations: ``policy="at_most_once"`` makes every tool at most once).
    """
    options: dict[str, Any]
    if declaration.undo is not None:
        # A compensatable step: its body re-runs after a crash, in the same scope, so the guarded
        # effects inside it replay or are reconciled instead of running again, and the run goes on.
        # No retries inside the claim: the framework (or the model) decides about a failed tool.
        options = {"policy": Policy.AT_LEAST_ONCE, "classify": _doubt_elsewhere, "retry": NO_RETRY}
    elif declaration.changes_world:
        options = {"policy": Policy.AT_MOST_ONCE, "classify": _doubt_elsewhere}
    else:
        # No retries inside the claim: the framework (or the model) decides about a failed tool.
        options = {"policy": Policy.AT_LEAST_ONCE, "classify": _not_applied, "retry": NO_RETRY}
    if policy is not None:
        options = {"policy": Policy(policy), "classify": _doubt_elsewhere}
    return options
