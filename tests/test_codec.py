"""The result codec (docs/concepts.md): JSON only, checked against the declared type."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import math
import threading
import typing
import uuid
from decimal import Decimal
from typing import Any, Callable, Optional  # noqa: UP035 - the old spellings on purpose

import pydantic
import pytest
import sqlmodel
import typing_extensions
from hypothesis import given
from hypothesis import strategies as st

from sagaguard.idempotency.codec import Codec, ErrorInfo, decode_error, encode_error
from sagaguard.idempotency.errors import CodecError

# ------------------------------------------------------------------------------ sample types


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Status(enum.StrEnum):
    OPEN = "open"
    PAID = "paid"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 9


@dataclasses.dataclass(frozen=True)
class Money:
    amount: int
    currency: str


@dataclasses.dataclass
class Charge:
    id: str
    money: Money
    status: Status
    created: dt.datetime
    tags: list[str]
    refunded: Money | None = None


class Item(pydantic.BaseModel):
    sku: str
    qty: int
    price: Decimal


class Order(pydantic.BaseModel):
    id: uuid.UUID
    items: list[Item]
    color: Color
    note: Optional[str] = None  # noqa: UP045
    placed: dt.date


class Receipt(sqlmodel.SQLModel):
    id: int
    email: str


class Payload(typing_extensions.TypedDict):
    id: str
    n: int


class StdPayload(typing.TypedDict):
    id: str
    n: int


class Opaque:
    """An arbitrary class: nothing says how it becomes JSON."""

    def __init__(self, handle: object) -> None:
        self.handle = handle


# ------------------------------------------------------------------------------ strategies

finite_floats = st.floats(allow_nan=False, allow_infinity=False)
offsets = st.integers(min_value=-23 * 60 - 59, max_value=23 * 60 + 59).map(
    lambda m: dt.timezone(dt.timedelta(minutes=m))
)
datetimes = st.datetimes(timezones=st.none() | offsets)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | finite_floats | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
moneys = st.builds(Money, st.integers(), st.text())
charges = st.builds(
    Charge,
    id=st.text(),
    money=moneys,
    status=st.sampled_from(Status),
    created=datetimes,
    tags=st.lists(st.text(), max_size=3),
    refunded=st.none() | moneys,
)
items = st.builds(
    Item,
    sku=st.text(),
    qty=st.integers(),
    price=st.decimals(allow_nan=False, allow_infinity=False),
)
orders = st.builds(
    Order,
    id=st.uuids(),
    items=st.lists(items, max_size=3),
    color=st.sampled_from(Color),
    note=st.none() | st.text(),
    placed=st.dates(),
)


def round_trip(tp: Any, value: Any) -> Any:
    codec: Codec[Any] = Codec(tp)
    text = codec.encode(value)
    assert isinstance(text, str)
    return codec.decode(text)


# ------------------------------------------------------------------------------- round trips

ROUND_TRIPS: list[tuple[Any, st.SearchStrategy[Any]]] = [
    (int, st.integers()),
    (str, st.text()),
    (float, finite_floats),
    (bool, st.booleans()),
    (list[int], st.lists(st.integers())),
    (dict[str, float], st.dictionaries(st.text(), finite_floats)),
    (tuple[int, str], st.tuples(st.integers(), st.text())),
    (set[str], st.sets(st.text())),
    (Optional[int], st.none() | st.integers()),  # noqa: UP045
    (int | None, st.none() | st.integers()),
    (list[Money], st.lists(moneys, max_size=4)),
    (Charge, charges),
    (Order, orders),
    (Color, st.sampled_from(Color)),
    (Status, st.sampled_from(Status)),
    (Priority, st.sampled_from(Priority)),
    (dt.datetime, datetimes),
    (dt.date, st.dates()),
    (Decimal, st.decimals(allow_nan=False, allow_infinity=False)),
    (uuid.UUID, st.uuids()),
    (Payload, st.fixed_dictionaries({"id": st.text(), "n": st.integers()})),
    (Receipt, st.builds(Receipt, id=st.integers(), email=st.text())),
    (Any, json_values),
]


@pytest.mark.parametrize(
    ("tp", "values"), ROUND_TRIPS, ids=[getattr(t, "__name__", repr(t)) for t, _ in ROUND_TRIPS]
)
@given(data=st.data())
def test_round_trip(tp: Any, values: st.SearchStrategy[Any], data: st.DataObject) -> None:
    value = data.draw(values)
    back = round_trip(tp, value)
    assert back == value
    assert type(back) is type(value) or value is None or tp is Any


@given(datetimes)
def test_datetime_keeps_its_offset(value: dt.datetime) -> None:
    back = round_trip(dt.datetime, value)
    assert back == value
    assert back.utcoffset() == value.utcoffset()


def test_none_type() -> None:
    for tp in (None, type(None)):
        codec: Codec[None] = Codec(tp)
        assert codec.decode(codec.encode(None)) is None


def test_nested_dataclass_round_trip_example() -> None:
    charge = Charge(
        id="ch_1",
        money=Money(1999, "eur"),
        status=Status.PAID,
        created=dt.datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=dt.UTC),
        tags=["ü", "🚀"],
    )
    codec: Codec[Charge] = Codec(Charge)
    text = codec.encode(charge)
    assert "pickle" not in text
    assert codec.decode(text) == charge


def test_for_return_of() -> None:
    codec = Codec.for_return_of(typing.get_type_hints(_returns_money))
    assert codec.decode(codec.encode(Money(1, "eur"))) == Money(1, "eur")
    with pytest.raises(CodecError):
        codec.decode('"not money"')
    untyped = Codec.for_return_of({})  # no annotation: any JSON value
    assert untyped.decode(untyped.encode({"a": [1, 2.5, None]})) == {"a": [1, 2.5, None]}


def _returns_money() -> Money:
    return Money(1, "eur")


def test_stdlib_typed_dict_round_trips_or_is_codec_error() -> None:
    try:
        codec: Codec[StdPayload] = Codec(StdPayload)
    except CodecError:
        return
    assert codec.decode(codec.encode({"id": "a", "n": 1})) == {"id": "a", "n": 1}


# ----------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "tp", [Opaque, type(threading.Lock()), list[Opaque], Optional[Opaque]], ids=repr  # noqa: UP045
)
def test_unstorable_type_is_refused_at_construction(tp: Any) -> None:
    with pytest.raises(CodecError):
        Codec(tp)


def test_callable_type_is_refused_at_construction() -> None:
    with pytest.raises(CodecError):
        Codec(Callable[[], int])


@pytest.mark.parametrize(
    ("tp", "value"),
    [
        (Money, Charge("x", Money(1, "e"), Status.OPEN, dt.datetime(2024, 1, 1), [])),
        (list[int], [1, object()]),
        (Any, object()),
        (Any, Opaque(1)),
        (Money, Opaque(1)),
    ],
    ids=["other-dataclass", "object-in-list", "object-as-any", "opaque-as-any", "opaque"],
)
def test_encoding_an_unstorable_value_is_codec_error(tp: Any, value: Any) -> None:
    with pytest.raises(CodecError):
        Codec(tp).encode(value)


@pytest.mark.parametrize(
    ("tp", "value"),
    [(int, "abc"), (int, None), (str, 5), (dict[str, int], {"a": "b"}), (Money, {"amount": 1})],
    ids=["str-as-int", "none-as-int", "int-as-str", "bad-dict-value", "dict-as-dataclass"],
)
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_encoding_a_value_of_the_wrong_type_is_codec_error(tp: Any, value: Any) -> None:
    with pytest.raises(CodecError):
        Codec(tp).encode(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_float_round_trips_or_is_refused(value: float) -> None:
    codec: Codec[float] = Codec(float)
    try:
        text = codec.encode(value)
    except CodecError:
        return
    try:
        back = codec.decode(text)
    except CodecError:
        pytest.fail(f"{value} was encoded as {text}, which does not decode back")
    assert back == value or (math.isnan(back) and math.isnan(value))


def test_unresolvable_annotation_is_codec_error() -> None:
    with pytest.raises(CodecError):
        Codec("UndefinedResultType").encode(1)


@pytest.mark.parametrize(
    ("tp", "text"),
    [
        (int, '"abc"'),
        (int, "not json"),
        (Money, '{"amount": 1}'),
        (Money, "[1, 2]"),
        (Status, '"refunded"'),
        (dt.datetime, '"yesterday"'),
        (list[int], '{"a": 1}'),
    ],
)
def test_decoding_text_that_does_not_fit_is_codec_error(tp: Any, text: str) -> None:
    with pytest.raises(CodecError):
        Codec(tp).decode(text)


# ---------------------------------------------------------------------------------- errors


class CardDeclined(Exception):
    """A connector's permanent error, with data in its args."""


