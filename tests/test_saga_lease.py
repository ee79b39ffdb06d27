"""The lease decision (:func:`sagaguard.saga.lease.verdict`), table-tested with an injected probe, and the
helpers every journal runs after its own start and claim (:mod:`sagaguard.saga.lease`)."""

from __future__ import annotations

import pytest

from sagaguard.saga import SagaState, StartOutcome
from sagaguard.saga.journals.memory import MemoryJournal
from sagaguard.saga.lease import LeaseVerdict, after_claim, after_start, dead_held, host_prefix, verdict
from sagaguard.saga.records import SagaRecord, StartResult

NOW = 1_000.0
DEAD, ALIVE = "here|1|10", "here|2|20"


def probe(who: str | None) -> bool:
    return who == DEAD


def record(state: SagaState, lease_until: float, who: str | None) -> SagaRecord:
    return SagaRecord("s", "n", 1, "fp", "{}", state, 3, lease_until, 0.0, 0.0, holder=who)


@pytest.mark.parametrize(
    ("state", "lease_until", "who", "expected"),
    [
        (SagaState.RUNNING, NOW + 5, DEAD, LeaseVerdict.TAKE_OVER),
        (SagaState.COMPENSATING, NOW + 5, DEAD, LeaseVerdict.TAKE_OVER),
        (SagaState.RUNNING, NOW + 5, ALIVE, LeaseVerdict.HELD),
        (SagaState.COMPENSATING, NOW + 5, None, LeaseVerdict.HELD),  # unknown: never judged dead
        (SagaState.WAITING, NOW + 5, DEAD, LeaseVerdict.HELD),  # parked: nobody holds it
        (SagaState.RUNNING, NOW, ALIVE, LeaseVerdict.DUE),  # the lease ran out: any holder
        (SagaState.COMPENSATING, NOW - 1, DEAD, LeaseVerdict.DUE),
        (SagaState.WAITING, NOW, None, LeaseVerdict.DUE),
        (SagaState.COMPLETED, NOW + 5, DEAD, LeaseVerdict.ENDED),
        (SagaState.COMPENSATED, 0.0, DEAD, LeaseVerdict.ENDED),
        (SagaState.FAILED, 0.0, None, LeaseVerdict.ENDED),
        (SagaState.NEEDS_ATTENTION, NOW + 5, DEAD, LeaseVerdict.ENDED),
    ],
)
def test_verdict(state: SagaState, lease_until: float, who: str | None, expected: LeaseVerdict) -> None:
    assert verdict(record(state, lease_until, who), NOW, dead=probe) is expected


def test_the_probe_runs_only_for_a_live_saga_under_a_live_lease() -> None:
    probed: list[str | None] = []

    def spy(who: str | None) -> bool:
        probed.append(who)
        return True

    for state, lease_until in (
        (SagaState.RUNNING, NOW),
        (SagaState.WAITING, NOW + 5),
        (SagaState.COMPLETED, NOW + 5),
    ):
        verdict(record(state, lease_until, DEAD), NOW, dead=spy)
    assert probed == []
    assert (
        dead_held(
            [record(SagaState.RUNNING, NOW + 5, ALIVE), record(SagaState.RUNNING, NOW + 5, DEAD)], dead=probe
        )[0].holder
        == DEAD
    )


def test_after_start_and_after_claim_take_over_only_a_dead_holders_saga() -> None:
    journal = MemoryJournal(clock=lambda: NOW)
    for saga_id, who in (("dead", DEAD), ("alive", ALIVE)):
        journal.start(saga_id, name="n", version=1, input="{}", fingerprint="fp", lease=30, holder=who)
    for saga_id, outcome in (("dead", StartOutcome.TOOK_OVER), ("alive", StartOutcome.EXISTING)):
        found = journal.load(saga_id)
        assert found is not None
        existing = StartResult(StartOutcome.EXISTING, found)
        got = after_start(
            journal, existing, name="n", version=1, fingerprint="fp", lease=30, holder="me|3|30", dead=probe
        )
        assert got.outcome is outcome
    assert after_claim(journal, "alive", lease=30, holder=None, dead=probe) is None
    assert after_claim(journal, "gone", lease=30, holder=None, dead=probe) is None
    taken = journal.load("dead")
    assert taken is not None and taken.saga.holder == "me|3|30" and taken.saga.token == 2


def test_host_prefix_is_this_hosts() -> None:
    from sagaguard.idempotency import holder

    prefix = host_prefix()
    assert prefix is None or holder.current().startswith(prefix)
