"""Attempt keys: a new Stripe idempotency key for a charge whose key is stuck on a saved 5xx.

Stripe stores the first answer under an ``Idempotency-Key`` once the endpoint started executing,
500s included, and replays it for 24 hours: re-sending under that key cannot get past it. When the
reconciler has proved that nothing was applied (a complete listing by the effect key in the
metadata) and the key's answer is such a replayed 5xx, the charge moves to its next *attempt key*.

Each attempt key is recorded in the ledger before it is used, as a guarded effect of its own
(:data:`ATTEMPT`, explicit key ``<effect key>/attempt/<n>``, result: the attempt key), so every
process re-sends under the same, newest key after a crash, and an operator sees every key a charge
was sent under (``sagaguard list``). Generation 0 is the effect's own provider key.
"""

from __future__ import annotations

from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.options import RunArguments
from sagaguard.idempotency.records import State

__all__ = ["ATTEMPT", "attempt_key", "current_attempt", "marker", "marker_key"]

ATTEMPT = "stripe.attempt_key"
"""The effect name of the ledger entry recording a new attempt key."""


def marker_key(effect_key: str, generation: int) -> str:
    """The explicit key of the ledger entry for ``generation`` (1, 2, ...) of ``effect_key``."""
    return f"{effect_key}/attempt/{generation}"


def marker(identity: EffectIdentity, generation: int) -> RunArguments:
    """The ``Guard.run`` (or ``arun``) arguments of the ledger entry that records ``generation``
    of the effect's attempt keys (run as :data:`ATTEMPT`, its body returning the attempt key)."""
    return {
        "key": marker_key(identity.key, generation),
        "arguments": {"generation": generation},
        "result_type": str,
    }


def attempt_key(provider_key: str, generation: int) -> str:
    """The Stripe idempotency key of ``generation`` (0: the provider key itself)."""
    return provider_key if generation == 0 else f"{provider_key}.a{generation}"


def current_attempt(guard: Guard, identity: EffectIdentity) -> int:
    """The newest attempt generation recorded in the ledger for the effect (0 when none): one
    store read when there is none."""
    generation = 0
    while True:
        marker = EffectIdentity.explicit(
            identity.namespace, marker_key(identity.key, generation + 1), ATTEMPT
        )
        record = guard.store.get(marker.key)
        if record is None or record.state is not State.SUCCEEDED:
            return generation
        generation += 1
