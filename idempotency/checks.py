"""The checks every public constructor and entry point applies to the values it is given.

One place decides what a duration, a count and a stored name may be, so the guard, the stores, the
outbox, the saga runner, the recovery worker and the agent runner refuse the same values with the
same :class:`~sagaguard.idempotency.errors.ConfigurationError` (naming the option), before anything
is stored or any loop starts.
"""

from __future__ import annotations

import math

from sagaguard.idempotency.errors import CodecError, ConfigurationError

__all__ = ["MAX_TEXT", "count", "seconds", "storable_text"]

MAX_TEXT = 4096
"""The longest name, scope, key or saga id accepted, in characters."""


def seconds(label: str, value: object, *, zero_ok: bool = False) -> float:
    """A duration option checked: a finite number of seconds, > 0 (or >= 0 with ``zero_ok``).

    NaN and infinity are refused: NaN compares false with everything, so a NaN lease would never
    run out (a crashed worker's claim would block for ever), and a NaN interval between sweeps
    would make a worker loop without pausing.

    Raises:
        ConfigurationError: naming ``label``, when ``value`` is not such a number (a bool neither).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero_ok)
    ):
        raise ConfigurationError(
            f"{label}= must be a finite number of seconds {'>= 0' if zero_ok else '> 0'}, got {value!r}"
        )
    return float(value)


def count(label: str, value: object, *, minimum: int = 1) -> int:
    """A count option checked: an int (not a bool) of at least ``minimum``.

    Raises:
        ConfigurationError: naming ``label``, when ``value`` is not such an int.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{label}= must be an int >= {minimum}, got {value!r}")
    return value


def storable_text(label: str, value: object, *, empty_ok: bool = False) -> str:
    """A name, scope, key or id checked: text every backend stores as exactly the text it is.

    Postgres text cannot hold a NUL character (the driver cuts the string there, so ``"X\\x00a"``
    would be stored, and later found, as ``"X"``: another caller's record); no backend can store a
    lone surrogate (it has no UTF-8 form). Checked before anything is written, so every backend
    refuses the same values.

    Raises:
        ConfigurationError: naming ``label``: not a str, empty (unless ``empty_ok``), longer than
            :data:`MAX_TEXT`, or holding a NUL character.
        CodecError: a lone surrogate (a ConfigurationError too).
    """
    if not isinstance(value, str):
        raise ConfigurationError(f"{label} must be str, got {type(value).__name__}")
    if not value and not empty_ok:
        raise ConfigurationError(f"{label} must not be empty")
    if len(value) > MAX_TEXT:
        raise ConfigurationError(f"{label} is longer than {MAX_TEXT} characters")
    if "\x00" in value:
        raise ConfigurationError(f"{label} contains a NUL character, which Postgres cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CodecError(f"{label} is not valid unicode: {exc.reason}") from exc
    return value
