"""Every duration option is a finite number of seconds, and every count an int, or a
ConfigurationError that names the option, raised by the constructor (before anything is stored or any
loop starts). NaN matters most: it compares false with every bound, so a plain ``<= 0`` check let a
NaN lease through, and a claim under it never ran out (a dead worker's effect blocked for ever); a
NaN or negative interval made the recovery worker sweep without pausing. The property tests at the
end run any number through every public constructor that takes one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from sagaguard.connectors.email import SmtpSettings
from sagaguard.connectors.http import IdempotentHttp
from sagaguard.connectors.in_doubt import WaitForOperator
from sagaguard.connectors.llm import ChatJournal
from sagaguard.connectors.stripe import StripeEffects
from sagaguard.idempotency import ConfigurationError, Guard, MemoryStore, scope
from sagaguard.idempotency.outbox import Outbox
from sagaguard.idempotency.outbox.control import OutboxControl
from sagaguard.idempotency.outbox.policy import RelaySettings
from sagaguard.saga import MemoryJournal, RecoveryWorker, Saga, SagaRunner, recover
from sagaguard.saga.agent import AgentRunner
from sagaguard.saga.renewer import LeaseRenewer

NAN, INF = math.nan, math.inf
BAD_POSITIVE = [NAN, INF, -INF, 0, 0.0, -1, "5", True, None]
BAD_WAIT = [NAN, INF, -INF, -0.5, "1", False, None]
IDS = repr


@pytest.mark.parametrize("value", BAD_POSITIVE, ids=IDS)
@pytest.mark.parametrize("option", ["lease", "retention"])
def test_guard_refuses_a_lease_or_retention_that_is_not_finite_and_positive(option: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=f"^{option}="):
        Guard(MemoryStore(), **{option: value})


@pytest.mark.parametrize("value", BAD_WAIT, ids=IDS)
def test_guard_refuses_a_wait_that_is_not_finite_and_at_least_zero(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^wait="):
        Guard(MemoryStore(), wait=value)


def test_guard_takes_finite_durations_and_a_zero_wait() -> None:
    guard = Guard(MemoryStore(), lease=2, retention=86_400.0, wait=0)
    assert (guard.lease, guard.retention, guard.wait) == (2.0, 86_400.0, 0.0)
    assert all(type(v) is float for v in (guard.lease, guard.retention, guard.wait))


PER_EFFECT = (
    [("lease", v) for v in (NAN, INF, 0, -1)]
    + [("retention", v) for v in (NAN, INF, 0)]
    + [("wait", v) for v in (NAN, INF, -1)]
    + [("provider_window", v) for v in (NAN, INF, 0, -1)]
)


@pytest.mark.parametrize(("option", "value"), PER_EFFECT, ids=repr)
def test_effect_options_refuse_durations_that_are_not_finite(option: str, value: Any) -> None:
    guard = Guard(MemoryStore())
    with pytest.raises(ConfigurationError, match=f"^{option}="):

        @guard.effect("e", **{option: value})
        def effect() -> int:
            return 1

    with pytest.raises(ConfigurationError, match=f"^{option}="):
        guard.operation("op", result_type=int, **{option: value})
    with scope("s"), pytest.raises(ConfigurationError, match=f"^{option}="):
        guard.run("op", lambda: 1, result_type=int, **{option: value})


@pytest.mark.parametrize("value", [NAN, INF, 0, -1.0, True], ids=IDS)
@pytest.mark.parametrize("option", ["lease", "poll_interval", "status_every", "purge_every"])
def test_relay_settings_refuse_durations_that_are_not_finite(option: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=f"^{option}="):
        RelaySettings(**{option: value})


@pytest.mark.parametrize("value", [NAN, INF, -1.0], ids=IDS)
def test_relay_retention_is_finite_and_may_be_zero(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^retention="):
        RelaySettings(retention=value)
    assert RelaySettings(retention=0).retention == 0
    assert RelaySettings(purge_every=None).purge_every is None


@pytest.mark.parametrize("value", [NAN, INF, -1.0], ids=IDS)
def test_outbox_purge_refuses_a_retention_that_is_not_finite(value: float, tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path}/outbox.db")
    try:
        with pytest.raises(ConfigurationError, match="finite retention"):
            OutboxControl(engine).purge(value)
    finally:
        engine.dispose()


def _saga() -> Saga[int]:
    saga: Saga[int] = Saga("noop", version=1, input=int)

    @saga.step(compensate=None)
    def step(_ctx: Any, value: int) -> int:
        return value

    return saga


def _runner(**options: Any) -> SagaRunner:
    return SagaRunner(MemoryJournal(), Guard(MemoryStore()), renewer=False, **options)


def _worker(**options: Any) -> RecoveryWorker:
    return RecoveryWorker(MemoryJournal(), Guard(MemoryStore()), _saga(), **options)


def _agents(**options: Any) -> AgentRunner:
    return AgentRunner(MemoryJournal(), Guard(MemoryStore()), **options)


def _recover(**options: Any) -> Any:
    return recover(MemoryJournal(), Guard(MemoryStore()), _saga(), **options)


_OPENAI = openai.OpenAI(api_key="sk-unused", base_url="http://127.0.0.1:9")


def _stripe(**options: Any) -> StripeEffects:
    return StripeEffects(Guard(MemoryStore()), api_key="sk_test_unused", **options)


def _renewer(lease: Any) -> LeaseRenewer:
    return LeaseRenewer(MemoryJournal(), lease, thread=False)


# (what, option, makes it, whether 0 is a valid value): every public constructor and entry point of
# the saga, outbox and connector layers that takes a duration.
DURATIONS: list[tuple[str, str, Any, bool]] = [
    ("SagaRunner", "lease", lambda v: _runner(lease=v), False),
    ("SagaRunner", "wait", lambda v: _runner(wait=v), True),
    ("SagaRunner", "compensation_inline", lambda v: _runner(compensation_inline=v), True),
    ("recover", "lease", lambda v: _recover(lease=v), False),
    ("RecoveryWorker", "lease", lambda v: _worker(lease=v), False),
    ("RecoveryWorker", "interval", lambda v: _worker(interval=v), True),
    ("AgentRunner", "lease", lambda v: _agents(lease=v), False),
    ("LeaseRenewer", "lease", _renewer, False),
    ("Guard", "lease", lambda v: Guard(MemoryStore(), lease=v), False),
    ("Guard", "retention", lambda v: Guard(MemoryStore(), retention=v), False),
    ("Guard", "wait", lambda v: Guard(MemoryStore(), wait=v), True),
    ("RelaySettings", "lease", lambda v: RelaySettings(lease=v), False),
    ("RelaySettings", "poll_interval", lambda v: RelaySettings(poll_interval=v), False),
    ("RelaySettings", "status_every", lambda v: RelaySettings(status_every=v), False),
    ("RelaySettings", "purge_every", lambda v: RelaySettings(purge_every=v), False),
    ("RelaySettings", "retention", lambda v: RelaySettings(retention=v), True),
    ("WaitForOperator", "interval", lambda v: WaitForOperator(interval=v), False),
    ("WaitForOperator", "timeout", lambda v: WaitForOperator(timeout=v), True),
    ("StripeEffects", "key_window", lambda v: _stripe(key_window=v), False),
    ("StripeEffects", "search_lag", lambda v: _stripe(search_lag=v), True),
    ("SmtpSettings", "timeout", lambda v: SmtpSettings("mail.example", timeout=v), False),
    ("IdempotentHttp", "key_window", lambda v: IdempotentHttp(Guard(MemoryStore()), key_window=v), False),
]
COUNTS: list[tuple[str, str, Any, int]] = [
    ("SagaRunner", "max_recoveries", lambda v: _runner(max_recoveries=v), 0),
    ("recover", "limit", lambda v: _recover(limit=v), 1),
    ("RecoveryWorker", "limit", lambda v: _worker(limit=v), 1),
    ("Outbox", "max_attempts", lambda v: Outbox(max_attempts=v), 1),
    ("Outbox", "max_payload_bytes", lambda v: Outbox(max_payload_bytes=v), 1),
    ("RelaySettings", "batch_size", lambda v: RelaySettings(batch_size=v), 1),
    ("RelaySettings", "concurrency", lambda v: RelaySettings(concurrency=v), 1),
    ("StripeEffects", "max_list_pages", lambda v: _stripe(max_list_pages=v), 1),
    ("ChatJournal", "max_retries", lambda v: ChatJournal(Guard(MemoryStore()), _OPENAI, max_retries=v), 0),
]
DURATION_IDS = [f"{what}({option}=)" for what, option, _, _ in DURATIONS]
COUNT_IDS = [f"{what}({option}=)" for what, option, _, _ in COUNTS]


@pytest.mark.parametrize("value", [NAN, INF, -INF, -1, "5", True], ids=IDS)
@pytest.mark.parametrize(("what", "option", "make", "zero_ok"), DURATIONS, ids=DURATION_IDS)
def test_every_constructor_refuses_a_duration_that_is_not_finite(
    what: str, option: str, make: Any, zero_ok: bool, value: Any
) -> None:
    with pytest.raises(ConfigurationError, match=f"^{option}="):
        make(value)


def test_a_recovery_worker_refuses_an_interval_that_would_make_it_spin() -> None:
    """``RecoveryWorker(interval=nan)`` or ``-1`` swept about 110,000 times a second."""
    for interval in (NAN, -1, -INF):
        with pytest.raises(ConfigurationError, match=r"^interval="):
            _worker(interval=interval)


def test_an_outbox_refuses_max_attempts_0_when_it_is_made_not_at_the_first_enqueue() -> None:
    with pytest.raises(ConfigurationError, match=r"^max_attempts="):
        Outbox(max_attempts=0)


@pytest.mark.parametrize("value", [-1, 1.5, "3", True, NAN], ids=IDS)
@pytest.mark.parametrize(("what", "option", "make", "minimum"), COUNTS, ids=COUNT_IDS)
def test_every_constructor_refuses_a_count_that_is_not_an_int(
    what: str, option: str, make: Any, minimum: int, value: Any
) -> None:
    with pytest.raises(ConfigurationError, match=f"^{option}="):
        make(value)


def _valid_duration(value: object, zero_ok: bool) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value > 0 or (zero_ok and value == 0))
    )


numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**40), 2**40), st.booleans()
)


@given(st.sampled_from(DURATIONS), numbers)
def test_any_duration_is_taken_or_refused_naming_its_option(
    case: tuple[str, str, Any, bool], value: Any
) -> None:
    _what, option, make, zero_ok = case
    if _valid_duration(value, zero_ok):
        made = make(value)
        if isinstance(made, SagaRunner | RecoveryWorker):
            (made if isinstance(made, SagaRunner) else made.runner).close()
    else:
        with pytest.raises(ConfigurationError, match=f"^{option}="):
            make(value)


@given(st.sampled_from(COUNTS), numbers)
def test_any_count_is_taken_or_refused_naming_its_option(case: tuple[str, str, Any, int], value: Any) -> None:
    _what, option, make, minimum = case
    if type(value) is int and value >= minimum:
        make(value)
    else:
        with pytest.raises(ConfigurationError, match=f"^{option}="):
            make(value)
