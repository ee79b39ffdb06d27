"""Every connector, killed for real: SIGKILL after the provider applied the call, before the record.

Each test runs ``tests/_connectorchild.py`` (the real SDK against the local server) and kills it
with SIGKILL at ``before_complete`` (the store point right after the call returned, before its
result is written). A fresh child then runs the same scope again. What
is asserted is what the provider saw, counted in another process (the local HTTP servers) or in
this one (the SMTP sink): one effect, whatever the crash. The Stripe test runs on SQLite, Postgres
and Redis; the others on SQLite only (the store's own crash behaviour is proven on every backend by
test_crash.py; child processes are what makes this file slow).

- Stripe: the restart's reconciler lists PaymentIntents by metadata and records the one made.
- HTTP: the restart re-sends under the same ``Idempotency-Key``; the server replays its answer.
- LLM: the call was stored at the provider (``store_at_provider``); the reconciler finds it, so the
  restart sees the same tool call id and pays nothing.
- Email: SMTP cannot be asked; at most once, the restart reports ``OutcomeUnknown`` and sends
  nothing. A second test kills the sender while the server holds its reply (mid-send).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _connectorchild import EXIT_OK, EXIT_UNKNOWN, NAMESPACE
from conftest import StoreFactory

from sagaguard.connectors.testing import LocalChatModel, LocalIdempotentApi, LocalStripe
from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import State
from sagaguard.idempotency.testing import CRASH_ENV

CHILD = Path(__file__).resolve().parent / "_connectorchild.py"
ROOT = CHILD.parent.parent
LEASE = 0.5

pytestmark = pytest.mark.timeout(120)
SQLITE_ONLY = pytest.mark.parametrize("shared_store_factory", ["sqlite"], indirect=True)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> dict[str, Any]:
        lines = self.stdout.strip().splitlines()
        assert lines, f"the child printed nothing (exit {self.returncode}):\n{self.stderr}"
        return dict(json.loads(lines[-1]))

    def killed(self) -> None:
        assert self.returncode == -signal.SIGKILL, f"exit {self.returncode}:\n{self.stdout}\n{self.stderr}"

    def ok(self) -> dict[str, Any]:
        assert self.returncode == EXIT_OK, f"exit {self.returncode}:\n{self.stdout}\n{self.stderr}"
        return self.output


def start(config: dict[str, Any], crash_at: str | None) -> subprocess.Popen[str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    env.pop(CRASH_ENV, None)
    if crash_at is not None:
        env[CRASH_ENV] = crash_at
    return subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(config)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout: float = 60.0) -> Run:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the child hung:\n{out}\n{err}") from None
    return Run(proc.returncode, out, err)


@dataclass
class Scenario:
    factory: StoreFactory
    connector: str
    extra: dict[str, Any]
    scope: str

    def config(self) -> dict[str, Any]:
        spec = self.factory.spec()
        return {"spec": spec, "connector": self.connector, "scope": self.scope, "lease": LEASE, **self.extra}

    def run(self, crash_at: str | None = None) -> Run:
        return finish(start(self.config(), crash_at))

    def state(self, name: str) -> State | None:
        store = self.factory.open(clock=None)
        record = store.get(EffectIdentity.of(NAMESPACE, self.scope, name, 0).key)
        return None if record is None else record.state


@pytest.fixture(scope="module")
def stripe_server() -> Iterator[LocalStripe]:
    with LocalStripe() as running:
        yield running


@pytest.fixture(scope="module")
def http_server() -> Iterator[LocalIdempotentApi]:
    with LocalIdempotentApi() as running:
        yield running


@pytest.fixture(scope="module")
def chat_server() -> Iterator[LocalChatModel]:
    with LocalChatModel() as running:
        yield running


@pytest.fixture(scope="module")
def sink() -> Iterator[SmtpSink]:
    with SmtpSink() as running:
        yield running


def scenario(factory: StoreFactory, connector: str, **extra: Any) -> Scenario:
    return Scenario(factory, connector, extra, f"{connector}-{uuid.uuid4().hex[:10]}")


def test_stripe_charge_killed_after_stripe_applied_is_reconciled_once(
    shared_store_factory: StoreFactory, stripe_server: LocalStripe
) -> None:
    stripe_server.reset()
    world = scenario(shared_store_factory, "stripe", url=stripe_server.api_base)
    world.run("before_complete").killed()
    assert stripe_server.counters()["charges"] == 1
    assert world.state("stripe.charge") is State.IN_PROGRESS

    payment = world.run().ok()

    counters = stripe_server.counters()
    assert payment["status"] == "succeeded"
    assert counters["charges"] == 1 and counters["payment_intents"] == 1 and counters["lists"] == 1
    assert world.state("stripe.charge") is State.SUCCEEDED


@SQLITE_ONLY
def test_http_write_killed_after_the_server_applied_is_absorbed_by_its_key(
    shared_store_factory: StoreFactory, http_server: LocalIdempotentApi
) -> None:
    http_server.reset()
    world = scenario(shared_store_factory, "http", url=http_server.url)
    world.run("before_complete").killed()
    assert http_server.counters()["applied"] == 1

    result = world.run().ok()

    counters = http_server.counters()
    assert result["status"] == 201
    assert (counters["applied"], counters["replays"]) == (1, 1)
    assert world.state("http.post") is State.SUCCEEDED


@SQLITE_ONLY
def test_llm_call_killed_after_the_model_answered_is_found_and_not_paid_again(
    shared_store_factory: StoreFactory, chat_server: LocalChatModel
) -> None:
    chat_server.reset()
    world = scenario(shared_store_factory, "llm", url=chat_server.url)
    world.run("before_complete").killed()
    assert chat_server.counters()["completions"] == 1

    reply = world.run().ok()

    assert reply["tool_call"].startswith("call_")
    assert chat_server.counters()["completions"] == 1 and chat_server.counters()["lists"] == 1
    assert world.state("llm.chat") is State.SUCCEEDED


@SQLITE_ONLY
def test_email_killed_after_the_server_accepted_is_never_sent_twice(
    shared_store_factory: StoreFactory, sink: SmtpSink
) -> None:
    sink.reset()
    world = scenario(shared_store_factory, "email", host=sink.host, port=sink.port)
    world.run("before_complete").killed()
    assert sink.count() == 1

    restarted = world.run()

    assert restarted.returncode == EXIT_UNKNOWN, restarted.stderr
    assert sink.count() == 1
    assert world.state("email.send") is State.IN_DOUBT


@SQLITE_ONLY
def test_email_killed_mid_send_is_in_doubt_and_never_sent_twice(
    shared_store_factory: StoreFactory, sink: SmtpSink
) -> None:
    """The server has the whole message and holds its 250 reply; the sender dies waiting for it."""
    sink.reset()
    sink.fault("timeout", seconds=5.0)
    world = scenario(shared_store_factory, "email", host=sink.host, port=sink.port, smtp_timeout=30.0)
    proc = start(world.config(), None)
    deadline = time.monotonic() + 30
    while sink.count() == 0 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert sink.count() == 1, "the message never reached the server"
    proc.send_signal(signal.SIGKILL)
    finish(proc).killed()

    restarted = world.run()

    assert restarted.returncode == EXIT_UNKNOWN, restarted.stderr
    assert sink.count() == 1
    assert world.state("email.send") is State.IN_DOUBT
