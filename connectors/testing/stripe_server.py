"""A local Stripe-compatible server for tests: the real ``stripe`` SDK talks to it over HTTP.

::

    with LocalStripe() as server:                      # its own process on 127.0.0.1
        client = stripe.StripeClient("sk_test_local", base_addresses={"api": server.url})
        server.fault("timeout", "/v1/payment_intents", method="POST", seconds=2)  # applied, no answer
        ...
        assert server.counters()["charges"] == 1

What it implements (the subset :mod:`sagaguard.connectors.stripe` uses): PaymentIntents (create, with
``confirm=true``; confirm; capture; cancel; retrieve; list; search), Refunds (create, retrieve,
list), with Stripe's idempotency semantics:

- the first response to a POST with an ``Idempotency-Key`` is stored once the endpoint started
  executing (card declines included, validation errors not) and replayed to every retry with the
  same key, with the header ``Idempotent-Replayed: true``;
- the same key with other parameters or another endpoint: 400 ``idempotency_error``;
- the same key while the first request still runs: 409 ``idempotency_key_in_use``, nothing stored;
- keys are forgotten ``key_ttl`` seconds (24 hours) after first use; advance the server's clock
  with :meth:`LocalService.advance_clock` to get past that window.

Test payment methods: ``pm_card_visa`` (and any other ``pm_...``) succeeds;
``pm_card_chargeDeclined``, ``pm_card_visa_chargeDeclined`` and
``pm_card_chargeDeclinedInsufficientFunds`` are declined (402 ``card_error``).

Counters (:meth:`LocalService.counters`): ``requests``, ``payment_intents`` (created), ``charges``
(card charges made: the money moved or was authorised), ``captures``, ``cancels``, ``refunds``,
``declines``, ``replays``, ``idempotency_errors``, ``in_use``, ``validation_errors``, ``lists``,
``searches``, ``faults_fired``.

Test payment methods ``pm_card_threeDSecure2Required``, ``pm_card_threeDSecureRequired`` and
``pm_card_authenticationRequired`` need 3-D Secure: the PaymentIntent is left ``requires_action``.
An ``error`` fault (:class:`~sagaguard.connectors.testing._service.FaultRule`) is a 5xx the endpoint
answers once it started executing: stored under the key and replayed, as Stripe does.

Options (``LocalStripe(search_lag=..., key_ttl=..., redirect_methods=...)``): ``search_lag`` seconds
before a new object shows up in search (Stripe's index lags; the list endpoints do not), ``key_ttl``,
``redirect_methods`` (the account has redirect-based payment methods enabled: a confirmed
PaymentIntent without ``return_url`` or ``automatic_payment_methods[allow_redirects]=never`` is
refused with a 400, as Stripe does).
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from sagaguard.connectors.testing._service import App, LocalService, Reply, Request
from sagaguard.connectors.testing._stripe_state import StripeFailure, StripeState

__all__ = ["API_KEY", "LocalStripe", "StripeApp", "decode_form"]

API_KEY = "sk_test_sagaguard_local"
"""Any key is accepted; this one is what the docs and tests use."""

DAY = 86_400.0

_INTENT = re.compile(r"^/v1/payment_intents/(?P<id>pi_\w+)(?:/(?P<action>confirm|capture|cancel))?$")
_REFUND = re.compile(r"^/v1/refunds/(?P<id>re_\w+)$")
_PART = re.compile(r"\[([^\]]*)\]")


def decode_form(text: str) -> dict[str, Any]:
    """Decode Stripe's form encoding (``metadata[k]=v``, ``expand[0]=x``, ``created[gte]=1``)."""
    out: dict[str, Any] = {}
    for name, value in urllib.parse.parse_qsl(text, keep_blank_values=True):
        head, _, rest = name.partition("[")
        parts = [head, *_PART.findall("[" + rest)] if rest else [head]
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return {k: _lists(v) for k, v in out.items()}


def _lists(value: Any) -> Any:
    """``{"0": a, "1": b}`` (how lists are encoded) back to ``[a, b]``."""
    if isinstance(value, dict):
        value = {k: _lists(v) for k, v in value.items()}
        if value and all(k.isdigit() for k in value):
            return [value[k] for k in sorted(value, key=int)]
    return value


@dataclass
class _Entry:
    """What an idempotency key holds: the request's fingerprint and, once done, the reply."""

    fingerprint: str
    first_used: float
    reply: Reply | None = None


