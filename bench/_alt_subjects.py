"""The four subjects of bench/alternatives.py, each doing the same no-op or the same charge.

- :class:`Charger`: the real effect, one confirmed PaymentIntent at a local Stripe-compatible
  server through the ``stripe`` SDK (one client, its HTTP connections kept), the call's key sent as
  ``Idempotency-Key``. Every subject calls this very function.
- :func:`guard_calls`: ``Guard.run`` under a new key on a ``SqlStore``.
- :func:`dbos_calls`: a ``@DBOS.workflow`` calling one ``@DBOS.step``; the step is also timed inside
  the workflow.
- :func:`saga_calls`: a declared saga of ``count`` steps, each with its compensation registered, on
  a ``SqlJournal``.
- :class:`TemporalSide`: a Temporal worker and client in this process (their own event loop in a
  thread), running ``_alt_temporal.ActivitiesInARow``.

Imported only where DBOS may be launched: the DBOS functions register at import.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter_ns
from typing import Any, TypeVar

import stripe
from _alt_temporal import CHARGE, NOOP, ActivitiesInARow
from dbos import DBOS
from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker

from sagaguard.idempotency import Guard
from sagaguard.saga import Saga, SagaRunner, SagaState, StepContext

T = TypeVar("T")
CHARGE_PARAMS: Any = {
    "amount": 1999, "currency": "eur", "payment_method": "pm_card_visa",
    "payment_method_types": ["card"], "confirm": True,
}  # fmt: skip


class Charger:
    """One confirmed PaymentIntent per call, keyed; returns its id."""

    def __init__(self, api_base: str, api_key: str) -> None:
        self.client = stripe.StripeClient(api_key, base_addresses={"api": api_base}, max_network_retries=0)
        self.sent = 0
        """Charges asked for (compared with what the server counted)."""
        self._lock = threading.Lock()

    def charge(self, key: str) -> str:
        with self._lock:
            self.sent += 1
        intent = self.client.v1.payment_intents.create(CHARGE_PARAMS, {"idempotency_key": key})
        if intent.status != "succeeded":
            raise RuntimeError(f"bench charge {key}: {intent.status}")
        return intent.id

    def refund(self, payment_intent: str) -> None:
        self.client.v1.refunds.create({"payment_intent": payment_intent})


def noop(key: str) -> str:
    """The no-op effect: returns its key (stored and replayed as a string)."""
    return key


# ------------------------------------------------------------------------------------- guard


def guard_calls(guard: Guard, charger: Charger) -> dict[str, Callable[[str], str]]:
    """A guarded no-op and a guarded charge, each under the key it is given (new per call)."""

    def guarded_noop(key: str) -> str:
        return str(guard.run("bench.noop", lambda: noop(key), key=key, result_type=str))

    def guarded_charge(key: str) -> str:
        return str(guard.run("bench.charge", lambda: charger.charge(key), key=key, result_type=str))

    return {"noop": guarded_noop, "charge": guarded_charge}


# -------------------------------------------------------------------------------------- DBOS

_CHARGER: list[Charger] = []
"""The charger the DBOS step uses (a step is a module-level function)."""
STEP_NS: dict[str, list[int]] = {"noop": [], "charge": []}
"""Each DBOS step's duration, timed inside its workflow, in call order."""


@DBOS.step()
def dbos_noop_step(key: str) -> str:
    return noop(key)


@DBOS.step()
def dbos_charge_step(key: str) -> str:
    return _CHARGER[0].charge(key)


@DBOS.workflow()
def dbos_noop_workflow(key: str) -> str:
    t0 = perf_counter_ns()
    out = dbos_noop_step(key)
    STEP_NS["noop"].append(perf_counter_ns() - t0)
    return out


@DBOS.workflow()
def dbos_charge_workflow(key: str) -> str:
    t0 = perf_counter_ns()
    out = dbos_charge_step(key)
    STEP_NS["charge"].append(perf_counter_ns() - t0)
    return out


