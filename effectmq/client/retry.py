"""Retry schedules: how long to wait before the next attempt after a typed failure.

A policy maps the number of handler failures so far (1 after the first) to a delay
in seconds. Fixed and Exponential serialize to JSON, so they can travel with a task
or sit in the queue's settings; any callable works as a custom policy in code.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Union

from ..errors import InvalidOption
from ..protocol.settings import BY_FIELD

# The policy's defaults, as settings.TABLE gives them to a Queue resource too.
_INITIAL = float(BY_FIELD["retry.initialDelaySeconds"].default)
_MAXIMUM = float(BY_FIELD["retry.maxDelaySeconds"].default)
_JITTER = bool(BY_FIELD["retry.jitter"].default)
_BACKOFF = BY_FIELD["retry.backoff"].default


@dataclass(frozen=True)
class Fixed:
    delay: float = _INITIAL

    def __post_init__(self) -> None:
        if self.delay < 0:
            raise InvalidOption(f"retry delay must be >= 0, got {self.delay}")

    def __call__(self, failures: int) -> float:
        return self.delay

    def to_json(self) -> dict:
        return {"backoff": "Fixed", "initialDelaySeconds": self.delay}


@dataclass(frozen=True)
class Exponential:
    initial: float = _INITIAL
    maximum: float = _MAXIMUM
    factor: float = 2.0
    jitter: bool = _JITTER

    def __post_init__(self) -> None:
        if self.initial < 0 or self.maximum < 0:
            raise InvalidOption("retry delays must be >= 0")
        if self.factor < 1:
            raise InvalidOption(f"retry factor must be >= 1, got {self.factor}")

    def __call__(self, failures: int) -> float:
        try:
            grown = self.initial * self.factor ** max(0, failures - 1)
        except OverflowError:  # factor ** 1024 and more: the maximum long before
            grown = math.inf
        base = min(self.maximum, grown)
        if self.jitter:  # "full jitter" spreads a burst of failures over the window
            return random.uniform(base / 2, base)
        return base

    def to_json(self) -> dict:
        return {
            "backoff": "Exponential",
            "initialDelaySeconds": self.initial,
            "maxDelaySeconds": self.maximum,
            "factor": self.factor,
            "jitter": self.jitter,
        }


RetryPolicy = Union[Fixed, Exponential, Callable[[int], float]]
DEFAULT_POLICY = Exponential()


def from_json(spec: dict | None) -> Fixed | Exponential | None:
    """Parse the JSON (or CRD) form of a policy; None for no policy."""
    if not spec:
        return None
    kind = spec.get("backoff", _BACKOFF)
    if kind == "Fixed":
        return Fixed(float(spec.get("initialDelaySeconds", _INITIAL)))
    if kind == "Exponential":
        return Exponential(
            float(spec.get("initialDelaySeconds", _INITIAL)),
            float(spec.get("maxDelaySeconds", _MAXIMUM)),
            float(spec.get("factor", 2.0)),
            bool(spec.get("jitter", _JITTER)),
        )
    raise InvalidOption(f"unknown retry backoff {kind!r} (expected Fixed or Exponential)")


def to_json(policy: RetryPolicy | None) -> dict | None:
    if policy is None:
        return None
    if isinstance(policy, (Fixed, Exponential)):
        return policy.to_json()
    raise InvalidOption("a custom retry policy (a callable) cannot be stored with a task; declare it on the handler")