class StripeApp(App):
    """The local Stripe server's request handling (run it with :class:`LocalStripe`)."""

    saves_errors = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.key_ttl = float(config.get("key_ttl", DAY))
        self.state = StripeState(
            self.clock,
            search_lag=float(config.get("search_lag", 0.0)),
            redirect_methods=bool(config.get("redirect_methods", False)),
        )
        self.keys: dict[tuple[str, str], _Entry] = {}

    def counters(self) -> dict[str, int]:
        return dict(self.state.counters)

    def reset(self) -> None:
        self.state = StripeState(
            self.clock, search_lag=self.state.search_lag, redirect_methods=self.state.redirect_methods
        )
        self.keys.clear()

    def handle(self, request: Request) -> Reply:
        with self.lock:
            self.state.count("requests")
        account = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not account:
            return _error(
                401, {"type": "invalid_request_error", "message": "You did not provide an API key."}
            )
        if request.method == "GET":
            request.pause()
            with self.lock:
                return self._read(request.path, decode_form(request.query))
        params = decode_form(request.body.decode())
        key = request.headers.get("idempotency-key")
        if not key:
            request.pause()
            with self.lock:
                return self._write(request.path, params, request.error)[0]
        return self._idempotent(request, (account, key), params)

    def _idempotent(self, request: Request, slot: tuple[str, str], params: Mapping[str, Any]) -> Reply:
        fingerprint = hashlib.sha256(
            json.dumps([request.method, request.path, params], sort_keys=True).encode()
        ).hexdigest()
        now = self.clock()
        with self.lock:
            entry = self.keys.get(slot)
            if entry is not None and entry.first_used + self.key_ttl <= now:
                entry = None  # pruned: the key's window has passed
                del self.keys[slot]
            if entry is not None and entry.fingerprint != fingerprint:
                self.state.count("idempotency_errors")
                return _error(
                    400,
                    {
                        "type": "idempotency_error",
                        "message": "Keys for idempotent requests can only be used with the same "
                        "parameters they were first used with. Try using a key other than "
                        f"'{slot[1]}' if you meant to execute a different request.",
                    },
                )
            if entry is not None and entry.reply is None:
                self.state.count("in_use")
                return _error(
                    409,
                    {
                        "type": "invalid_request_error",
                        "code": "idempotency_key_in_use",
                        "message": "There is currently another in-progress request using this "
                        "Idempotent Key (that probably means you submitted twice, and the other request "
                        "is still going through).",
                    },
                )
            if entry is not None and entry.reply is not None:
                self.state.count("replays")
                replayed = entry.reply
                return Reply(replayed.status, replayed.body, {"Idempotent-Replayed": "true"})
            entry = _Entry(fingerprint, now)
            self.keys[slot] = entry
        try:
            request.pause()  # a ``slow`` fault: the key stays in progress meanwhile
            with self.lock:
                reply, executed = self._write(request.path, params, request.error)
        except BaseException:
            with self.lock:
                self.keys.pop(slot, None)
            raise
        with self.lock:
            if executed:
                entry.reply = reply
            else:
                self.keys.pop(slot, None)  # refused before executing: nothing is stored
        return reply

    def _write(self, path: str, params: Mapping[str, Any], error: int = 0) -> tuple[Reply, bool]:
        """The reply, and whether the endpoint started executing (then the reply is stored).

        ``error``: an ``error`` fault's status: the endpoint started and failed, nothing applied.
        """
        state = self.state
        if error:
            state.count("saved_errors")
            return _error(error, {"type": "api_error", "message": "An unknown error occurred"}), True
        try:
            if path == "/v1/payment_intents":
                return Reply(HTTPStatus.OK, _copy(state.create_intent(params))), True
            if path == "/v1/refunds":
                return Reply(HTTPStatus.OK, _copy(state.create_refund(params))), True
            match = _INTENT.match(path)
            if match is not None and match["action"] == "confirm":
                return Reply(HTTPStatus.OK, _copy(state.confirm_intent(match["id"], params))), True
            if match is not None and match["action"] == "capture":
                return Reply(HTTPStatus.OK, _copy(state.capture_intent(match["id"], params))), True
            if match is not None and match["action"] == "cancel":
                return Reply(HTTPStatus.OK, _copy(state.cancel_intent(match["id"], params))), True
            return _missing(path), False
        except StripeFailure as failure:
            if not failure.executed:
                state.count("validation_errors")
            return Reply(failure.status, _copy(failure.body)), failure.executed

    def _read(self, path: str, params: Mapping[str, Any]) -> Reply:
        state = self.state
        try:
            if path == "/v1/payment_intents":
                return Reply(HTTPStatus.OK, _copy(state.listing("payment_intent", params, path)))
            if path == "/v1/payment_intents/search":
                return Reply(HTTPStatus.OK, _copy(state.search(params, path)))
            if path == "/v1/refunds":
                return Reply(HTTPStatus.OK, _copy(state.listing("refund", params, path)))
            match = _INTENT.match(path)
            if match is not None and match["action"] is None:
                return Reply(HTTPStatus.OK, _copy(state.intent(match["id"])))
            match = _REFUND.match(path)
            if match is not None:
                return Reply(HTTPStatus.OK, _copy(state.refund(match["id"])))
            return _missing(path)
        except StripeFailure as failure:
            return Reply(failure.status, failure.body)


def _copy(body: Any) -> Any:
    """A snapshot of the body as it is now (the stored objects change later)."""
    return json.loads(json.dumps(body))


def _error(status: int, error: Mapping[str, Any]) -> Reply:
    return Reply(status, {"error": dict(error)})


def _missing(path: str) -> Reply:
    return _error(
        404,
        {
            "type": "invalid_request_error",
            "code": "resource_missing",
            "message": f"Unrecognized request URL ({path}).",
        },
    )


class LocalStripe(LocalService):
    """The local Stripe server, in its own process (or a thread), as a context manager.

    Args:
        search_lag: seconds before a new PaymentIntent shows up in search (the list endpoints
            see it at once, as on Stripe).
        key_ttl: seconds an idempotency key is kept (Stripe: at least 24 hours).
        redirect_methods: the account has redirect-based payment methods enabled (a confirm
            without ``return_url`` or ``allow_redirects=never`` is refused).
        in_process: run in a thread of this process instead of its own process.
    """

    def __init__(
        self,
        *,
        search_lag: float = 0.0,
        key_ttl: float = DAY,
        redirect_methods: bool = False,
        in_process: bool = False,
    ) -> None:
        config = {"search_lag": search_lag, "key_ttl": key_ttl, "redirect_methods": redirect_methods}
        super().__init__("stripe", config, in_process=in_process)

    @property
    def api_base(self) -> str:
        """What to pass as the SDK's ``api`` base address (``base_addresses={"api": ...}``)."""
        return self.url

    @property
    def api_key(self) -> str:
        """An API key the server accepts."""
        return API_KEY
