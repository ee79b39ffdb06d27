"""From the options of :meth:`Guard.effect` to an :class:`~sagaguard.idempotency.flow.EffectSpec`, checked
once.

Everything here runs when an effect is declared (a decorator applied, an operation built), never per
call: the option checks, the codec for the result type, the argument binder and the fingerprint
selector. A bad option is therefore a :class:`~sagaguard.idempotency.errors.ConfigurationError` at definition
time, and the hot path only reads what was built here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

from sagaguard.idempotency.checks import seconds
from sagaguard.idempotency.codec import Codec
from sagaguard.idempotency.effect import Classifier, Policy, ReconcileRequest, Retry
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.flow import EffectSpec

__all__ = [
    "RUN_OPTIONS",
    "PassedOptions",
    "RunArguments",
    "RunOptions",
    "EffectOptions",
    "FingerprintSpec",
    "binder",
    "build_spec",
    "check_run_options",
    "check_sync_reconciler",
    "codec_for",
    "fingerprint_selector",
]

FingerprintSpec = bool | Sequence[str] | Callable[[Mapping[str, Any]], Mapping[str, Any]] | None
"""Which arguments enter the fingerprint: all (None/True), none (False), the named ones, or a
function of the bound arguments."""


@functools.lru_cache(maxsize=512)
def _codec(tp: Any) -> Codec[Any]:
    return Codec(tp)


def codec_for(tp: Any) -> Codec[Any]:
    """The codec for a result type, built once per type (a pydantic schema is costly to build).

    Raises:
        CodecError: the type cannot be stored as JSON.
    """
    try:
        return _codec(tp)
    except TypeError:  # unhashable annotation
        return Codec(tp)


def build_spec(
    name: str,
    result_type: Any,
    options: Mapping[str, Any],
    *,
    lease: float,
    retention: float,
    wait: float,
) -> EffectSpec[Any]:
    """Check the options of :meth:`Guard.effect` and build the effect's spec.

    Args:
        name: the effect's name.
        result_type: the type results are stored as.
        options: the options as given (absent or None: the default).
        lease, retention, wait: the guard's defaults for the options of the same names.

    Raises:
        ConfigurationError: a bad option; CodecError (one) when the result type cannot be stored.
    """
    try:
        policy = Policy(options.get("policy", Policy.AT_MOST_ONCE))
    except ValueError as exc:
        raise ConfigurationError(f"unknown policy {options.get('policy')!r}") from exc
    lease = _seconds(options, "lease", lease, zero_ok=False)
    retention = _seconds(options, "retention", retention, zero_ok=False)
    wait = _seconds(options, "wait", wait, zero_ok=True)
    window = options.get("provider_window")
    provider_window = None if window is None else _seconds(options, "provider_window", 0, zero_ok=False)
    for label in ("permanent", "retryable"):
        value = options.get(label, ())
        if not isinstance(value, tuple | list) or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in value
        ):
            raise ConfigurationError(f"{label}= takes a tuple of exception types, got {value!r}")
    for label in ("reconciler", "classify"):
        if options.get(label) is not None and not callable(options[label]):
            raise ConfigurationError(f"{label}= must be callable")
    retry = options.get("retry")
    if retry is not None and not isinstance(retry, Retry):
        raise ConfigurationError(f"retry= takes a Retry, got {retry!r}")
    return EffectSpec(
        name=name,
        codec=codec_for(result_type),
        policy=policy,
        provider_idempotent=bool(options.get("provider_idempotent", False)),
        reconciler=options.get("reconciler"),
        classifier=options.get("classify"),
        permanent=tuple(options.get("permanent", ())),
        retryable=tuple(options.get("retryable", ())),
        retry=retry or Retry(),
        lease=lease,
        retention=retention,
        wait=wait,
        provider_window=provider_window,
    )


def binder(
    signature: inspect.Signature, effect_name: str
) -> Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]:
    """``signature.bind(*args, **kwargs)`` + ``apply_defaults()``, as the arguments dict.

    A call that passes every parameter of a plain signature (no ``/``, ``*``, ``*args`` or
    ``**kwargs``), the common case, is mapped directly: the same dict, in the same parameter order,
    that ``bind`` would build, without its general-purpose walk over the parameters.
    """
    params = signature.parameters.values()
    names = (
        tuple(p.name for p in params)
        if all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
        else None
    )

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if names is not None and len(args) + len(kwargs) == len(names):
            arguments = dict(zip(names, args, strict=False))
            if not kwargs:
                return arguments
            rest = names[len(args) :]
            if kwargs.keys() == set(rest):
                for name in rest:
                    arguments[name] = kwargs[name]
                return arguments
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigurationError(f"{effect_name}: {exc}") from exc
        bound.apply_defaults()
        return bound.arguments

    return bind


def fingerprint_selector(
    spec: FingerprintSpec, signature: inspect.Signature
) -> Callable[[Mapping[str, Any]], Mapping[str, Any]]:
    """What of the bound arguments enters the fingerprint (see :data:`FingerprintSpec`).

    Raises:
        ConfigurationError: ``spec`` names parameters the signature does not have.
    """
    if spec is None or spec is True:
        return _everything
    if spec is False:
        return lambda arguments: {}
    if callable(spec):
        return spec
    names = list(spec)
    unknown = [n for n in names if n not in signature.parameters]
    if unknown:
        raise ConfigurationError(f"fingerprint= names unknown parameters: {unknown}")
    return lambda arguments: {n: arguments[n] for n in names}


def _everything(arguments: Mapping[str, Any]) -> Mapping[str, Any]:
    return arguments


class PassedOptions(TypedDict, total=False):
    """The options of :class:`RunOptions` that an agent framework adapter passes through to every
    tool call it guards (its ``**options``): all but ``policy`` (the adapter's own ``policy=``
    says it for every tool) and ``tool`` (the adapter marks its calls itself)."""

    provider_idempotent: bool
    provider_window: float | None
    reconciler: Callable[[ReconcileRequest], Any] | None
    classify: Classifier | None
    permanent: tuple[type[BaseException], ...]
    retryable: tuple[type[BaseException], ...]
    retry: Retry | None
    lease: float | None
    retention: float | None
    wait: float | None


class RunOptions(PassedOptions, total=False):
    """The per-effect options of :meth:`Guard.run` / ``arun`` (and of the adapters that build them),
    written once so that mypy checks what each caller passes. See :meth:`Guard.effect` for each."""

    policy: Policy | str
    tool: bool


class RunArguments(RunOptions, total=False):
    """Every keyword argument of :meth:`Guard.run` / ``arun``: its options and what it takes besides
    them, for code that builds them once for a sync and an async driver (mypy checks both)."""

    arguments: Mapping[str, Any] | None
    key: str | None
    result_type: Any


class EffectOptions(PassedOptions, total=False):
    """The options of :meth:`Guard.effect` that a decorator built on it passes through besides its
    own ``policy`` (``journal_model``'s ``**options``): :class:`PassedOptions`, plus which arguments
    are fingerprinted, an explicit key and the result type."""

    fingerprint: FingerprintSpec
    key: Callable[..., str] | None
    result_type: Any


RUN_OPTIONS = frozenset(RunOptions.__annotations__)
"""The options of :meth:`Guard.effect` that :meth:`Guard.run` takes (its ``arguments`` are the
fingerprint and its ``key`` the explicit key)."""


def check_run_options(options: Mapping[str, Any]) -> None:
    """Refuse options :meth:`Guard.run` does not take.

    Raises:
        ConfigurationError: an unknown option (a typo such as ``polcy=`` must not silently fall
            back to the default policy).
    """
    unknown = sorted(set(options) - RUN_OPTIONS)
    if unknown:
        raise ConfigurationError(f"unknown options {unknown}; run() takes {sorted(RUN_OPTIONS)}")


def check_sync_reconciler(name: str, options: Mapping[str, Any]) -> None:
    """Refuse an async reconciler for a sync effect.

    Raises:
        ConfigurationError: a sync call cannot await it, so the reconciler would never run and the
            effect would stay in doubt.
    """
    if inspect.iscoroutinefunction(options.get("reconciler")):
        raise ConfigurationError(f"{name}: an async reconciler needs an async effect (or arun)")


def _seconds(options: Mapping[str, Any], label: str, default: float, *, zero_ok: bool) -> float:
    """A per-effect duration, or the guard's default when it is not given (None)."""
    value = options.get(label)
    if value is None:
        return float(default)
    return seconds(label, value, zero_ok=zero_ok)
