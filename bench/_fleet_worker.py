"""One worker process of bench/fleet.py: a closed loop of one workload, or the recovery sweeper.

Run as ``python bench/_fleet_worker.py '<json>'`` (``bench/fleet.py`` starts it). The JSON holds
the ``backend`` (``postgres`` or ``redis``), its ``url``, the ``kinds`` of work it is ready for
(or one ``kind``), a ``tag`` that keeps this worker's ids apart from every other's, the saga's
``steps``, and for ``counter`` work the counter service's ``service`` URL.

Kinds of work (one *unit* each loop):

- ``saga``: the agent-like saga (:func:`agent_saga`): ``steps`` steps, each one guarded effect (a
  tool call) with a guarded undo declared, on the backend's store and journal, a fresh saga id per
  unit; ``effect`` is ``noop`` (the tool does nothing) or ``counter`` (it charges the counter
  service, where effects are counted, then takes ``latency`` seconds);
- ``saga_floor``: the same writes on the bare driver: per step the guarded call's floor (two
  one-row commits) and the step's (one more);
- ``call`` / ``call_floor``: one guarded new call (no-op body) / its floor, two commits;
- ``call_same``: the guarded call's second floor, the same record on the bare driver
  (bench/_fleet_same.py; the config's ``record`` is the template it writes);
- ``step`` / ``step_floor``: a saga of ``steps`` no-op steps (no effect in them) / ``steps``
  one-row commits;
- ``sweeper``: :class:`~sagaguard.saga.recovery.RecoveryWorker` with the defaults unless the JSON
  sets ``interval`` and ``lease`` (``lease`` sets a ``saga`` worker's runner and guard lease too);
  prints one JSON line per sweep that drove sagas (``{"started": wall clock at the sweep's start,
  "t": at its end, "recovered": {id: state}}``) and one per effect it found in doubt and asked the
  counter service about (``{"reconciled": scope, "answer": "Applied"}``), until SIGTERM.

Protocol (load kinds): the worker connects and warms up every kind, prints ``ready``, then obeys
its stdin line by line. ``go KIND``: run units of that kind back to back until ``seconds`` have
passed (``seconds`` <= 0: until a ``stop`` line), finish the unit in hand and print ``{"units": n,
"cpu": s, "wall": s}``; ``exit`` (or the end of stdin): close everything and exit. Units are
numbered from 0 per worker and kind, across windows; a saga's id is ``{tag}-{kind}-{n}``.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import RETENTION
from _subjects import guard_subject, noop_sagas, postgres_floor, redis_floor, sql_commits_floor

from sagaguard.idempotency import Guard, current_effect, open_store
from sagaguard.saga import Saga, SagaRunner, SagaState, StepContext
from sagaguard.saga.journals import open_journal

STEP_NAMES = ("search", "draft", "send", "log", "notify", "archive", "review", "close")
"""The agent saga's step names, in order (a saga takes the first ``steps``)."""
WARMUP = 2
"""Units each worker runs before it says ``ready``: connections made, statements prepared."""


def agent_saga(
    guard: Guard,
    steps: int,
    tool: Callable[[int], int],
    undo: Callable[[int], int],
    reconciler: Any = None,
) -> Saga[int]:
    """The fleet's saga: ``steps`` compensatable steps, each calling ``tool`` as a guarded effect
    (``fleet.tool``) and declaring an undo that calls ``undo`` as one (``fleet.undo``); an in-doubt
    effect is settled by ``reconciler`` when given."""
    saga: Saga[int] = Saga("fleet_agent", version=1, input=int)
    guarded_tool = guard.effect("fleet.tool", reconciler=reconciler)(tool)
    guarded_undo = guard.effect("fleet.undo", reconciler=reconciler)(undo)

    def action(ctx: StepContext, value: int) -> int:
        return guarded_tool(value)

    def compensation(ctx: StepContext, value: int, result: int | None) -> None:
        guarded_undo(value)

    for name in STEP_NAMES[:steps]:
        saga.step(name=name, compensate=compensation)(action)
    return saga


def _noop(value: int) -> int:
    return value


def _counter_effects(
    service: str, latency: float = 0.0
) -> tuple[Callable[[int], int], Callable[[int], int], Any]:
    """A tool and an undo that each charge the counter service once, under the effect's own key
    with deduplication off (a repeat would be counted), then take ``latency`` seconds more (a
    tool's own time: a kill then most likely lands between a charge and its record, the effect in
    doubt), and the reconciler that settles an effect
    left in doubt: the charge found by its provider key is the effect's result (its amount, which
    the tool returns), none found means not applied."""
    from sagaguard.idempotency import Applied
    from sagaguard.idempotency.testing import CounterClient

    client = CounterClient(service)
    find = client.reconciler()

    def charge(value: int) -> int:
        effect = current_effect()
        client.charge(effect.key, value, provider_key=effect.provider_key, dedup=False)
        time.sleep(latency)
        return value

    def reconcile(request: Any) -> Any:
        answer = find(request)
        return Applied(answer.result.amount) if isinstance(answer, Applied) else answer

    return charge, charge, reconcile


