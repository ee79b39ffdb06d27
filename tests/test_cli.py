"""The operator CLI (idempotency/cli.py) against a SQLite file store.

Records are made through the store and the guard, then ``main([...])`` runs in this process with its
output captured. Times are the database's own clock (the CLI opens the store like an operator would);
records that must look old are written through a second store instance whose clock is in the past.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from sagaguard.idempotency import Guard, OutcomeUnknown, cli, open_store, scope
from sagaguard.idempotency.cli import main
from sagaguard.idempotency.errors import LostOwnership
from sagaguard.idempotency.keys import EffectIdentity, fingerprint
from sagaguard.idempotency.records import Disposition, State
from sagaguard.idempotency.store import IdempotencyStore

HOUR = 3600.0
DAY = 24 * HOUR


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A SQLite file store URL, also set as ``$SAGAGUARD_STORE``; the file exists."""
    found = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("SAGAGUARD_STORE", found)
    open_store(found).close()
    return found


@pytest.fixture
def store(url: str) -> Iterator[IdempotencyStore]:
    opened = open_store(url)
    yield opened
    opened.close()


def past_store(url: str, ago: float) -> IdempotencyStore:
    """Another instance on the same data whose clock runs ``ago`` seconds behind."""
    return open_store(url, clock=lambda: time.time() - ago)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def make_ledger(store: IdempotencyStore) -> dict[str, str]:
    """One succeeded, one in-doubt (ambiguous error) and one failed effect, made by the guard."""
    guard = Guard(store, wait=0)

    class Declined(Exception):
        pass

    @guard.effect("stripe.charge", permanent=(Declined,))
    def charge(amount: int) -> dict[str, int]:
        if amount == 2:
            raise TimeoutError("read timed out")
        if amount == 3:
            raise Declined("card declined")
        return {"amount": amount}

    with scope("order-42"):
        assert charge(1) == {"amount": 1}
        with pytest.raises(OutcomeUnknown):
            charge(2)
        with pytest.raises(Declined):
            charge(3)
    guard.close()
    keys = {r.state.value: r.key for r in store.list()}
    assert set(keys) == {"succeeded", "in_doubt", "failed"}
    return keys


def claim(store: IdempotencyStore, scope_id: str, name: str = "email.send", lease: float = 60.0) -> str:
    identity = EffectIdentity.of("default", scope_id, name, 0)
    store.claim(identity, fingerprint({"to": "a@example.com"}), lease)
    return identity.key


# ------------------------------------------------------------------------------------ list


def test_list_table_puts_in_doubt_first(store: IdempotencyStore, capsys: pytest.CaptureFixture[str]) -> None:
    keys = make_ledger(store)
    live = claim(store, "order-43")
    code, out, err = run(capsys, "effects", "list")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == [
        "KEY",
        "NAME",
        "SCOPE",
        "ORD",
        "STATE",
        "TOKEN",
        "ATT",
        "AGE",
        "LEASE",
        "LEFT",
    ]
    states = [line.split()[4] for line in lines[1:]]
    assert states == ["in_doubt", "in_progress", "failed", "succeeded"]
    # Keys are shortened to a prefix that show/resolve accept.
    assert lines[1].split()[0] == keys["in_doubt"][:16]
    assert keys["in_doubt"] not in out
    assert lines[2].split()[0] == live[:16]
    assert "order-42" in out and "stripe.charge" in out
    assert lines[2].split()[-1].endswith("s")  # lease left on the live claim, e.g. "59s"


