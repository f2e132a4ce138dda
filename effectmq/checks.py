"""Validation of numeric options shared by producers and the worker protocol."""

from __future__ import annotations

import math
from typing import Any

from .errors import InvalidOption


def check_number(name: str, value: Any, *, minimum: float = 0, integer: bool = False, allow_none=True,
                 maximum: float | None = None):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise InvalidOption(f"{name} must be {kind}, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise InvalidOption(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise InvalidOption(f"{name} must be <= {maximum:g}, got {value!r}")
    return value