def build(config: dict[str, Any]) -> tuple[Callable[[int], object], Callable[[], None]]:
    """The unit of work ``config`` names, and what closes it."""
    backend, url, kind, tag = config["backend"], config["url"], config["kind"], config["tag"]
    steps = int(config["steps"])
    if kind == "saga":
        store, journal = open_store(url), open_journal(url)
        reconciler = None
        tool: Callable[[int], int] = _noop
        undo: Callable[[int], int] = _noop
        if config.get("effect") == "counter":
            tool, undo, reconciler = _counter_effects(config["service"], float(config.get("latency", 0)))
        # ``lease`` (quick runs only): the runner's and the guard's, else the library's defaults.
        leases = {"lease": float(config["lease"])} if config.get("lease") else {}
        guard = Guard(store, namespace="fleet", retention=RETENTION, **leases)
        saga = agent_saga(guard, steps, tool, undo, reconciler)
        runner = SagaRunner(journal, guard, **leases)

        def run(i: int) -> object:
            outcome = runner.run(saga, f"{tag}-{i}", i)
            if outcome.state is not SagaState.COMPLETED:
                raise RuntimeError(f"fleet saga ended {outcome.state}: {outcome.error}")
            return outcome

        def close() -> None:
            runner.close()
            guard.close()
            journal.close()
            store.close()

        return run, close
    if kind == "call":
        store = open_store(url)
        guard = Guard(store, namespace="fleet", retention=RETENTION)
        subject = guard_subject(guard, tag)
        return subject.sync, lambda: (guard.close(), store.close())  # type: ignore[func-returns-value]
    if kind == "step":
        journal = open_journal(url)
        return noop_sagas(journal, steps, tag), journal.close
    if kind == "call_same":
        from _fleet_same import postgres_same, redis_same

        return (postgres_same if backend == "postgres" else redis_same)(url, tag, config["record"])
    floor_commits = {"saga_floor": 3 * steps, "call_floor": 2, "step_floor": steps}[kind]
    if backend == "postgres":
        if kind == "call_floor":
            subject = postgres_floor(url, tag)
        else:
            subject = sql_commits_floor("postgres", url, tag, floor_commits)
        return subject.sync, subject.close
    return _redis_floor(url, tag, floor_commits)


def _redis_floor(url: str, tag: str, writes: int) -> tuple[Callable[[int], object], Callable[[], None]]:
    """Redis floors on a cluster: the guarded call's (SET NX, SET: ``writes`` 2), else ``writes``
    writes of one key (the first SET NX), as many as the guarded work's commits on SQL."""
    from redis.cluster import RedisCluster

    node = url.split("://", 1)[1].split(",", 1)[0]
    subject = redis_floor(
        url, f"fleet:{tag}", 1, client=RedisCluster.from_url(f"redis://{node}", decode_responses=True)
    )
    if writes == 2:
        return subject.sync, subject.close
    client, ttl = subject.extras["client"], int(RETENTION * 1000)

    def run(i: int) -> object:
        subject.sync(i)  # the first two writes
        for _ in range(writes - 2):
            client.set(f"fleet:{tag}:floor:{i}", "step", px=ttl)
        return i

    return run, subject.close


def load(config: dict[str, Any]) -> int:
    """The load protocol (see the module's docstring)."""
    kinds = config.get("kinds") or [config["kind"]]
    work = {kind: build({**config, "kind": kind, "tag": f"{config['tag']}-{kind}"}) for kind in kinds}
    for run, _ in work.values():
        for i in range(WARMUP):
            run(-1 - i)
    print("ready", flush=True)
    lines: queue.Queue[str] = queue.Queue()
    stop = threading.Event()

    def read() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                stop.set()
            else:
                lines.put(line.strip())
        lines.put("exit")

    threading.Thread(target=read, daemon=True).start()
    seconds = float(config["seconds"])
    done = dict.fromkeys(kinds, 0)
    while (command := lines.get().split())[0] == "go":
        run = work[command[1]][0]
        stop.clear()
        cpu0, t0 = time.process_time(), time.monotonic()
        deadline = t0 + seconds if seconds > 0 else float("inf")
        units = 0
        while not stop.is_set() and time.monotonic() < deadline:
            run(done[command[1]] + units)
            units += 1
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        done[command[1]] += units
        print(json.dumps({"units": units, "cpu": cpu, "wall": wall}), flush=True)
    for _, close in work.values():
        close()
    return 0


def sweep(config: dict[str, Any]) -> int:
    """The recovery sweeper (see the module's docstring)."""
    from sagaguard.saga.recovery import RecoveryReport, RecoveryWorker

    store, journal = open_store(config["url"]), open_journal(config["url"])
    tool, undo, reconciler = _counter_effects(config["service"])

    def reconcile(request: Any) -> Any:
        answer = reconciler(request)
        print(json.dumps({"reconciled": request.identity.scope, "answer": type(answer).__name__}), flush=True)
        return answer

    guard = Guard(store, namespace="fleet", retention=RETENTION)
    saga = agent_saga(guard, int(config["steps"]), tool, undo, reconcile)

    class Timed(RecoveryWorker):
        """Notes when each sweep starts: a saga it drives was taken over then (within its query)."""

        started = 0.0

        def run_once(self) -> RecoveryReport:
            self.started = time.time()
            return super().run_once()

    def report(found: RecoveryReport) -> None:
        if found.outcomes or found.errors:
            states = {k: str(v.state) for k, v in found.outcomes.items()}
            line = {"started": worker.started, "t": time.time(), "recovered": states}
            print(json.dumps({**line, "errors": dict(found.errors)}), flush=True)

    options = {k: float(config[k]) for k in ("interval", "lease") if config.get(k) is not None}
    worker = Timed(journal, guard, saga, on_report=report, **options)  # type: ignore[arg-type]
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    print(json.dumps({"interval": worker.interval, "lease": worker.runner.lease}), flush=True)
    worker.run()
    guard.close()
    journal.close()
    store.close()
    return 0


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    return sweep(config) if config.get("kind") == "sweeper" else load(config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
