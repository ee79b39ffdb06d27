"""A worker SIGKILLed mid-call, resumed at once in a fresh process on the default Guard settings.

The dead worker (``tests/_takeoverchild.py``, role ``hang``) claims a charge, makes it at the
counter service and blocks; the test SIGKILLs it. A fresh child then runs the same call on a store
clock that advances only when its guard sleeps (so the dead worker's lease cannot run out by
itself): on the same host it must take the dead holder's claim over at once, without a single
wait; as "another host" (``$SAGAGUARD_HOST_ID``) it must wait the lease out and then finish. The
charges are counted at the service, in its own process, and the record read back from the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _takeoverchild import EFFECT, NAMESPACE
from conftest import StoreFactory

from sagaguard.idempotency import holder
from sagaguard.idempotency.guard import DEFAULT_LEASE, DEFAULT_WAIT
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import Record, State
from sagaguard.idempotency.testing import CounterService

CHILD = Path(__file__).resolve().parent / "_takeoverchild.py"
ROOT = CHILD.parent.parent

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def service() -> Iterator[CounterService]:
    with CounterService() as running:
        yield running


def _env(host_id: str | None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    env.pop(holder.HOST_ENV, None)
    if host_id is not None:
        env[holder.HOST_ENV] = host_id
    return env


def _config(factory: StoreFactory, service: CounterService, order: str, role: str, **more: Any) -> str:
    return json.dumps({"spec": factory.spec(), "service": service.url, "scope": order, "role": role, **more})


def kill_mid_call(factory: StoreFactory, service: CounterService, order: str) -> Record:
    """Run a worker until its charge reached the service, SIGKILL it, and return its claim."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), _config(factory, service, order, "hang")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(None),
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert line == "charged", err
    assert proc.returncode == -signal.SIGKILL
    assert service.count(order) == 1
    store = factory.open(clock=None)
    claimed = store.get(EffectIdentity.of(NAMESPACE, order, EFFECT, 0).key)
    assert claimed is not None
    assert claimed.state is State.IN_PROGRESS
    found = holder.parse(claimed.holder or "")
    assert found is not None and found.pid == proc.pid
    return claimed


def resume(
    factory: StoreFactory, service: CounterService, order: str, *, host_id: str | None, **more: Any
) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(CHILD), _config(factory, service, order, "resume", **more)],
        capture_output=True, text=True, env=_env(host_id), timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_resumed_at_once_on_the_same_host_takes_over_the_dead_holder(
    shared_store_factory: StoreFactory, service: CounterService
) -> None:
    order = f"order-{uuid.uuid4().hex[:10]}"
    claimed = kill_mid_call(shared_store_factory, service, order)

    out = resume(shared_store_factory, service, order, host_id=None, reconciler=True)

    assert (out["outcome"], out["busy"], out["waited"]) == ("ok", 0, 0.0)  # no wait at all
    assert out["ran"] is None  # the reconciler found the dead worker's charge
    assert (out["state"], out["token"], out["attempts"]) == ("succeeded", claimed.token + 1, 2)
    assert service.count(order) == 1


def test_resumed_on_another_host_waits_out_the_default_lease(
    shared_store_factory: StoreFactory, service: CounterService
) -> None:
    order = f"order-{uuid.uuid4().hex[:10]}"
    claimed = kill_mid_call(shared_store_factory, service, order)

    out = resume(shared_store_factory, service, order, host_id="another-host")

    assert (out["outcome"], out["busy"]) == ("ok", 0)
    left = claimed.lease_until - claimed.updated_at  # the lease as the dead worker last set it
    assert left == pytest.approx(DEFAULT_LEASE, abs=1e-3)
    assert left <= out["waited"] <= DEFAULT_WAIT
    # Taken over by lease expiry and re-sent under the same provider key, which the service absorbs.
    assert out["ran"] == claimed.token + 1
    assert (out["state"], out["token"], out["attempts"]) == ("succeeded", claimed.token + 1, 2)
    assert service.count(order) == 1
