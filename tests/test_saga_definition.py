"""Saga definitions: the declaration API and the definition-time checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from sagaguard import saga
from sagaguard.idempotency.errors import CodecError
from sagaguard.saga import (
    DefinitionError,
    DuplicateStep,
    Saga,
    SignatureError,
    StepContext,
    StepKind,
    StepOrderError,
    UnstorableType,
)


@dataclass
class Order:
    id: str
    amount: int


@dataclass
class Receipt:
    charge_id: str


class Opaque:
    """Not storable as JSON."""


def refund(ctx: StepContext, order: Order, receipt: Receipt | None) -> None: ...


def test_exported_members() -> None:
    assert sorted(saga.__all__) == sorted(set(saga.__all__))
    for name in saga.__all__:
        assert hasattr(saga, name), name


def test_declares_steps_in_order_with_kinds() -> None:
    trip = Saga("book_trip", version=2, input=Order)

    @trip.step(compensate=refund)
    def charge(ctx: StepContext, order: Order) -> Receipt:
        return Receipt("ch_1")

    @trip.step
    def reserve(ctx: StepContext, order: Order) -> int:
        return 7

    @reserve.compensation
    def release(ctx: StepContext, order: Order, seat: int | None) -> None: ...

    @trip.step(compensate=None, name="check")
    def validate(ctx: StepContext, order: Order) -> None: ...

    @trip.pivot
    def book(ctx: StepContext, order: Order) -> str:
        return "bk"

    @trip.retriable()
    async def email(ctx: StepContext, order: Order) -> None: ...

    assert [s.name for s in trip.steps] == ["charge", "reserve", "check", "book", "email"]
    assert [s.kind for s in trip.steps] == [
        StepKind.COMPENSATABLE,
        StepKind.COMPENSATABLE,
        StepKind.COMPENSATABLE,
        StepKind.PIVOT,
        StepKind.RETRIABLE,
    ]
    assert trip.pivot_index == 3
    assert reserve.compensation_fn is release
    assert trip.steps[2].compensation_name is None
    assert charge.compensation_name is not None and charge.compensation_name.endswith("refund")
    assert charge.codec.decode(charge.codec.encode(Receipt("x"))) == Receipt("x")
    assert trip.freeze() is trip and trip.frozen


def test_duplicate_step_name() -> None:
    s = Saga("s", input=Order)

    @s.step(compensate=None)
    def a(ctx: StepContext, order: Order) -> None: ...

    with pytest.raises(DuplicateStep) as info:

        @s.step(compensate=None, name="a")
        def b(ctx: StepContext, order: Order) -> None: ...

    assert info.value.step == "a"


def test_compensatable_step_after_pivot() -> None:
    s = Saga("s", input=Order)

    @s.pivot
    def p(ctx: StepContext, order: Order) -> None: ...

    with pytest.raises(StepOrderError, match="after the pivot"):

        @s.step(compensate=refund)
        def late(ctx: StepContext, order: Order) -> None: ...


def test_retriable_step_before_pivot() -> None:
    s = Saga("s", input=Order)
    with pytest.raises(StepOrderError, match="before any pivot"):

        @s.retriable
        def early(ctx: StepContext, order: Order) -> None: ...


def test_second_pivot() -> None:
    s = Saga("s", input=Order)

    @s.pivot
    def p(ctx: StepContext, order: Order) -> None: ...

    with pytest.raises(StepOrderError, match="already has a pivot"):

        @s.pivot
        def q(ctx: StepContext, order: Order) -> None: ...


def test_compensation_on_pivot_refused() -> None:
    s = Saga("s", input=Order)

    @s.pivot
    def p(ctx: StepContext, order: Order) -> None: ...

    with pytest.raises(StepOrderError, match="only compensatable"):
        p.compensation(refund)


@pytest.mark.parametrize(
    "bad",
    [
        lambda ctx, order: None,  # too few parameters
        lambda ctx, order, result, extra: None,  # one too many, without a default
    ],
)
def test_compensation_arity(bad: Any) -> None:
    s = Saga("s", input=Order)
    with pytest.raises(SignatureError, match="must take"):

        @s.step(compensate=bad)
        def a(ctx: StepContext, order: Order) -> None: ...


def test_compensation_result_must_accept_none() -> None:
    def strict(ctx: StepContext, order: Order, receipt: Receipt) -> None: ...

    s = Saga("s", input=Order)
    with pytest.raises(SignatureError, match="must accept None"):

        @s.step(compensate=strict)
        def a(ctx: StepContext, order: Order) -> Receipt:
            return Receipt("x")


def test_compensation_with_defaults_and_varargs_is_fine() -> None:
    def loose(ctx: StepContext, *args: Any) -> None: ...

    def extra(ctx: StepContext, order: Order, receipt: Any, note: str = "") -> None: ...

    s = Saga("s", input=Order)

    @s.step(compensate=loose)
    def a(ctx: StepContext, order: Order) -> None: ...

    @s.step(compensate=extra)
    def b(ctx: StepContext, order: Order) -> None: ...


def test_action_arity() -> None:
    s = Saga("s", input=Order)
    with pytest.raises(SignatureError, match=r"\(ctx, input\)"):

        @s.step(compensate=None)
        def a(ctx: StepContext) -> None: ...


def test_unstorable_result_type() -> None:
    s = Saga("s", input=Order)
    with pytest.raises(UnstorableType) as info:

        @s.step(compensate=None)
        def a(ctx: StepContext, order: Order) -> Opaque:
            return Opaque()

    assert isinstance(info.value, CodecError) and isinstance(info.value, DefinitionError)


def test_unstorable_input_type() -> None:
    with pytest.raises(UnstorableType):
        Saga("s", input=Opaque)


@pytest.mark.parametrize("name", ["", "a/b", "~x", "a b"])
def test_bad_step_names(name: str) -> None:
    s = Saga("s", input=Order)
    with pytest.raises(SignatureError, match="step name"):
        s.step(name=name, compensate=None)(lambda ctx, order: None)


def test_bad_saga_name_and_version() -> None:
    with pytest.raises(DefinitionError):
        Saga("a/b", input=Order)
    with pytest.raises(DefinitionError):
        Saga("a", version=0, input=Order)


def test_missing_compensation_found_at_freeze() -> None:
    s = Saga("s", input=Order)

    @s.step
    def a(ctx: StepContext, order: Order) -> None: ...

    with pytest.raises(StepOrderError, match="has no compensation"):
        s.freeze()


def test_frozen_saga_refuses_changes() -> None:
    s = Saga("s", input=Order)

    @s.step(compensate=None)
    def a(ctx: StepContext, order: Order) -> None: ...

    s.freeze()
    with pytest.raises(StepOrderError, match="frozen"):

        @s.step(compensate=None)
        def b(ctx: StepContext, order: Order) -> None: ...


def test_empty_saga_cannot_freeze() -> None:
    with pytest.raises(StepOrderError, match="no steps"):
        Saga("s", input=Order).freeze()


def test_compensation_attached_twice() -> None:
    s = Saga("s", input=Order)

    @s.step(compensate=refund)
    def a(ctx: StepContext, order: Order) -> None: ...

    with pytest.raises(StepOrderError, match="already has"):
        a.compensation(refund)
