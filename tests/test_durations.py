"""Every duration option in idempotency/ is a finite number of seconds, or a ConfigurationError that
names the option. NaN matters most: it compares false with every bound, so a plain ``<= 0`` check
let a NaN lease through, and a claim under it never ran out (a dead worker's effect blocked for ever).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sagaguard.idempotency import ConfigurationError, Guard, MemoryStore, scope
from sagaguard.idempotency.outbox.control import OutboxControl
from sagaguard.idempotency.outbox.policy import RelaySettings

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
    with pytest.raises(ConfigurationError, match=f"^{option} "):
        RelaySettings(**{option: value})


@pytest.mark.parametrize("value", [NAN, INF, -1.0], ids=IDS)
def test_relay_retention_is_finite_and_may_be_zero(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^retention "):
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
