"""The console in a real browser (Debian's chromium, headless, driven by Playwright): list,
filter, a bulk action's preview, open a saga, resolve a charge a SIGKILL left without a record,
retry a parked compensation, cancel a run and see its undos in the timeline, an action refused
without the token, a POST without the CSRF token refused. Saves the screenshots the docs show.

The agent is ``tests/_agentsagachild.py`` killed right after the API applied its charge; the
console is ``sagaguard ui`` in its own process; the undos run in a ``sagaguard sagas worker``
process; what reached the API is counted at the API.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _consolekit import Psp, populate
from conftest import require_service

from sagaguard.connectors.testing.http_server import LocalIdempotentApi
from sagaguard.idempotency.stores import open_store
from sagaguard.idempotency.testing.children import child_environment
from sagaguard.saga import SagaState
from sagaguard.saga.journals import open_journal

pytestmark = pytest.mark.timeout(120)

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
IMAGES = ROOT / "docs" / "images"
TOKEN = "browser-test-token-0123456789"
_CLI = "import sys; from sagaguard.idempotency.cli import main; sys.exit(main(sys.argv[1:]))"
ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip


def _browser_problem() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (apt-get install chromium; .ci/run installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install -e '.[dev]')"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90, check=False)


def _applied(api: LocalIdempotentApi) -> Counter[str]:
    found = httpx.get(f"{api.url}/resources", timeout=10).json()["resources"]
    return Counter(resource["path"] for resource in found)


@pytest.fixture
def api() -> Iterator[LocalIdempotentApi]:
    with LocalIdempotentApi() as server:
        yield server


@pytest.fixture
def console(tmp_path: Path) -> Iterator[tuple[str, Callable[[], str]]]:
    """The ledger's URL and a running ``sagaguard ui`` on it (started once the ledger exists)."""
    db = f"sqlite:///{tmp_path}/ledger.db"
    procs: list[subprocess.Popen[str]] = []

    def start() -> str:
        port = _free_port()
        # Run in the ledger's folder with a relative URL: the screenshots show "sqlite:///ledger.db".
        argv = [
            sys.executable, "-c", _CLI, "ui", "--store", "sqlite:///ledger.db", "--port", str(port),
            "--token", TOKEN, "--refresh", "0", "--trace-url", "http://traces.example/trace/{trace_id}",
        ]  # fmt: skip
        proc = subprocess.Popen(
            argv,
            env=child_environment(),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        for _ in range(400):  # polls until it answers (not a threshold: any start time passes)
            if proc.poll() is not None:
                raise AssertionError(f"sagaguard ui exited: {proc.stdout.read() if proc.stdout else ''}")
            try:
                if httpx.get(base + "/", timeout=2).status_code == 200:
                    return base
            except httpx.TransportError:
                time.sleep(0.05)
        raise AssertionError("sagaguard ui never answered")

    yield db, start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


# About 20 s (three Python processes, a browser, worker passes): it runs with the long sweeps
# (-m slow, `make slow`, CI), not in `make test`.
@pytest.mark.slow
@pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow")
def test_the_console_in_a_browser(
    api: LocalIdempotentApi, console: tuple[str, Callable[[], str]], tmp_path: Path
) -> None:
    require_service("chromium", _browser_problem())
    from playwright.sync_api import expect, sync_playwright

    db, start = console
    env = {
        **child_environment(str(TESTS)), "AGENT_API": api.url, "AGENT_DB": db, "AGENT_MARKS": str(tmp_path),
        "SAGAGUARD_STORE": db,
    }  # fmt: skip
    # The agent charges the card and is SIGKILLed before the charge's record: it stays in progress,
    # held by a process that no longer exists.
    agent = _run([sys.executable, str(TESTS / "_agentsagachild.py")], {**env, "AGENT_KILL": "in_charge"})
    assert agent.returncode == -signal.SIGKILL, agent.stdout + agent.stderr
    assert _applied(api) == {"/bookings": 1, "/charges": 1}
    store, journal = open_store(db), open_journal(db)
    try:
        populate(store, journal, Psp())  # waiting trips, a parked refund
    finally:
        store.close()
        journal.close()
    base = start()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        try:
            page.goto(base + "/")
            expect(page.locator("h1")).to_have_text("Overview")
            expect(page.locator('[data-list="sagas-waiting"]')).to_have_text("2")
            expect(page.locator('[data-list="sagas-needs_attention"]')).to_have_text("1")
            assert "sqlite:///ledger.db" in page.content()
            IMAGES.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(IMAGES / "console-home.png"), full_page=True)

            # List and filter.
            page.goto(base + "/sagas?view=waiting")
            page.fill('input[name="prefix"]', "trip-2")
            page.click("text=Filter")
            expect(page.locator("table.list a", has_text="trip-2")).to_be_visible()
            expect(page.locator("table.list a", has_text="trip-1")).to_have_count(0)

            # A bulk action's preview over the filtered list: how many, which, nothing done yet.
            page.click("text=Cancel all matching…")
            expect(page.locator("#bulk-count")).to_contain_text("This will touch 1 item")
            expect(page.locator("ul.targets li")).to_have_text(["trip-2"])
            page.click("text=Not now")
            with journal_of(db) as j:
                assert j.load("trip-2").saga.cancel_requested is False  # type: ignore[union-attr]

            # Refused without the token: the confirmation goes through, the action does not.
            page.goto(base + "/sagas/trip-1")
            page.click("text=Cancel…")
            page.click("button:has-text('Confirm')")
            expect(page.locator(".refused")).to_contain_text("log in")
            with journal_of(db) as j:
                assert j.load("trip-1").saga.cancel_requested is False  # type: ignore[union-attr]

            # Log in; a POST without the CSRF token (the session cookie alone) is still refused.
            page.goto(base + "/login")
            page.fill('input[name="name"]', "ana")
            page.fill('input[name="token"]', TOKEN)
            page.click("button:has-text('Log in')")
            expect(page.locator(".flash")).to_contain_text("logged in as ana")
            forged = page.request.post(base + "/act/saga.cancel", form={"target": "trip-1"})
            assert forged.status == 403 and "csrf" in forged.text()

            # Open the agent's run; its charge has no record: resolve it as applied with what the API
            # says it charged.
            page.goto(base + "/sagas/thread-1")
            page.click("a:has-text('agent.tool.charge')")
            expect(page.locator("td.state")).to_have_text("in_progress")
            charge = next(r for r in httpx.get(f"{api.url}/resources", timeout=10).json()["resources"]
                          if r["path"] == "/charges")  # fmt: skip
            page.click("text=Resolve as applied…")
            page.fill('textarea[name="result"]', json.dumps(charge))
            page.click("button:has-text('Confirm')")
            expect(page.locator("td.state")).to_have_text("succeeded")
            expect(page.locator(".flash")).to_contain_text("applied")

            # Retry the parked compensation (the refund's provider is back).
            page.goto(base + "/sagas/refund-1")
            page.click("a.button:has-text('Retry…')")
            page.click("button:has-text('Confirm')")
            expect(page.locator(".flash")).to_contain_text("compensating")

            # Cancel the run; a worker undoes its tool calls; the timeline shows the undos.
            page.goto(base + "/sagas/thread-1")
            page.click("text=Cancel…")
            page.click("button:has-text('Confirm')")
            expect(page.locator(".flash")).to_contain_text("requested")
            worker = [
                sys.executable,
                "-c",
                _CLI,
                "sagas",
                "worker",
                "--app",
                "_agentsagachild:registry",
                "--once",
            ]
            for _ in range(20):
                done = _run(worker, env)
                assert done.returncode == 0, done.stdout + done.stderr
                with journal_of(db) as j:
                    state = j.load("thread-1").saga.state  # type: ignore[union-attr]
                if state not in (SagaState.RUNNING, SagaState.COMPENSATING):
                    break
            assert state is SagaState.COMPENSATED
            page.reload()
            expect(page.locator("#saga-state")).to_contain_text("compensated")
            # Both tool calls undone (the refund, then the booking's cancellation), then the run.
            expect(page.locator(".timeline li", has_text="compensated")).to_have_count(3)
            expect(page.locator("table.steps td", has_text="charge: undone")).to_have_count(1)
            expect(page.locator("table.audit")).to_contain_text("saga.cancel")
            page.screenshot(path=str(IMAGES / "console-saga.png"), full_page=True)
            assert _applied(api) == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}

            page.goto(base + "/audit?actor=ana")
            for action in ("effect.resolve", "saga.retry", "saga.cancel"):
                expect(page.locator("table.audit")).to_contain_text(action)
        finally:
            browser.close()


class journal_of:
    """The journal at ``db``, opened for one read."""

    def __init__(self, db: str) -> None:
        self.journal = open_journal(db)

    def __enter__(self) -> Any:
        return self.journal

    def __exit__(self, *exc: object) -> None:
        self.journal.close()


def test_chromium_is_found_where_ci_installs_it() -> None:
    """Outside CI a missing browser skips the browser test with the reason; under CI it fails."""
    problem = _browser_problem()
    if problem is not None and os.environ.get("CI", "").lower() != "true":
        pytest.skip(problem)
    assert problem is None and shutil.which("chromium") is not None