def test_error_round_trip() -> None:
    exc = ValueError("bad amount", 3, {"field": "amount"})
    info = decode_error(encode_error(exc))
    assert info == ErrorInfo("builtins.ValueError", str(exc), ["bad amount", 3, {"field": "amount"}])


def test_error_type_is_qualified() -> None:
    info = decode_error(encode_error(CardDeclined("card_declined")))
    assert info.type_name == f"{CardDeclined.__module__}.CardDeclined"
    assert info.message == "card_declined"
    assert info.args == ["card_declined"]


def test_error_args_that_are_not_json_are_kept_as_text() -> None:
    marker = Opaque(1)
    info = decode_error(encode_error(RuntimeError(marker, math.nan, {1, 2}, "ok")))
    assert info.args == [str(marker), "nan", str({1, 2}), "ok"]


def test_error_without_args() -> None:
    assert decode_error(encode_error(TimeoutError())) == ErrorInfo("builtins.TimeoutError", "", [])


@given(st.text(), st.lists(json_values, max_size=3))
def test_error_round_trip_property(message: str, extra: list[Any]) -> None:
    exc = CardDeclined(message, *extra)
    info = decode_error(encode_error(exc))
    assert info.type_name.endswith(".CardDeclined")
    assert info.message == str(exc)
    assert info.args == [message, *extra]


@pytest.mark.parametrize("text", ["not json", "[]", '"text"', "null", "{}", '{"type": "X"}', "1"])
def test_unreadable_error_is_codec_error(text: str) -> None:
    with pytest.raises(CodecError):
        decode_error(text)
