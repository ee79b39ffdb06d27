"""The HTTP connector (connectors/http.py): httpx, sync and async, against a local server that
honours the IETF ``Idempotency-Key`` header (``sagaguard.connectors.testing.LocalIdempotentApi``).

The server runs in its own process and counts what it applied; ``POST /status/{code}`` answers that
status without applying anything, for the error mapping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tenacity
from conftest import FakeClock, closed_port

from sagaguard.connectors.errors import (
    ProviderBusy,
    ProviderKeyConflict,
    ProviderRejected,
    ProviderUnavailable,
    ProviderUnreachable,
    classify,
)
from sagaguard.connectors.http import (
    AsyncIdempotentHttp,
    HttpResult,
    IdempotentHttp,
    header_value,
    map_response,
    map_transport_error,
)
from sagaguard.connectors.testing import LocalIdempotentApi
from sagaguard.idempotency import (
    ConfigurationError,
    Disposition,
    Guard,
    KeyConflict,
    MemoryStore,
    OutcomeUnknown,
    Retry,
    State,
    scope,
)
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.store import IdempotencyStore

LEASE = 30.0
FAST = Retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_none())

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def api() -> Iterator[LocalIdempotentApi]:
    with LocalIdempotentApi() as running:
        yield running


@pytest.fixture(autouse=True)
def fresh(api: LocalIdempotentApi) -> None:
    api.reset()


@pytest.fixture
def memory(clock: FakeClock) -> MemoryStore:
    return MemoryStore(clock=clock)


def http(
    api: LocalIdempotentApi, store: IdempotencyStore, *, timeout: float = 5.0, **options: Any
) -> IdempotentHttp:
    guard = Guard(store, lease=LEASE, sleep=options.pop("sleep", lambda s: None))
    options.setdefault("retry", FAST)
    return IdempotentHttp(guard, httpx.Client(base_url=api.url, timeout=timeout), **options)


def key_of(
    scope_id: str, name: str = "http.post", *, ledger: IdempotencyStore | None = None
) -> EffectIdentity:
    """The identity of a call made in ``scope_id``, in ``ledger`` (its provider key needs it)."""
    return EffectIdentity.of("default", scope_id, name, 0, "" if ledger is None else ledger.ledger_id())


def test_a_write_is_applied_once_and_a_rerun_replays(
    api: LocalIdempotentApi, store: IdempotencyStore
) -> None:
    client = http(api, store)
    with scope("order-1"):
        first = client.post("/orders", json={"sku": "A", "qty": 1}, name="shop.order")
    with scope("order-1"):
        again = client.post("/orders", json={"sku": "A", "qty": 1}, name="shop.order")

    assert again == first and first.status_code == 201
    assert first.json()["key"] == key_of("order-1", "shop.order", ledger=store).provider_key
    assert api.counters()["applied"] == 1 and api.counters()["requests"] == 1


def test_the_header_is_a_structured_field_string() -> None:
    assert header_value("sg1p_abc") == '"sg1p_abc"'
    assert header_value('a"b\\c') == '"a\\"b\\\\c"'


def test_headers_are_not_fingerprinted_and_cookies_not_recorded(
    api: LocalIdempotentApi, memory: MemoryStore
) -> None:
    client = http(api, memory)
    with scope("order-2"):
        first = client.post("/orders", json={}, headers={"Authorization": "Bearer old"})
    with scope("order-2"):  # the token rotated between the crash and the resume: still a replay
        assert client.post("/orders", json={}, headers={"Authorization": "Bearer new"}) == first
    assert "set-cookie" not in first.headers and first.headers["location"].startswith("/resources/")


def test_a_timeout_after_the_server_applied_is_resent_under_the_same_key(
    api: LocalIdempotentApi, memory: MemoryStore
) -> None:
    client = http(api, memory, timeout=0.3)
    api.fault("timeout", "/orders", method="POST", seconds=1.0)
    with scope("order-3"):
        result = client.post("/orders", json={"sku": "B"})
    assert result.status_code == 201
    assert (api.counters()["applied"], api.counters()["replays"]) == (1, 1)


def test_409_means_in_progress_and_is_retried_until_the_first_answer(
    api: LocalIdempotentApi, memory: MemoryStore
) -> None:
    retry = Retry(stop=tenacity.stop_after_attempt(20), wait=tenacity.wait_fixed(0.1))
    guard = Guard(memory, lease=LEASE)
    client = IdempotentHttp(guard, httpx.Client(base_url=api.url, timeout=0.3), retry=retry)
    api.fault("slow", "/orders", method="POST", seconds=1.0)
    with scope("order-4"):
        result = client.post("/orders", json={"sku": "C"})
    counters = api.counters()
    assert result.status_code == 201
    assert counters["in_use"] >= 1 and counters["applied"] == 1 and counters["replays"] == 1


def test_409_past_the_budget_is_provider_busy_and_releases_the_key(
    api: LocalIdempotentApi, memory: MemoryStore
) -> None:
    with scope("order-5"), pytest.raises(ProviderBusy):
        http(api, memory).post("/status/409", json={})
    assert memory.get(key_of("order-5").key) is None


def test_422_is_a_key_conflict(api: LocalIdempotentApi, memory: MemoryStore) -> None:
    provider_key = key_of("order-6", ledger=memory).provider_key
    httpx.post(
        api.url + "/orders", json={"other": True}, headers={"Idempotency-Key": header_value(provider_key)}
    )
    with scope("order-6"), pytest.raises(ProviderKeyConflict) as conflict:
        http(api, memory).post("/orders", json={"mine": True})
    assert isinstance(conflict.value, KeyConflict) and conflict.value.status == 422
    assert api.counters()["conflicts"] == 1 and api.counters()["applied"] == 1


def test_a_client_error_is_not_applied_recorded_and_replayed(
    api: LocalIdempotentApi, memory: MemoryStore
) -> None:
    client = http(api, memory)
    with scope("order-7"), pytest.raises(ProviderRejected) as rejected:
        client.post("/status/400", json={})
    assert rejected.value.status == 400 and not rejected.value.retryable
    with scope("order-7"), pytest.raises(ProviderRejected):
        client.post("/status/400", json={})
    assert api.counters()["requests"] == 1
    record = memory.get(key_of("order-7").key)
    assert record is not None and record.state is State.FAILED


def test_a_5xx_is_ambiguous_and_resent_under_the_same_key(
    api: LocalIdempotentApi, memory: MemoryStore
) -> None:
    api.fault("fail", "/orders", method="POST", status=503)
    with scope("order-8"):
        assert http(api, memory).post("/orders", json={}).status_code == 201
    assert api.counters()["applied"] == 1


def test_without_server_dedup_an_ambiguous_call_is_in_doubt(
    api: LocalIdempotentApi, memory: MemoryStore
) -> None:
    client = http(api, memory, timeout=0.3, server_dedups=False)
    api.fault("timeout", "/orders", method="POST", seconds=1.0)
    with scope("order-9"), pytest.raises(OutcomeUnknown) as doubt:
        client.post("/orders", json={})
    assert isinstance(doubt.value.__cause__, ProviderUnavailable)
    with scope("order-9"), pytest.raises(OutcomeUnknown):
        client.post("/orders", json={})
    assert api.counters()["applied"] == 1 and api.counters()["requests"] == 1


def test_a_connect_error_is_not_applied(memory: MemoryStore) -> None:
    guard = Guard(memory, lease=LEASE, sleep=lambda s: None)
    client = IdempotentHttp(guard, httpx.Client(base_url=f"http://127.0.0.1:{closed_port()}"), retry=FAST)
    with scope("order-10"), pytest.raises(ProviderUnreachable):
        client.post("/orders", json={})
    assert memory.get(key_of("order-10").key) is None


def test_a_bad_url_fails_before_anything_is_claimed(memory: MemoryStore) -> None:
    client = IdempotentHttp(Guard(memory), httpx.Client())
    with scope("order-11"), pytest.raises(ConfigurationError, match="scheme"):
        client.post("ftp://example.com/x", json={})
    assert memory.get(key_of("order-11").key) is None


def test_async_writes_are_applied_once_and_resent_after_a_timeout(
    api: LocalIdempotentApi, memory: MemoryStore
) -> None:
    async def scenario() -> tuple[HttpResult, HttpResult, HttpResult]:
        guard = Guard(memory, lease=LEASE, async_sleep=_no_sleep)
        async with httpx.AsyncClient(base_url=api.url, timeout=0.3) as raw:
            client = AsyncIdempotentHttp(guard, raw, retry=FAST)
            with scope("order-12"):
                first = await client.put("/orders/12", json={"qty": 2})
            with scope("order-12"):
                again = await client.put("/orders/12", json={"qty": 2})
            api.fault("timeout", "/orders/13", method="POST", seconds=1.0)
            with scope("order-13"):
                resent = await client.post("/orders/13", json={})
        return first, again, resent

    first, again, resent = asyncio.run(scenario())
    assert first == again and first.status_code == 201 and resent.status_code == 201
    assert api.counters()["applied"] == 2 and api.counters()["replays"] == 1


async def _no_sleep(seconds: float) -> None:
    return None


def _response(status: int) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("POST", "http://x/y"), text="{}")


@pytest.mark.parametrize(
    ("status", "expected", "disposition"),
    [
        (400, ProviderRejected, Disposition.PERMANENT),
        (401, ProviderRejected, Disposition.RETRYABLE),
        (404, ProviderRejected, Disposition.PERMANENT),
        (408, ProviderRejected, Disposition.RETRYABLE),
        (409, ProviderBusy, Disposition.RETRYABLE),
        (422, ProviderKeyConflict, Disposition.PERMANENT),
        (429, ProviderRejected, Disposition.RETRYABLE),
        (500, ProviderUnavailable, Disposition.AMBIGUOUS),
        (502, ProviderUnavailable, Disposition.AMBIGUOUS),
    ],
)
def test_response_mapping(status: int, expected: type[Exception], disposition: Disposition) -> None:
    with pytest.raises(expected) as raised:
        map_response(_response(status), "sg1p_k")
    assert classify(raised.value) is disposition
    assert type(raised.value)(*raised.value.args).args == raised.value.args


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (httpx.ConnectError("refused"), ProviderUnreachable),
        (httpx.ConnectTimeout("slow"), ProviderUnreachable),
        (httpx.PoolTimeout("busy"), ProviderUnreachable),
        (httpx.ReadTimeout("slow"), ProviderUnavailable),
        (httpx.WriteTimeout("slow"), ProviderUnavailable),
        (httpx.RemoteProtocolError("closed"), ProviderUnavailable),
        (httpx.ReadError("reset"), ProviderUnavailable),
    ],
)
def test_transport_error_mapping(exc: httpx.HTTPError, expected: type[Exception]) -> None:
    assert type(map_transport_error(exc)) is expected


def test_2xx_and_3xx_are_results() -> None:
    assert map_response(_response(200)).status_code == 200
    assert map_response(_response(303)).status_code == 303


def test_public_api_is_locked() -> None:
    """The connectors' public names: a change here is a change of the public API."""
    import sagaguard.connectors
    import sagaguard.connectors.declare
    import sagaguard.connectors.email
    import sagaguard.connectors.http
    import sagaguard.connectors.in_doubt
    import sagaguard.connectors.llm
    import sagaguard.connectors.stripe
    import sagaguard.connectors.testing

    expected = {
        sagaguard.connectors: """ConnectorError Pending ProviderBusy ProviderKeyConflict ProviderRejected
            ProviderUnavailable ProviderUnreachable ReturnPending Stop ToolDeclaration WaitForOperator
            changes_world classify read_only replayable""",
        sagaguard.connectors.declare: """ToolDeclaration changes_world declaration_of is_step kind_options
            read_only recorded_output tool_options""",
        sagaguard.connectors.in_doubt: "OnDoubt Pending ReturnPending Stop WaitForOperator asettle settle",
        sagaguard.connectors.stripe: """CHARGE KEY_WINDOW METADATA_KEY MetadataRefused Payment
            PaymentActionRequired Refund StripeEffects map_error refund_compensation""",
        sagaguard.connectors.email: "SEND Email EmailEffects Sent SmtpSettings map_smtp_error message_id_for",
        sagaguard.connectors.http: """HEADER AsyncIdempotentHttp HttpResult IdempotentHttp header_value
        map_response
            map_transport_error""",
        sagaguard.connectors.llm: """AsyncChatJournal ChatJournal LlmUsage METADATA_KEY journal_model
            map_error usage_of""",
        sagaguard.connectors.testing: """CRASH_ENV CrashingStore FaultRule LocalChatModel LocalIdempotentApi
            LocalService LocalStripe crash_point sigkill""",
    }
    for module, names in expected.items():
        assert sorted(module.__all__) == sorted(names.split()), module.__name__
        for name in names.split():
            assert hasattr(module, name), f"{module.__name__}.{name}"
