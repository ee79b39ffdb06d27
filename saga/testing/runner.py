"""The parent side: start the children, kill one at a point, recover in a fresh one, and report
(:func:`run_kill_point`, :func:`run_kill_point_sweep`, :func:`trace_run`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sagaguard.idempotency.records import Record, State
from sagaguard.idempotency.testing.children import child_environment
from sagaguard.saga.records import (
    LIVE_STATES,
    SagaSnapshot,
    SagaState,
)
from sagaguard.saga.testing.points import Boundary, KillPoint
from sagaguard.saga.testing.scenario import Storage

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PointResult(Generic[T]):
    """What one kill point did.

    Attributes:
        point: the point.
        saga_id: the saga instance it ran.
        killed: the first child died at the point, and each recovering child at its point in
            ``then`` (False: one never reached its point).
        crashed_state: the saga's state in the journal right after the first kill (None: not
            started).
        state: the saga's state after the recovery (None: still not in the journal).
        snapshot: the journal's saga and step rows after the recovery.
        unsettled: guard records of the run left IN_PROGRESS or IN_DOUBT after the recovery.
        recovered: the recovery child's JSON line (``state``, ``replayed``, ``swept``, ``error``)
            or ``exception`` and ``message``.
        seen: what ``observe`` returned after the recovery: what the world saw.
        seconds: wall time of the point, every child included.
        then: the points the recovering children were killed at.
        crash_log, recovery_log: each child's exit status, stdout and stderr, for failure messages.
    """

    point: KillPoint
    saga_id: str
    killed: bool
    crashed_state: SagaState | None
    state: SagaState | None
    snapshot: SagaSnapshot | None
    unsettled: tuple[Record, ...]
    recovered: Mapping[str, Any]
    seen: T
    seconds: float
    then: tuple[KillPoint, ...] = ()
    crash_log: str = field(default="", repr=False)
    recovery_log: str = field(default="", repr=False)

    def problems(self) -> list[str]:
        """The generic violations: not killed at the point, recovery failed, saga still live,
        guard records left unsettled. Empty when the point passed."""
        found: list[str] = []
        if not self.killed:
            where = ", then ".join(p.spec for p in (self.point, *self.then))
            found.append(f"a child was not killed where it should be ({where}):\n{self.crash_log}")
        if "exception" in self.recovered:
            found.append(f"recovery raised {self.recovered['exception']}: {self.recovered.get('message')}")
        if self.state is None or self.state in LIVE_STATES:
            found.append(f"the saga ended {self.state} after recovery:\n{self.recovery_log}")
        for record in self.unsettled:
            found.append(f"guard record {record.scope}|{record.name} left {record.state.value}")
        return found


def _child_env() -> dict[str, str]:
    return child_environment()


def _spawn(arguments: Sequence[str], *, gate: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sagaguard.saga.testing", "child", *arguments, *(["--gate"] if gate else [])],
        stdin=subprocess.PIPE if gate else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )


def _finish(proc: subprocess.Popen[str], timeout: float, stdin: str | None = None) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(stdin, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s: the child hung)"
    return proc.returncode, out, err


def _last_json(out: str) -> dict[str, Any]:
    for line in reversed(out.strip().splitlines()):
        with contextlib.suppress(ValueError):
            found = json.loads(line)
            if isinstance(found, dict):
                return found
    return {"exception": "NoOutput", "message": "the child printed no result"}


def run_kill_point(
    point: KillPoint,
    *,
    scenario: str,
    storage: Storage,
    observe: Callable[[str], T],
    then: Sequence[KillPoint] = (),
    saga_id: str | None = None,
    params: Mapping[str, str] | None = None,
    lease: float = 0.5,
    recovery: str = "rerun",
    driver: str = "sync",
    timeout: float = 120.0,
) -> PointResult[T]:
    """Kill a child at ``point``, recover the saga in a fresh child, and report.

    Args:
        point: where the first child dies.
        scenario: ``module:attr`` of the scenario factory every child builds the saga with.
        storage: journal and store, shared by the children (use a fresh one, or at least a fresh
            ``saga_id``, per point).
        observe: called with the saga id after the recovery; its value is :attr:`PointResult.seen`
            (e.g. the effects the outside service counted for that saga).
        then: kill the recovering children too, one after the other, at these points (counted
            from each child's own start): crashes during recovery. The last child is left alone.
        saga_id: the instance to run; a fresh one by default. It is also the guard's namespace.
        params: handed to the factory (plus ``saga_id``).
        lease: the children's runner and guard lease: how long a recovery waits for the dead
            child's claims to run out (unless the recovery runs on the dead child's host, where
            they are taken over at once); 0 for the defaults a user gets (the runner's 60 s lease
            and 10 s wait, the guard's 5 s lease and 10 s wait).
        recovery: ``rerun`` (run the same saga id again) or ``sweep``
            (:func:`sagaguard.saga.recovery.recover` first, then the rerun, which replays what it recorded).
        driver: ``sync`` (:meth:`SagaRunner.run`, :func:`~sagaguard.saga.recovery.recover`) or ``async``
            (:meth:`SagaRunner.arun`, :func:`~sagaguard.saga.recovery.arecover`), in every child.
        timeout: seconds each child may take.
    """
    saga_id = saga_id or f"kp-{uuid.uuid4().hex[:12]}"
    journal, store = storage.journal(), storage.store()  # creates the tables before the children
    arguments = [
        "--scenario", scenario, "--saga-id", saga_id, "--namespace", saga_id, "--lease", str(lease),
        "--recovery", recovery, "--driver", driver, *storage.args(),
    ]  # fmt: skip
    for key, value in (params or {}).items():
        arguments += ["--param", f"{key}={value}"]
    started = time.monotonic()
    # Every recovering child imports and connects while the first one runs, then waits at its gate.
    waiting = [_spawn([*arguments, "--kill", p.spec], gate=True) for p in then]
    waiting.append(_spawn(arguments, gate=True))
    try:
        first = _spawn([*arguments, "--kill", point.spec], gate=False)
        crashers: list[tuple[KillPoint, subprocess.Popen[str], str | None]] = [(point, first, None)]
        crashers += [(p, proc, "go\n") for p, proc in zip(then, waiting, strict=False)]
        killed, logs, crashed = True, [], None
        for at, proc, gate in crashers:
            code, out, err = _finish(proc, timeout, gate)
            killed = killed and code == -signal.SIGKILL and f"SIGKILL at {at.spec}" in err
            logs.append(f"[killed at {at.spec}] exit {code}\n{out}{err}")
            if crashed is None:
                crashed = journal.load(saga_id)
        code, out, err = _finish(waiting[-1], timeout, "go\n")
        seconds = time.monotonic() - started
        snapshot = journal.load(saga_id)
        unsettled = tuple(store.list(states=(State.IN_PROGRESS, State.IN_DOUBT), namespace=saga_id))
        return PointResult(
            point=point,
            saga_id=saga_id,
            killed=killed,
            crashed_state=None if crashed is None else crashed.saga.state,
            state=None if snapshot is None else snapshot.saga.state,
            snapshot=snapshot,
            unsettled=unsettled,
            recovered=_last_json(out),
            seen=observe(saga_id),
            seconds=seconds,
            then=tuple(then),
            crash_log="\n".join(logs),
            recovery_log=f"exit {code}\n{out}{err}",
        )
    finally:
        for proc in waiting:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        journal.close()
        store.close()


def run_kill_point_sweep(
    points: Iterable[KillPoint],
    *,
    scenario: str,
    storage: Callable[[int], Storage],
    observe: Callable[[str], T],
    params: Mapping[str, str] | None = None,
    lease: float = 0.5,
    recovery: str = "rerun",
    driver: str = "sync",
    timeout: float = 120.0,
    workers: int = 1,
) -> list[PointResult[T]]:
    """:func:`run_kill_point` for every point, each on ``storage(i)`` under a fresh saga id.

    Args:
        workers: points run at once (each is two child processes that mostly wait).

    Returns:
        One result per point, in the order of ``points``.
    """

    def one(item: tuple[int, KillPoint]) -> PointResult[T]:
        i, point = item
        return run_kill_point(
            point,
            scenario=scenario,
            storage=storage(i),
            observe=observe,
            params=params,
            lease=lease,
            recovery=recovery,
            driver=driver,
            timeout=timeout,
        )

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, enumerate(points)))


def trace_run(
    *,
    scenario: str,
    storage: Storage,
    saga_id: str | None = None,
    params: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> tuple[dict[str, Any], list[Boundary]]:
    """Run a scenario once in a child, undisturbed, and return its outcome line and the boundaries
    it met: compare them with :func:`kill_points` to check the shadow matches the real saga."""
    saga_id = saga_id or f"kp-{uuid.uuid4().hex[:12]}"
    storage.journal().close()
    storage.store().close()
    arguments = ["--scenario", scenario, "--saga-id", saga_id, "--namespace", saga_id, *storage.args()]
    for key, value in (params or {}).items():
        arguments += ["--param", f"{key}={value}"]
    code, out, err = _finish(_spawn(arguments, gate=False), timeout)
    result = _last_json(out)
    if code != 0 or "trace" not in result:
        raise RuntimeError(f"the traced run failed (exit {code}):\n{out}\n{err}")
    events = [Boundary(str(t), str(m), int(n), str(d), bool(f)) for t, m, n, d, f in result.pop("trace")]
    return result, events
