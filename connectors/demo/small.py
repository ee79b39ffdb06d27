"""``sagaguard demo``: a card is charged once, although the process dies right after the charge.

A job charges a card (``POST /charge`` to a counting service running in its own process) and is
killed with SIGKILL *after* the service charged, *before* the job recorded the result: the crash
that makes naive retries pay twice. A supervisor restarts the job until it finishes, twice over:

- with sagaguard: the restarted job finds the dead run's claim, waits for its lease to run out,
  asks the service whether a charge under its provider key happened (the reconciler), records it
  and returns the original charge: the service saw **1** charge;
- with a naive retry: the restarted job simply charges again: the service saw **2** charges.

Runs in a few seconds on the embedded SQLite store (a temporary file), touching nothing but
127.0.0.1. Exits 0 only when the service counted exactly that, so ``make demo`` failing means
something broke. Also ``python -m sagaguard.connectors.demo.small [--store URL]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sagaguard.idempotency.effect import (
    Applied,
    NotAppliedResolution,
    ReconcileRequest,
    Unknown,
    current_effect,
)
from sagaguard.idempotency.errors import IdempotencyError
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.keys import EffectIdentity, scope
from sagaguard.idempotency.stores import open_store
from sagaguard.idempotency.testing import (
    CRASH_ENV,
    Charge,
    CounterClient,
    CounterService,
    child_environment,
    crash_point,
)

__all__ = ["main"]

LEASE = 0.5
"""The demo's lease, in seconds (the default is 60): how long a dead run's claim blocks a restart."""
AMOUNT = 4200
NAMESPACE = "demo"
EFFECT = "charge_card"
_CHILD = "_child"
_CRASH_POINT = "after_effect"
_MAX_RUNS = 3


# ---------------------------------------------------------------------- the job (child process)


def _emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def _guarded_job(store_url: str, service_url: str, order: str) -> None:
    client = CounterClient(service_url)
    ask_service = client.reconciler()

    def reconciler(request: ReconcileRequest) -> Applied[Charge] | NotAppliedResolution | Unknown:
        found = ask_service(request)
        charge_id = found.result.charge_id if isinstance(found, Applied) else None
        _emit("reconciled", provider_key=request.provider_key, found=charge_id)
        return found

    store = open_store(store_url)
    guard = Guard(store, namespace=NAMESPACE, lease=LEASE, wait=10 * LEASE)

    @guard.effect(EFFECT, reconciler=reconciler)
    def charge_card(amount: int) -> Charge:
        effect = current_effect()
        charge = client.charge(order, amount, provider_key=effect.provider_key)
        _emit("charged", charge_id=charge.charge_id, token=effect.token)
        crash_point(_CRASH_POINT)  # SIGKILL here on the first run: charged, not yet recorded
        return charge

    try:
        with scope(order):
            charge = charge_card(AMOUNT)
    finally:
        guard.close()
        store.close()
    _emit("done", charge_id=charge.charge_id)


def _naive_job(service_url: str, order: str) -> None:
    charge = CounterClient(service_url).charge(order, AMOUNT)
    _emit("charged", charge_id=charge.charge_id)
    crash_point(_CRASH_POINT)
    _emit("done", charge_id=charge.charge_id)


def _child(config: dict[str, Any]) -> int:
    if config["kind"] == "guarded":
        _guarded_job(config["store"], config["service"], config["order"])
    else:
        _naive_job(config["service"], config["order"])
    return 0


# ------------------------------------------------------------------- the supervisor (this process)


@dataclass
class _Run:
    number: int
    returncode: int
    events: list[dict[str, Any]]
    stderr: str

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL

    def find(self, event: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == event), None)


@dataclass
class _Story:
    label: str
    order: str
    runs: list[_Run] = field(default_factory=list)
    charges: int = 0

    @property
    def final(self) -> str | None:
        done = self.runs[-1].find("done") if self.runs else None
        return None if done is None else str(done["charge_id"])

    @property
    def first(self) -> str | None:
        charged = self.runs[0].find("charged") if self.runs else None
        return None if charged is None else str(charged["charge_id"])


def _supervise(story: _Story, config: dict[str, Any], say: Callable[[str], None]) -> None:
    """Run the job until it finishes; the first run is told to die after the charge."""
    for number in range(1, _MAX_RUNS + 1):
        env = child_environment()
        env.pop(CRASH_ENV, None)
        if number == 1:
            env[CRASH_ENV] = _CRASH_POINT
        done = subprocess.run(
            [sys.executable, "-m", "sagaguard.connectors.demo.small", _CHILD, json.dumps(config)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        run = _Run(number, done.returncode, events, done.stderr)
        story.runs.append(run)
        _narrate(story, run, say)
        if not run.killed:
            return


def _narrate(story: _Story, run: _Run, say: Callable[[str], None]) -> None:
    tag = f"  [{story.label}] run {run.number}:"
    reconciled = run.find("reconciled")
    if reconciled is not None:
        say(f"{tag} the dead run's claim was in doubt; once its lease ran out the guard took it over")
        found = reconciled["found"] or "nothing"
        say(f"{tag} reconciler: GET /charges?provider_key={reconciled['provider_key'][:14]}... -> {found}")
    charged = run.find("charged")
    if charged is not None:
        claimed = f"claimed the effect (token {charged['token']}), " if "token" in charged else ""
        again = "  <- charged AGAIN" if run.number > 1 else ""
        say(f"{tag} {claimed}POST /charge -> {charged['charge_id']}{again}")
    if run.killed:
        say(f"{tag} SIGKILL right after the charge: its result was never recorded")
        return
    done = run.find("done")
    if run.returncode != 0 or done is None:
        detail = run.stderr.strip().splitlines()[-1:] or [f"exit {run.returncode}"]
        say(f"{tag} FAILED: {detail[0]}")
        return
    how = "recorded it and returned it" if reconciled is not None and charged is None else "returned it"
    say(f"{tag} finished: {how}: {done['charge_id']}")


def _cell(story: _Story, row: str) -> str:
    runs = story.runs
    if row == "run 1" and runs:
        first = runs[0]
        return f"charged {story.first}, then SIGKILL" if first.killed else f"exit {first.returncode}"
    if row == "restart" and len(runs) > 1:
        last = runs[-1]
        if last.find("charged") is not None:
            return f"charged again: {story.final}"
        if last.find("reconciled") is not None:
            return f"reconciled: {story.final}"
        return f"exit {last.returncode}"
    if row == "service saw":
        return f"{story.charges} charge" + ("" if story.charges == 1 else "s")
    return "-"


def _record_line(store_url: str, order: str) -> str:
    identity = EffectIdentity.of(NAMESPACE, order, EFFECT, 0)
    try:
        store = open_store(store_url)
        try:
            record = store.get(identity.key)
        finally:
            store.close()
    except IdempotencyError as exc:
        return f"cannot read the record: {exc}"
    if record is None:
        return "no record"
    took_over = " (the restart took over the dead run's claim)" if record.attempts > 1 else ""
    return f"{record.state.value.upper()}, {record.attempts} claim(s){took_over}"


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when the service counted 1 charge with sagaguard and 2 without."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    if args_list[:1] == [_CHILD]:
        return _child(json.loads(args_list[1]))
    parser = argparse.ArgumentParser(
        prog="sagaguard demo",
        description="Kill a job right after it charged a card; restart it with and without sagaguard.",
    )
    parser.add_argument("--store", help="store URL (default: a SQLite file in a temporary directory)")
    args = parser.parse_args(args_list)
    if args.store and args.store.split("?")[0] in ("memory://", "sqlite://"):
        parser.error(f"{args.store} lives and dies with one process: the demo needs a store that survives it")

    def say(line: str) -> None:
        print(line, flush=True)

    with tempfile.TemporaryDirectory(prefix="sagaguard-demo-") as tmp, CounterService() as service:
        store_url = args.store or f"sqlite:///{tmp}/sagaguard.db"
        suffix = os.urandom(3).hex()  # fresh orders, so a reused --store starts clean
        guarded = _Story("sagaguard", f"order-{suffix}-a")
        naive = _Story("naive retry", f"order-{suffix}-b")
        say("sagaguard demo: a job charges a card and is killed (SIGKILL) right after the charge,")
        say("before it can record the result; a supervisor restarts it until it finishes.")
        say(f"  service: {service.url} (its own process; counts every charge)")
        say(f"  store:   {store_url}  (lease {LEASE} s for the demo)")
        say("")
        base = {"service": service.url, "store": store_url}
        say(f"With sagaguard ({guarded.order}: a guarded effect with a reconciler):")
        _supervise(guarded, {**base, "kind": "guarded", "order": guarded.order}, say)
        say(f"  [sagaguard] store record: {_record_line(store_url, guarded.order)}")
        say("")
        say(f"With a naive retry ({naive.order}: the same call, unguarded):")
        _supervise(naive, {**base, "kind": "naive", "order": naive.order}, say)
        guarded.charges = service.count(guarded.order)
        naive.charges = service.count(naive.order)

    say("")
    rows = ("run 1", "restart", "service saw")
    width = 3 + max(len(guarded.label), *(len(_cell(guarded, row)) for row in rows))
    say(f"  {'':<13}{guarded.label:<{width}}{naive.label}")
    for row in rows:
        say(f"  {row:<13}{_cell(guarded, row):<{width}}{_cell(naive, row)}")
    say("")
    problems = _check(guarded, naive)
    if problems:
        for problem in problems:
            say(f"UNEXPECTED: {problem}")
        return 1
    say(f"OK: sagaguard charged once and returned the original charge ({guarded.final});")
    say("    the naive retry charged twice.")
    return 0


def _check(guarded: _Story, naive: _Story) -> list[str]:
    problems = []
    for story in (guarded, naive):
        if not story.runs or not story.runs[0].killed:
            problems.append(f"{story.label}: the first run was not killed after the charge")
    if guarded.charges != 1:
        problems.append(f"sagaguard: the service saw {guarded.charges} charges, expected 1")
    if guarded.final is None or guarded.final != guarded.first:
        problems.append(f"sagaguard: returned {guarded.final}, expected the first charge {guarded.first}")
    if naive.charges != 2:
        problems.append(f"naive retry: the service saw {naive.charges} charges, expected 2")
    return problems


if __name__ == "__main__":
    sys.exit(main())
