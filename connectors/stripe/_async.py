"""The ``_async`` methods of :class:`sagaguard.connectors.stripe.StripeEffects`: the same effects, reconcilers
and compensation as the sync methods, awaited on the SDK's async API (``create_async``, ...).

Each method is a thin driver: the requests, the error mapping and the reconciling decisions are
those of :mod:`sagaguard.connectors.stripe._flows`, shared with the sync methods.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import stripe

from sagaguard.connectors.stripe import _attempts as attempts
from sagaguard.connectors.stripe import _evidence as evidence
from sagaguard.connectors.stripe import _flows as flows
from sagaguard.connectors.stripe._base import StripeBase
from sagaguard.connectors.stripe._mapping import map_error
from sagaguard.connectors.stripe._objects import CANCEL, CHARGE, Payment, Refund, Resolution
from sagaguard.idempotency.backends.offload import in_thread
from sagaguard.idempotency.effect import NotAppliedResolution, ReconcileRequest
from sagaguard.idempotency.effect import current_effect as _current_effect
from sagaguard.idempotency.keys import EffectIdentity

R = TypeVar("R", Payment, Refund)


class AsyncStripeMethods(StripeBase):
    """The async half of :class:`sagaguard.connectors.stripe.StripeEffects`."""

    async def charge_async(
        self,
        amount: int,
        currency: str,
        *,
        payment_method: str,
        customer: str | None = None,
        capture: bool = True,
        description: str | None = None,
        metadata: Mapping[str, str] | None = None,
        return_url: str | None = None,
        payment_method_types: Sequence[str] | None = None,
        key: str | None = None,
    ) -> Payment:
        """The async twin of :meth:`~sagaguard.connectors.stripe.StripeEffects.charge`: the same effect
        (``stripe.charge``, same key, same record), so a charge made by either is replayed by both."""
        request = flows.ChargeRequest(
            amount, currency, payment_method, customer, capture, description, metadata, return_url,
            None if payment_method_types is None else tuple(payment_method_types),
        )  # fmt: skip
        return flows.delivered(await self._write_async(request.write(), key, self.reconcile_charge_async))

    async def capture_async(
        self, payment_intent: str, *, amount: int | None = None, key: str | None = None
    ) -> Payment:
        """The async twin of :meth:`~sagaguard.connectors.stripe.StripeEffects.capture`."""
        write = flows.capture(payment_intent, amount)
        return await self._write_async(write, key, self._reconcile_status_async("succeeded"))

    async def cancel_async(self, payment_intent: str, *, key: str | None = None) -> Payment:
        """The async twin of :meth:`~sagaguard.connectors.stripe.StripeEffects.cancel`."""
        write = flows.cancel(payment_intent)
        return await self._write_async(write, key, self._reconcile_status_async("canceled"))

    async def refund_async(
        self,
        payment_intent: str,
        *,
        amount: int | None = None,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
        key: str | None = None,
    ) -> Refund:
        """The async twin of :meth:`~sagaguard.connectors.stripe.StripeEffects.refund`."""
        request = flows.RefundRequest(payment_intent, amount, reason, metadata)
        return await self._write_async(request.write(), key, self.reconcile_refund_async)

    async def undo_charges_async(
        self, scope: str, *, effect: str = CHARGE, ordinal: int = 0, result: Payment | None = None
    ) -> list[Payment | Refund]:
        """The async twin of :meth:`~sagaguard.connectors.stripe.StripeEffects.undo_charges`."""
        identity = EffectIdentity.of(self.guard.namespace, scope, effect, ordinal, self.guard.ledger_id)
        found = None
        if result is None:
            # The store is sync: a SQL read must not block the event loop.
            record = await in_thread(self.guard.store.get, identity.key)
            if record is None:
                return []  # never claimed: the charge was not attempted
            result = evidence.recorded_payment(record)
            if result is None:
                found = await self.find_payments_async(
                    identity.search_key, since=record.created_at - self.search_margin
                )
                if found is not None:
                    evidence.settled(record, found, await in_thread(self.guard.store.now), self.key_window)
        intents = await flows.adrive(flows.charged_intents(result, found), self._do_async)
        return await flows.adrive(flows.undo(intents), self._do_async)

    async def reconcile_charge_async(self, request: ReconcileRequest) -> Resolution[Payment]:
        """The async twin of :meth:`~sagaguard.connectors.stripe.StripeEffects.reconcile_charge`."""
        query = flows.charge_query(request, self.search_margin)
        found = await self.find_payments_async(request.identity.search_key, **query)
        resolution = flows.charge_resolution(found, request.record, self.key_window)
        if isinstance(resolution, NotAppliedResolution):
            await self._next_attempt_if_stuck_async(request)
        return resolution

    async def _next_attempt_if_stuck_async(self, request: ReconcileRequest) -> None:
        identity = request.identity
        generation = await in_thread(attempts.current_attempt, self.guard, identity)
        if not evidence.replayed_5xx(request.record, attempts.attempt_key(identity.provider_key, generation)):
            return
        new_key = attempts.attempt_key(identity.provider_key, generation + 1)

        async def record() -> str:
            return new_key

        await self.guard.arun(attempts.ATTEMPT, record, **attempts.marker(identity, generation + 1))

    async def reconcile_refund_async(self, request: ReconcileRequest) -> Resolution[Refund]:
        """The async twin of :meth:`~sagaguard.connectors.stripe.StripeEffects.reconcile_refund`."""
        return await flows.adrive(flows.reconcile_refund(request, self.max_list_pages), self._do_async)

    async def find_payments_async(
        self, effect_key: str, *, since: float, customer: str | None = None, age: float | None = None
    ) -> list[dict[str, Any]] | None:
        """The async twin of :meth:`~sagaguard.connectors.stripe.StripeEffects.find_payments`."""
        flow = flows.find_payments(
            effect_key, since=since, customer=customer, age=age, max_pages=self.max_list_pages,
            search_lag=self.search_lag,
        )  # fmt: skip
        return await flows.adrive(flow, self._do_async)

    # -- plumbing ---------------------------------------------------------------------------------

    def _reconcile_status_async(
        self, status: str
    ) -> Callable[[ReconcileRequest], Awaitable[Resolution[Payment]]]:
        async def reconcile(request: ReconcileRequest) -> Resolution[Payment]:
            return await flows.adrive(flows.reconcile_status(request, status), self._do_async)

        return reconcile

    async def _write_async(
        self,
        write: flows.Write[R],
        key: str | None,
        reconciler: Callable[[ReconcileRequest], Awaitable[Any]],
    ) -> R:
        async def call() -> R:
            effect = _current_effect()
            method = self._async_method(write.resource, write.method)
            params = write.params(effect.identity.search_key)
            provider_key = effect.provider_key
            if write.effect == CHARGE and effect.token > 1:  # taken over: a new attempt key may exist
                generation = await in_thread(attempts.current_attempt, self.guard, effect.identity)
                provider_key = attempts.attempt_key(provider_key, generation)
            try:
                answer = await method(*write.ids, params, self._options(provider_key))
            except stripe.StripeError as exc:
                raise map_error(exc, provider_key) from exc
            return write.result_type.of(answer)

        return await self.guard.arun(write.effect, call, **self._write_options(write, key, reconciler))

    def _async_method(self, resource: str, method: str) -> Callable[..., Awaitable[Any]]:
        service = getattr(self.async_client.v1, resource)
        return getattr(service, f"{method}_async")  # type: ignore[no-any-return]

    async def _do_async(self, op: flows.Op) -> Any:
        if isinstance(op, flows.Undo):
            if op.effect == CANCEL:
                return await self.cancel_async(op.payment_intent)
            return await self.refund_async(op.payment_intent)
        try:
            return await self._async_method(op.resource, op.method)(*op.args, options=self._options())
        except stripe.StripeError as exc:
            raise map_error(exc) from exc
