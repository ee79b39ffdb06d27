"""Definition-time checks of saga steps: signatures, compensation arity, storable result types.

Everything that can be checked when a step is declared is checked here, so a malformed saga fails
at import time, not after a charge; and the saga id every entry point takes, before anything is
stored or looked up under it.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, Union

from sagaguard.idempotency.checks import storable_text
from sagaguard.idempotency.codec import Codec
from sagaguard.idempotency.errors import CodecError
from sagaguard.saga.errors import SignatureError, UnstorableType

__all__ = ["check_callable", "check_compensation", "check_saga_id", "result_codec"]


def check_callable(step: str, role: str, fn: Callable[..., Any], arity: int) -> inspect.Signature:
    """Check that ``fn`` can be called with ``arity`` positional arguments; returns its signature."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise SignatureError(f"step {step!r}: cannot read the {role}'s signature: {exc}") from exc
    try:
        signature.bind(*range(arity))
    except TypeError as exc:
        shape = "(ctx, input)" if arity == 2 else "(ctx, input, result)"
        raise SignatureError(f"step {step!r}: the {role} must take {shape}: {exc}") from exc
    return signature


def _accepts_none(annotation: Any) -> bool:
    if annotation in (Any, object, None, type(None), inspect.Parameter.empty):
        return True
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return any(_accepts_none(arg) for arg in typing.get_args(annotation))
    return False


def check_compensation(step: str, fn: Callable[..., Any]) -> None:
    """The compensation is called as ``fn(ctx, input, result)`` with ``result`` possibly None."""
    if not callable(fn):
        raise SignatureError(f"step {step!r}: compensate= must be callable or None")
    signature = check_callable(step, "compensation", fn, 3)
    bound = signature.bind(0, 1, 2)
    names = list(bound.arguments)
    result_param = signature.parameters[names[-1]]
    if result_param.kind is inspect.Parameter.VAR_POSITIONAL:
        return
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError):
        hints = {}
    annotation = hints.get(result_param.name, result_param.annotation)
    if not _accepts_none(annotation):
        raise SignatureError(
            f"step {step!r}: the compensation's {result_param.name!r} parameter must accept None "
            f"(annotate it `{getattr(annotation, '__name__', annotation)} | None`): it is None when a "
            "crash came between the step's effect and its record"
        )


def result_codec(saga: str, step: str, fn: Callable[..., Any]) -> Codec[Any]:
    """The codec of ``fn``'s return annotation (``Any`` when it has none)."""
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError) as exc:
        raise UnstorableType(
            f"saga {saga!r} step {step!r}: cannot resolve the return annotation: {exc}"
        ) from exc
    try:
        return Codec(hints.get("return", Any))
    except CodecError as exc:
        raise UnstorableType(f"saga {saga!r} step {step!r}: {exc}") from exc


def check_saga_id(saga_id: object, label: str = "saga id") -> str:
    """A saga (or agent run) id checked the same on every journal, before anything is stored or
    looked up under it.

    Postgres text cannot hold a NUL character: ``"X\x00a"`` would be stored and found as ``"X"``,
    so another saga ``"X"`` would be answered with this one's outcome and never run.

    Raises:
        ConfigurationError: naming ``label``: empty, not a str, longer than 4096 characters, or
            holding a NUL character.
        CodecError: a lone surrogate (no UTF-8 form; a ConfigurationError too).
    """
    return storable_text(label, saga_id)