def test_list_table_shows_wide_tokens_whole_and_aligned(
    store: IdempotencyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    # A fresh claim starts at a random token of up to 15 digits: printed in full, in its column.
    make_ledger(store)
    claim(store, "order-43")
    tokens = {r.key[:16]: str(r.token) for r in store.list()}
    assert max(len(t) for t in tokens.values()) > len("TOKEN")  # wide, with overwhelming odds
    code, out, err = run(capsys, "effects", "list")
    assert code == 0, err
    header, *rows = out.splitlines()
    column = header.index("TOKEN")
    assert len(rows) == len(tokens)
    for row in rows:
        assert row.split()[5] == tokens[row.split()[0]]
        assert row[column:].split()[0] == tokens[row.split()[0]]  # starts under the header
    assert header.index("ATT") > column + max(len(t) for t in tokens.values())


def test_list_json_is_full_records(store: IdempotencyStore, capsys: pytest.CaptureFixture[str]) -> None:
    keys = make_ledger(store)
    code, out, _ = run(capsys, "effects", "list", "--json")
    assert code == 0
    data = json.loads(out)
    assert [d["state"] for d in data] == ["in_doubt", "failed", "succeeded"]
    by_state = {d["state"]: d for d in data}
    assert by_state["succeeded"]["key"] == keys["succeeded"]
    assert by_state["succeeded"]["result"] == {"amount": 1}
    assert by_state["in_doubt"]["error"]["type"] == "builtins.TimeoutError"
    assert by_state["succeeded"]["created_at"].endswith("Z")
    assert by_state["succeeded"]["expires_at"].endswith("Z")
    assert set(by_state["failed"]) >= {
        "key", "namespace", "scope", "name", "ordinal", "fingerprint", "state", "token",
        "lease_until", "attempts", "created_at", "updated_at", "expires_at", "result", "error",
    }  # fmt: skip


def test_list_filters_and_limits(store: IdempotencyStore, capsys: pytest.CaptureFixture[str]) -> None:
    make_ledger(store)
    claim(store, "order-43")
    code, out, _ = run(capsys, "effects", "list", "--state", "succeeded", "--state", "failed", "--json")
    assert code == 0
    assert [d["state"] for d in json.loads(out)] == ["failed", "succeeded"]

    code, out, _ = run(capsys, "effects", "list", "--limit", "2", "--json")
    assert [d["state"] for d in json.loads(out)] == ["in_doubt", "in_progress"]

    code, out, _ = run(capsys, "effects", "list", "--namespace", "someone-else")
    assert code == 0
    assert "no effect records" in out


def test_list_orders_in_doubt_oldest_first(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    for scope_id, ago in (("young", 60.0), ("old", DAY), ("middle", HOUR)):
        older = past_store(url, ago)
        key = claim(older, scope_id)
        record = older.get(key)
        assert record is not None
        older.fail(key, record.token, Disposition.AMBIGUOUS, "{}", DAY)
        older.close()
    code, out, _ = run(capsys, "effects", "list", "--json")
    assert code == 0
    assert [d["scope"] for d in json.loads(out)] == ["old", "middle", "young"]


# ------------------------------------------------------------------------------------ show


def test_show_by_full_key_and_prefix(store: IdempotencyStore, capsys: pytest.CaptureFixture[str]) -> None:
    keys = make_ledger(store)
    code, out, _ = run(capsys, "effects", "show", keys["in_doubt"])
    assert code == 0
    assert keys["in_doubt"] in out
    assert "in_doubt" in out and "TimeoutError" in out
    assert "effects resolve" in out  # tells the operator what to do next

    code, out, _ = run(capsys, "effects", "show", keys["succeeded"][:12], "--json")
    assert code == 0
    assert json.loads(out)["key"] == keys["succeeded"]


def test_show_missing_key_exits_1(store: IdempotencyStore, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "effects", "show", "sg1_" + "0" * 64)
    assert code == 1
    assert out == ""
    assert "no effect record" in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


# --------------------------------------------------------------------------------- resolve


def test_resolve_applied_records_success_and_the_guard_replays_it(
    store: IdempotencyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = make_ledger(store)
    code, out, err = run(
        capsys, "effects", "resolve", keys["in_doubt"][:16], "--applied", "--result", '{"amount": 2}'
    )
    assert code == 0, err
    assert "applied" in out
    record = store.get(keys["in_doubt"])
    assert record is not None
    assert record.state is State.SUCCEEDED
    assert json.loads(record.result or "") == {"amount": 2}

    # The next run of the same code replays the operator's result instead of charging again.
    guard = Guard(store)
    calls: list[int] = []

    @guard.effect("stripe.charge")
    def charge(amount: int) -> dict[str, int]:
        calls.append(amount)
        return {"amount": amount}

    with scope("order-42"):
        charge(1)
        assert charge(2) == {"amount": 2}
    guard.close()
    assert calls == []


def test_resolve_not_applied_removes_the_record_so_the_next_run_executes(
    store: IdempotencyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = make_ledger(store)
    code, out, err = run(capsys, "effects", "resolve", keys["in_doubt"], "--not-applied")
    assert code == 0, err
    assert "not applied" in out
    assert store.get(keys["in_doubt"]) is None

    guard = Guard(store)
    calls: list[int] = []

    @guard.effect("stripe.charge")
    def charge(amount: int) -> dict[str, int]:
        calls.append(amount)
        return {"amount": amount * 10}

    with scope("order-42"):
        charge(1)
        assert charge(2) == {"amount": 20}
    guard.close()
    assert calls == [2]


def test_resolve_refuses_a_live_lease_unless_forced(
    store: IdempotencyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    key = claim(store, "order-50", lease=600.0)
    code, out, err = run(capsys, "effects", "resolve", key, "--not-applied")
    assert out == ""
    assert code == 1
    assert "lease" in err and "--force" in err
    record = store.get(key)
    assert record is not None and record.state is State.IN_PROGRESS

    code, _, err = run(capsys, "effects", "resolve", key, "--applied", "--result", "7", "--force")
    assert code == 0, err
    record = store.get(key)
    assert record is not None and record.state is State.SUCCEEDED and record.result == "7"


def test_resolve_not_applied_leaves_the_removed_holder_fenced(
    store: IdempotencyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--not-applied --force`` deletes a live claim; its worker, still running, must not then
    write over the record that the next run claims afresh."""
    key = claim(store, "order-52", lease=600.0)
    zombie = store.get(key)
    assert zombie is not None
    code, _, err = run(capsys, "effects", "resolve", key, "--not-applied", "--force")
    assert code == 0, err
    assert store.get(key) is None

    identity = EffectIdentity(zombie.namespace, zombie.scope, zombie.name, zombie.ordinal, key)
    fresh = store.claim(identity, zombie.fingerprint, 60.0).record
    assert fresh.token != zombie.token
    with pytest.raises(LostOwnership):
        store.complete(key, zombie.token, '"late"', DAY)
    with pytest.raises(LostOwnership):
        store.heartbeat(key, zombie.token, 60.0)
    with pytest.raises(LostOwnership):
        store.fail(key, zombie.token, Disposition.RETRYABLE, "{}", DAY)
    after = store.get(key)
    assert after is not None
    assert (after.state, after.token, after.result) == (State.IN_PROGRESS, fresh.token, None)


def test_resolve_in_progress_with_expired_lease(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    crashed = past_store(url, HOUR)
    key = claim(crashed, "order-51", lease=60.0)
    crashed.close()
    code, _, err = run(capsys, "effects", "resolve", key, "--not-applied")
    assert code == 0, err
    after = open_store(url)
    try:
        assert after.get(key) is None
    finally:
        after.close()


def test_resolve_refuses_finished_records(
    store: IdempotencyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = make_ledger(store)
    for state in ("succeeded", "failed"):
        code, _, err = run(capsys, "effects", "resolve", keys[state], "--not-applied")
        assert code == 1
        assert f"already {state}" in err
        record = store.get(keys[state])
        assert record is not None and record.state.value == state


@pytest.mark.parametrize("bad", ['{"amount": 2', "NaN", "not json"])
def test_resolve_rejects_bad_result_json(
    store: IdempotencyStore, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    keys = make_ledger(store)
    code, _, err = run(capsys, "effects", "resolve", keys["in_doubt"], "--applied", "--result", bad)
    assert code == 2
    assert "--result is not valid JSON" in err
    assert "Traceback" not in err
    record = store.get(keys["in_doubt"])
    assert record is not None and record.state is State.IN_DOUBT


def test_resolve_needs_a_verdict(store: IdempotencyStore, capsys: pytest.CaptureFixture[str]) -> None:
    keys = make_ledger(store)
    code, _, err = run(capsys, "effects", "resolve", keys["in_doubt"])
    assert code == 2
    assert "--applied" in err


def test_resolve_reports_lost_ownership(
    store: IdempotencyStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another worker takes the record over between the CLI's read and its write."""
    keys = make_ledger(store)
    before = store.get(keys["in_doubt"])
    assert before is not None
    from sagaguard.idempotency import effects_cli

    real_open = effects_cli._open

    def open_and_race(url: str) -> IdempotencyStore:
        opened = real_open(url)
        real_get = opened.get

        def get_then_take_over(key: str) -> object:
            record = real_get(key)
            if record is not None:
                # The takeover: the guard's next run claims the in-doubt record under token + 1.
                identity = EffectIdentity(record.namespace, record.scope, record.name, record.ordinal, key)
                store.claim(identity, record.fingerprint, 60.0)
            return record

        monkeypatch.setattr(opened, "get", get_then_take_over)
        return opened

    monkeypatch.setattr(effects_cli, "_open", open_and_race)
    code, _, err = run(capsys, "effects", "resolve", keys["in_doubt"], "--not-applied", "--force")
    assert code == 1
    assert "another worker took it over" in err
    assert "Traceback" not in err
    record = store.get(keys["in_doubt"])
    assert record is not None and record.token == before.token + 1


# ----------------------------------------------------------------------------------- purge


def test_purge_loops_pages_until_done(
    url: str, store: IdempotencyStore, capsys: pytest.CaptureFixture[str]
) -> None:
    def token(on: IdempotencyStore, key: str) -> int:
        record = on.get(key)
        assert record is not None
        return record.token

    old = past_store(url, 10 * DAY)
    for i in range(7):
        key = claim(old, f"old-{i}")
        old.complete(key, token(old, key), "null", DAY)
    old.close()
    fresh = claim(store, "fresh")
    store.complete(fresh, token(store, fresh), "null", DAY)
    in_doubt = claim(store, "doubt")
    store.fail(in_doubt, token(store, in_doubt), Disposition.AMBIGUOUS, "{}", DAY)

    code, out, err = run(capsys, "effects", "purge", "--page", "3")
    assert code == 0, err
    assert "page 1: purged 3 (total 3)" in out
    assert "page 3: purged 1 (total 7)" in out
    assert out.strip().splitlines()[-1] == "purged 7 expired records"
    remaining = {r.scope for r in store.list()}
    assert remaining == {"fresh", "doubt"}

    code, out, _ = run(capsys, "effects", "purge")
    assert code == 0
    assert out.strip() == "purged 0 expired records"


# --------------------------------------------------------------------------- store and usage


def test_unknown_store_scheme_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--store", "mongodb://localhost/x", "effects", "list")
    assert code == 2
    assert out == ""
    assert "unknown store URL scheme" in err
    assert len(err.strip().splitlines()) == 1


def test_store_option_after_the_command(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAGAGUARD_STORE", "mongodb://nowhere")
    code, out, err = run(capsys, "effects", "list", "--store", url)
    assert code == 0, err
    assert "no effect records" in out


def test_missing_sqlite_file_is_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "typo.db"
    code, _, err = run(capsys, "--store", f"sqlite:///{missing}", "effects", "list")
    assert code == 1
    assert "does not exist" in err
    assert not missing.exists()


def test_unreachable_store_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, _, err = run(capsys, "--store", f"postgresql://postgres@127.0.0.1:{port}/x", "effects", "list")
    assert code == 1
    assert err.startswith("sagaguard: ")
    assert "Traceback" not in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "effects", "list", "--state", "bogus")[0] == 2
    assert run(capsys, "effects", "list", "--limit", "0")[0] == 2
    assert run(capsys, "effects")[0] == 2
    assert run(capsys, "nonsense")[0] == 2
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "effects" in out


def test_demo_gets_its_arguments_untouched(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("sagaguard.connectors.demo.small")

    def fake_main(argv: list[str] | None = None) -> int:
        seen.append(list(argv or []))
        return 3

    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sagaguard.connectors.demo.small", fake)
    assert main(["demo", "--small", "--help", "--crash-at", "charge"]) == 3
    assert main(["--store", "memory://", "demo", "-v"]) == 3
    assert main(["--store=memory://", "demo", "--store", "redis://x"]) == 3
    assert seen == [
        ["--help", "--crash-at", "charge"],
        ["--store", "memory://", "-v"],
        ["--store", "redis://x"],
    ]


def test_demo_runs_the_trip_demo_found_by_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain `sagaguard demo` is the full trip-booking demo of connectors/, found through the
    `sagaguard.demo` entry point (idempotency never imports connectors)."""

    seen: list[list[str]] = []

    class Entry:
        name = "trips"

        @staticmethod
        def load() -> object:
            return lambda argv: seen.append(list(argv)) or 5

    monkeypatch.setattr(cli, "entry_points", lambda group: [Entry()] if group == cli.DEMO_GROUP else [])
    assert main(["demo", "--trace", "t.jsonl"]) == 5
    assert seen == [["--trace", "t.jsonl"]]


def test_python_dash_m_idempotency(url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sagaguard.idempotency", "--store", url, "effects", "list", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_plugin_commands_are_found_through_entry_points(capsys: pytest.CaptureFixture[str]) -> None:
    """`sagaguard sagas` and `sagaguard llm` come from the packages above idempotency, found by the
    entry-point group, so idempotency never imports them."""
    from sagaguard.idempotency.cli import main

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "sagas" in text and "llm" in text
    import ast
    import pathlib

    source = (pathlib.Path(__file__).resolve().parents[1] / "idempotency" / "cli.py").read_text()
    imported = {
        node.module or "" for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
    } | {
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert not any(name.startswith(("sagaguard.saga", "sagaguard.connectors")) for name in imported)


def test_outbox_commands_are_wired(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`sagaguard outbox` and `sagaguard relay` reach sagaguard.idempotency.outbox.cli through the entry
    point."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    assert main(["outbox", "migrate", "--db", url]) == 0
    assert main(["outbox", "status", "--db", url]) == 0
    assert "relay" in run(capsys, "--help")[1]


# ------------------------------------------------------------------------- completion and exits


def test_shell_completion_is_clicks(url: str) -> None:
    """`_SAGAGUARD_COMPLETE=bash_source sagaguard` prints the script the docs tell users to eval,
    and the completion it drives knows the commands of every package and the choices of options."""
    from click.testing import CliRunner

    from sagaguard.idempotency.cli import cli

    runner = CliRunner()
    script = runner.invoke(cli, [], prog_name="sagaguard", env={"_SAGAGUARD_COMPLETE": "bash_source"})
    assert script.exit_code == 0 and "_SAGAGUARD_COMPLETE=bash_complete" in script.output

    def complete(words: str) -> list[str]:
        env = {
            "_SAGAGUARD_COMPLETE": "bash_complete",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split(" ")) - 1),
        }
        done = runner.invoke(cli, [], prog_name="sagaguard", env=env)
        return [line.split(",", 1)[1] for line in done.output.splitlines()]

    assert {"audit", "db", "demo", "effects"} <= set(complete("sagaguard "))
    assert "effects" in complete("sagaguard eff")
    assert "sagas" in complete("sagaguard sag")  # found through its entry point
    assert complete("sagaguard effects list --state in_d") == ["in_doubt"]


def test_an_interrupt_exits_130_in_one_line(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sagaguard.idempotency import effects_cli

    def interrupted(url: str) -> IdempotencyStore:
        raise KeyboardInterrupt

    monkeypatch.setattr(effects_cli, "_open", interrupted)
    code, _, err = run(capsys, "effects", "list")
    assert code == 130 and err == "sagaguard: interrupted\n"
