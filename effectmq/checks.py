"""Checks of what users configure: numeric options shared by producers and the worker
protocol, and the Redis a worker is given."""

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


def eviction_warning(policy: str | None) -> str | None:
    """What to tell whoever runs a Redis that evicts keys under memory pressure (None: all
    is well, or Redis would not say): an evicted task hash or index is lost work."""
    if policy is None or policy == "noeviction":
        return None
    return (f"Redis evicts keys when full (maxmemory-policy {policy}): an evicted task is lost work; "
            "set maxmemory-policy noeviction")
