"""Where agent runs are opened: :class:`AgentRunner` holds the journal, the guard and the lease.

::

    runner = AgentRunner(journal, guard)
    with runner.run(trip_agent, thread_id) as run:         # the framework's durable run identity
        graph.invoke(...)                                  # tools call run.call(...)
    async with runner.run(trip_agent, run_id) as run:      # async agents (the Agents SDK, MCP)
        await Runner.run(...)                              # tools await run.acall(...)

See :class:`~sagaguard.saga.agent.run.AgentRun` for what a run does with its tool calls and how it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sagaguard.idempotency.checks import seconds
from sagaguard.idempotency.guard import Guard
from sagaguard.saga.agent.definition import AgentSaga
from sagaguard.saga.agent.run import AgentRun
from sagaguard.saga.checks import check_saga_id
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import SagaOutcome
from sagaguard.saga.renewer import LeaseRenewer
from sagaguard.saga.runner import SagaRunner

__all__ = ["AgentRunner"]


class AgentRunner:
    """Opens agent runs against a journal, with their tool calls guarded by ``guard``.

    Args:
        journal: where the runs' sagas are recorded (the worker sweeps the same one).
        guard: runs the tool calls and the undos once each; the worker needs a guard on the same
            store and namespace, since an undo reads the ledger for its call's record.
        lease: seconds a run's lease lasts; renewed while the run is open, so a dead process's run
            is found by the worker about this long after it died.
        sleep: the sleep between undo retries (inject one in tests).

    Raises:
        ConfigurationError: ``lease`` is not a finite number of seconds > 0.
    """

    def __init__(
        self,
        journal: SagaJournal,
        guard: Guard,
        *,
        lease: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.lease = seconds("lease", lease)
        self.journal = journal
        self.guard = guard
        self._sleep = sleep
        self.renewer = LeaseRenewer(journal, lease)

    def run(
        self, agent: AgentSaga, run_id: str, *, exclusive: bool = False, abandon_after: float | None = None
    ) -> AgentRun:
        """The run ``run_id`` of ``agent``, to open with ``with`` or ``async with`` (see
        :class:`~sagaguard.saga.agent.run.AgentRun`).

        Args:
            agent: the run's saga type.
            run_id: the framework's durable run identity.
            exclusive: refuse to open a run whose lease another open run holds
                (:class:`~sagaguard.saga.errors.SagaInProgress`, nothing written) instead of attaching to
                it as to this process's own run resumed before its lease ran out. For engines
                that may run two processes for one run at once (Temporal activities of one
                workflow on two workers, DBOS steps): each opens the run exclusively, so only
                one appends rows at a time; a dead holder's run is taken over once its lease
                runs out.
            abandon_after: the run's own abandon deadline, recorded with it when it starts, for
                a saga type that has none (``AgentSaga(abandon_after=None)``): the worker, with no
                configuration, compensates the run once its process has been gone that long (an
                adapter whose framework may restart a run under a new id declares it, see
                :class:`~sagaguard.connectors.frameworks.crewai_saga.CrewSaga`).

        A run that has COMPLETED opens too (a restart after a crash between the run's completion
        and the program saving its answer): ``run.outcome`` is already COMPLETED with
        ``replayed=True``, nothing is written, recorded calls replay through the guard and a new
        call raises :class:`~sagaguard.saga.agent.errors.AgentRunEnded`, with ``exclusive=True`` too
        (an engine's step re-run on a completed run replays its recorded call).

        Raises:
            ConfigurationError: a run id that is empty, not a str or holds a NUL character (a
                lone surrogate: CodecError), before anything is stored.
        """
        check_saga_id(run_id, "an agent run id")
        return AgentRun(self, agent.freeze(), run_id, exclusive=exclusive, abandon_after=abandon_after)

    def reject(self, agent: AgentSaga, run_id: str, reason: str = "rejected") -> SagaOutcome:
        """A human rejected the run at an approval: undo its tool calls now (see
        :meth:`AgentRun.reject <sagaguard.saga.agent.run.AgentRun.reject>`), from any process.

        Raises:
            AgentRunEnded: the run has already ended (completed, compensated, ...).
        """
        with self.run(agent, run_id) as run:
            return run.reject(reason)

    async def areject(self, agent: AgentSaga, run_id: str, reason: str = "rejected") -> SagaOutcome:
        """The async twin of :meth:`reject` (the journal and the undos run in a worker thread)."""
        async with self.run(agent, run_id) as run:
            return await run.areject(reason)

    def compensator(self) -> SagaRunner:
        """A saga runner that drives one compensation in this process (closed by the caller)."""
        return SagaRunner(self.journal, self.guard, lease=self.lease, max_recoveries=None, sleep=self._sleep)

    def close(self) -> None:
        """Stop the lease renewer's thread."""
        self.renewer.close()
