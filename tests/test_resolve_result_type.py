"""An operator's ``--result`` is checked against the result type the record names.

Every guarded claim records its effect's declared result type (``Record.result_type``); resolving
a record as applied decodes the given result with that type's codec first, so a result every
replay would fail to read (``CodecError``) is refused with the expected shape and the record is
left as it was, through the operator API, the CLI (exit 2) and the console (400). Each case is
an effect declared with a connector's own result type (what its ``guard.operation`` passes), left
in doubt by a real ambiguous error on a SQLite ledger, then resolved and replayed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock
from openai.types.chat import ChatCompletion

from sagaguard.connectors.email import Sent
from sagaguard.connectors.http import HttpResult
from sagaguard.connectors.stripe import Payment
from sagaguard.idempotency import Guard, OutcomeUnknown, open_store, scope
from sagaguard.idempotency.cli import main
from sagaguard.idempotency.codec import Codec, type_name
from sagaguard.idempotency.errors import CodecError
from sagaguard.idempotency.keys import EffectIdentity, fingerprint
from sagaguard.idempotency.operator import ResultMismatch, ResultTypeUnavailable, resolve_effect
from sagaguard.idempotency.records import Record, State
from sagaguard.idempotency.store import IdempotencyStore

PAYMENT = {
    "id": "pi_1", "amount": 4200, "currency": "eur", "status": "succeeded", "amount_received": 4200,
    "amount_capturable": 0, "customer": "cus_1", "latest_charge": "ch_1", "effect_key": None,
}  # fmt: skip
CHAT = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}],
}  # fmt: skip

CASES: dict[str, tuple[str, Any, Any, Any]] = {
    # case: (effect name, declared type, a wrong result, the right one)
    "stripe": ("stripe.charge", Payment, {"charge_id": "ch_1", "amount": 4200}, PAYMENT),
    "email": ("email.send", Sent, {"id": "m1"}, {"message_id": "<m1@example.com>", "accepted": ["a@x.org"]}),
    "http": ("http.post", HttpResult, {"status": 201}, {"status_code": 201, "text": "ok"}),
    "llm": ("llm.chat", ChatCompletion, {"content": "hi"}, CHAT),
    "user dict": ("stripe.charge", dict[str, Any], [4200], {"charge_id": "ch_1", "amount": 4200}),
}


def in_doubt(store: IdempotencyStore, name: str, result_type: Any) -> tuple[Any, Record]:
    """An effect declared as ``result_type``, left in doubt by a timeout; its operation and record."""
    guard = Guard(store, wait=0)
    calls: list[int] = []

    def effect() -> Any:
        calls.append(1)
        raise TimeoutError("read timed out")

    operation = guard.operation(name, result_type=result_type)
    with scope("order-1"), pytest.raises(OutcomeUnknown):
        operation.run(effect, arguments={"amount": 4200})
    (record,) = store.list()
    assert record.state is State.IN_DOUBT and calls == [1]
    return operation, record


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_shape_is_refused_and_the_right_one_replayed(case: str, tmp_path: Path) -> None:
    name, declared, wrong, right = CASES[case]
    store = open_store(f"sqlite:///{tmp_path}/ledger.db")
    operation, record = in_doubt(store, name, declared)
    assert record.result_type == type_name(declared) is not None

    with pytest.raises(
        ResultMismatch, match=rf"not a {record.result_type}.*expected JSON of this shape: \{{"
    ) as refused:
        resolve_effect(store, record.key, applied=True, result=json.dumps(wrong), actor="ana")
    assert not isinstance(refused.value, CodecError)  # the operator's refusal, not a replay's failure
    assert store.get(record.key) == record  # untouched: still in doubt, same token

    resolve_effect(store, record.key, applied=True, result=json.dumps(right), actor="ana")
    with scope("order-1"):  # the next run replays the operator's result as the declared type
        replayed = operation.run(
            lambda: pytest.fail("an applied effect ran again"), arguments={"amount": 4200}
        )
    expected = Codec(declared).decode(json.dumps(right))
    assert replayed == expected and type(replayed) is type(expected)
    store.close()


def test_a_record_without_a_type_takes_any_json_as_before(tmp_path: Path) -> None:
    """Records written before types were recorded (and effects declaring ``Any``) keep today's
    behaviour: any JSON is accepted."""
    store = open_store(f"sqlite:///{tmp_path}/ledger.db")
    _, record = in_doubt(store, "stripe.charge", Any)
    assert record.result_type is None
    done = resolve_effect(store, record.key, applied=True, result="[1, 2]", actor="ana")
    assert done.state is State.SUCCEEDED and done.result == "[1,2]"
    store.close()


def test_a_type_that_cannot_be_imported_here_is_refused_clearly(clock: FakeClock) -> None:
    from sagaguard.idempotency.stores import MemoryStore

    store = MemoryStore(clock=clock)
    identity = dataclasses.replace(
        EffectIdentity.of("default", "order-1", "ship", 0), result_type="shop_gone.models.Parcel"
    )
    claimed = store.claim(identity, fingerprint({}), 30.0).record
    clock.advance(31)
    with pytest.raises(ResultTypeUnavailable, match=r"'shop_gone\.models\.Parcel' cannot be imported here"):
        resolve_effect(store, claimed.key, applied=True, result="{}", actor="ana")
    assert store.get(claimed.key) == claimed
    # Not applied needs no result, so no type: the operator can always send it to be run again.
    resolve_effect(store, claimed.key, applied=False, actor="ana")
    assert store.get(claimed.key) is None


def test_the_cli_refuses_a_wrong_shape_with_exit_2_and_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    store = open_store(url)
    _, record = in_doubt(store, "stripe.charge", Payment)
    assert main(["--store", url, "effects", "show", record.key[:16]]) == 0
    assert (
        "result type   sagaguard.connectors.stripe._objects.Payment (what --result" in capsys.readouterr().out
    )
    bad = ["effects", "resolve", record.key[:16], "--applied", "--result", '{"charge_id": "ch_1"}']
    assert main(["--store", url, *bad]) == 2
    err = capsys.readouterr().err
    assert "sagaguard.connectors.stripe._objects.Payment" in err and '"amount_received"' in err
    assert "Traceback" not in err and store.get(record.key) == record
    good = ["effects", "resolve", record.key[:16], "--applied", "--result", json.dumps(PAYMENT)]
    assert main(["--store", url, *good]) == 0
    assert store.get(record.key).state is State.SUCCEEDED  # type: ignore[union-attr]
    store.close()


def test_the_console_refuses_a_wrong_shape_with_a_400(clock: FakeClock) -> None:
    pytest.importorskip("starlette", reason="the console needs the ui extra")
    from starlette.testclient import TestClient

    from sagaguard.idempotency.audit import MemoryAudit
    from sagaguard.idempotency.stores import MemoryStore
    from sagaguard.saga import MemoryJournal
    from sagaguard.saga.console.app import create_app
    from sagaguard.saga.console.settings import ConsoleSettings

    store = MemoryStore(clock=clock)
    _, record = in_doubt(store, "email.send", Sent)
    token = "t0k3n-for-the-result-type-test"
    app = create_app(
        ConsoleSettings("memory://", token=token), store=store, journal=MemoryJournal(), audit=MemoryAudit()
    )
    client = TestClient(app, follow_redirects=False)
    headers = {"authorization": f"Bearer {token}", "accept": "application/json"}
    body = {"target": record.key, "verdict": "applied", "result": {"id": "m1"}}
    refused = client.post("/act/effect.resolve", json=body, headers=headers)
    assert refused.status_code == 400 and refused.json()["error"] == "ResultMismatch"
    assert "message_id" in refused.json()["message"] and store.get(record.key) == record
    body["result"] = {"message_id": "<m1@example.com>", "accepted": ["a@x.org"]}
    assert client.post("/act/effect.resolve", json=body, headers=headers).status_code == 200
