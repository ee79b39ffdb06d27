"""Enumerating a saga's kill points: run a shadow of it in memory and turn the journal and store
calls it made into points (:func:`kill_points`, :func:`points_of`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sagaguard.idempotency.errors import NotApplied
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.stores.memory import MemoryStore
from sagaguard.saga.definition import Saga, StepContext
from sagaguard.saga.journals.memory import MemoryJournal
from sagaguard.saga.records import (
    StepKind,
)
from sagaguard.saga.runner import SagaRunner
from sagaguard.saga.testing.points import Boundary, KillPoint, Tripwire
from sagaguard.saga.testing.wrappers import CrashingJournal, CrashingSagaStore


class _ShadowFailure(RuntimeError):
    """Raised by the shadow of the ``fail_at`` step (ambiguous: it may have applied)."""


def _nothing() -> None:
    return None


def _no_sleep(_seconds: float) -> None:
    return None


def _count(spec: int | Mapping[str, int], step: str) -> int:
    return spec if isinstance(spec, int) else int(spec.get(step, 1))


def kill_points(
    saga: Saga[Any],
    *,
    fail_at: str | None = None,
    failure_applied: bool = True,
    effects: int | Mapping[str, int] = 1,
    compensation_effects: int | Mapping[str, int] = 1,
) -> list[KillPoint]:
    """Every distinct crash boundary of one run of ``saga``, in the order the run meets them.

    Runs a shadow of the saga in memory (nothing of the saga's own code runs) and turns its journal
    and store calls into points (:func:`points_of`): before each write or winning claim, after each
    store claim that lets an effect run, and after the last write. Two boundaries with nothing
    durable between them are one point.

    Args:
        saga: the definition; only its shape is used (step names, kinds, retries, compensations).
        fail_at: the step that fails after its effects, making this a compensation run; None for a
            run where every step succeeds.
        failure_applied: the failure may have applied the step (so its own compensation runs);
            False for a failure classified *not applied*.
        effects: guarded calls each action makes (per step name, default 1).
        compensation_effects: guarded calls each compensation makes (per step name, default 1).

    Raises:
        ValueError: ``fail_at`` names no step of ``saga``, or the saga has a wait step (its run
            parks until a signal comes; name its points by hand).
    """
    names = [step.name for step in saga.steps]
    if fail_at is not None and fail_at not in names:
        raise ValueError(f"fail_at={fail_at!r} is not a step of {saga.name!r}: {names}")
    waits = [step.name for step in saga.steps if step.signal is not None]
    if waits:
        # A wait parks the saga until another process signals it: one run has no single sequence.
        raise ValueError(f"saga {saga.name!r} waits for signals ({waits}): enumerate its points by hand")
    tripwire = Tripwire()
    guard = Guard(CrashingSagaStore(MemoryStore(), tripwire), namespace="kill-points", sleep=_no_sleep)
    shadow: Saga[None] = Saga(saga.name, version=saga.version, input=type(None))

    def action(name: str) -> Callable[[StepContext, None], None]:
        def shadow_action(ctx: StepContext, _input: None) -> None:
            for _ in range(_count(effects, name)):
                guard.run("shadow.effect", _nothing, result_type=type(None))
            if name == fail_at:
                raise _ShadowFailure(name) if failure_applied else NotApplied(name)

        return shadow_action

    def compensation(name: str) -> Callable[[StepContext, None, object], None]:
        def shadow_compensation(ctx: StepContext, _input: None, _result: object) -> None:
            for _ in range(_count(compensation_effects, name)):
                guard.run("shadow.undo", _nothing, result_type=type(None))

        return shadow_compensation

    for step in saga.steps:
        if step.kind is StepKind.COMPENSATABLE:
            undo = None if step.compensation_fn is None else compensation(step.name)
            shadow.step(
                name=step.name,
                compensate=undo,
                retry=step.retry,
                compensation_retry=step.compensation_retry,
                not_applied=step.not_applied,
                classify=step.classifier,
            )(action(step.name))
        elif step.kind is StepKind.PIVOT:
            shadow.pivot(
                name=step.name, retry=step.retry, not_applied=step.not_applied, classify=step.classifier
            )(action(step.name))
        else:
            shadow.retriable(name=step.name, retry=step.retry, classify=step.classifier)(action(step.name))
    runner = SagaRunner(CrashingJournal(MemoryJournal(), tripwire), guard, sleep=_no_sleep)
    try:
        runner.run(shadow, "kill-points", None)
    finally:
        runner.close()
        guard.close()
    return points_of(tripwire.events)


def points_of(events: Sequence[Boundary]) -> list[KillPoint]:
    """The distinct kill points of a recorded run (see :func:`kill_points`).

    Before each write and each claim that wins its record; after each store claim that wins (the
    effect is not sent yet); after the last call. A claim that wins nothing (a replay, a poll of a
    live claim) writes nothing: dying before it is dying before the next call.
    """
    points: list[KillPoint] = []
    seen: set[tuple[str, str, int, str]] = set()

    def add(event: Boundary, when: str) -> None:
        ident = (event.target, event.method, event.nth, when)
        if ident not in seen:
            seen.add(ident)
            step, compensating = _where(event)
            points.append(
                KillPoint(
                    event.target, event.method, event.nth, when, _label(event, when), step, compensating
                )
            )

    claims = {("journal", "start"), ("journal", "claim"), ("store", "claim")}
    for event in events:
        if (event.target, event.method) not in claims:
            add(event, "before")
        elif event.won:
            add(event, "before")
            if event.target == "store":
                add(event, "after")
    written = [e for e in events if (e.target, e.method) not in claims or e.won]
    if written:  # after the last call that wrote anything: the run is over
        add(written[-1], "after")
    return points


def _where(event: Boundary) -> tuple[str | None, bool]:
    if event.target != "store":
        return None, False
    scope = event.detail.split("|", 1)[0]
    parts = scope.split("/")
    compensating = parts[-1] == "~compensate"
    step = parts[-2] if compensating and len(parts) >= 2 else parts[-1]
    return step, compensating


def _label(event: Boundary, when: str) -> str:
    if event.target == "journal":
        if event.method == "start":
            return "nothing written yet" if when == "before" else "saga started, its first step registered"
        if event.method == "claim":
            return f"{when} take-over {event.nth} ({event.detail})"
        return f"{when} commit {event.nth}: {event.detail}"
    step, compensating = _where(event)
    name = event.detail.split("|", 1)[-1]
    where = f"compensation of {step}" if compensating else f"step {step}"
    what, run = f"effect {name}", "sent"
    if name.startswith("sagaguard.compensate."):
        what, run = "the compensation's record", "run"
    if event.method == "claim":
        return (
            f"{where}: before claiming {what}" if when == "before" else f"{where}: {what} claimed, not {run}"
        )
    if event.method == "complete":
        return f"{where}: {what} {run}, not recorded" if when == "before" else f"{where}: {what} recorded"
    return f"{where}: {what} failed, the failure not recorded"