@DBOS.workflow()
def dbos_noop_steps_workflow(key: str, count: int) -> list[str]:
    return [dbos_noop_step(f"{key}-{k}") for k in range(count)]


def dbos_calls(url: str, charger: Charger) -> tuple[dict[str, Callable[[str], str]], Callable[[], None]]:
    """Launch DBOS with ``url`` as its system database; the one-step workflows and a stopper."""
    _CHARGER[:] = [charger]
    DBOS(config={"name": "sagaguard-bench-alternatives", "system_database_url": url, "log_level": "WARNING"})
    DBOS.launch()

    def stop() -> None:
        DBOS.destroy(destroy_registry=False)

    return {"noop": dbos_noop_workflow, "charge": dbos_charge_workflow}, stop


# -------------------------------------------------------------------------------------- saga


def _noop_step(ctx: StepContext, key: str) -> str:
    return noop(f"{key}-{ctx.index}")


def _undo_noop(ctx: StepContext, key: str, result: str | None) -> None:
    """The no-op step's compensation (registered with each step; a completed saga never runs it)."""


def saga_calls(
    runner: SagaRunner, charger: Charger, count: int, tag: str
) -> dict[str, Callable[[str], object]]:
    """Sagas of ``count`` steps, each registering its compensation: no-ops, and charges refunded on
    compensation. Each call runs one saga under the id it is given."""

    def charge_step(ctx: StepContext, key: str) -> str:
        return charger.charge(ctx.step_scope)

    def refund(ctx: StepContext, key: str, result: str | None) -> None:
        if result is not None:
            charger.refund(result)

    found: dict[str, Callable[[str], object]] = {}
    for kind, action, undo in (("noop", _noop_step, _undo_noop), ("charge", charge_step, refund)):
        saga: Saga[str] = Saga(f"bench_{kind}_{count}_{tag}", input=str)
        for k in range(count):
            saga.step(name=f"s{k}", compensate=undo)(action)

        def run(saga_id: str, saga: Saga[str] = saga) -> object:
            outcome = runner.run(saga, saga_id, saga_id)
            if outcome.state is not SagaState.COMPLETED:
                raise RuntimeError(f"bench saga {saga_id} ended {outcome.state}")
            return outcome

        found[kind] = run
    return found


# ---------------------------------------------------------------------------------- Temporal


class TemporalSide:
    """A Temporal worker and its client on an event loop of their own (a daemon thread), so the
    synchronous subjects run on the main thread unchanged and a Temporal call is one hand-off.

    The no-op activity is ``async def`` (the cheapest kind Temporal has: no thread); the charge
    activity is the synchronous SDK call, on the worker's thread pool, as a sync activity must be.
    """

    def __init__(self, address: str, charger: Charger, *, threads: int = 16) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="temporal-loop", daemon=True)
        self._thread.start()
        self.queue = f"bench-{uuid.uuid4().hex[:8]}"
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="temporal-activity")

        @activity.defn(name=NOOP)
        async def noop_activity(key: str) -> str:
            return noop(key)

        @activity.defn(name=CHARGE)
        def charge_activity(key: str) -> str:
            return charger.charge(key)

        self.client: Client = self.call(Client.connect(address))

        async def start() -> Worker:
            return Worker(
                self.client, task_queue=self.queue, workflows=[ActivitiesInARow],
                activities=[noop_activity, charge_activity], activity_executor=self._pool,
            )  # fmt: skip

        self.worker = self.call(start())
        self._running = asyncio.run_coroutine_threadsafe(self.worker.run(), self.loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the Temporal loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def run_async(self, activity_name: str, count: int, key: str) -> list[str]:
        """One workflow of ``count`` activities, from start to its result (on the Temporal loop)."""
        return await self.client.execute_workflow(
            ActivitiesInARow.run, args=[activity_name, count, key], id=key, task_queue=self.queue
        )

    def run(self, activity_name: str, count: int, key: str) -> list[str]:
        return self.call(self.run_async(activity_name, count, key))

    def close(self) -> None:
        self.call(self.worker.shutdown())
        self._running.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self._pool.shutdown()
