"""What travels between Python and the Lua scripts besides the arguments themselves:
the bounds every call respects, the named outcome codes, and the per-field decoding of
raw replies (a value that is not UTF-8 spoils its own task, never the batch)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from enum import IntEnum

# One offer script call handles at most this many tasks (Redis runs a script alone:
# a bounded call keeps every other client's latency bounded too).
OFFER_CHUNK = 500
# offer_many writes this many chunk calls before reading their replies.
OFFER_WINDOW = 16
MAX_ACQUIRE = 1000  # leases per acquire call
MAX_MAINTAIN_BATCH = 5000  # items per sweep of one maintain call
MAX_DELAY = 10 * 365 * 86400.0  # seconds: ten years is "later", 1e12 is a mistake


class Outcome(IntEnum):
    """How an attempt settled; the scripts return these numbers (lib.lua OUTCOME_*)."""

    LOST = 0  # not settled by this token: another attempt owns the task, or it stalled
    COMPLETED = 1
    RETRY = 2  # a handler failure with a retry scheduled
    FAILED = 3  # a handler failure that ended the task
    RELEASED = 4

    @property
    def label(self) -> str:
        return self.name.lower()


# The values of one lease in the acquire reply, in order (acquire.lua).
LEASE_FIELDS = ("id", "token", "attempt", "name", "payload", "handler_failure_count",
                "stalled_attempt_count", "max_retries", "options", "priority")
LEASE_WIDTH = len(LEASE_FIELDS)


@dataclass
class RawFields:
    """Fields of a reply decoded one by one; `undecodable` keeps the bytes of the others."""

    values: dict[str, str | int | None]
    undecodable: dict[str, bytes] = field(default_factory=dict)

    def describe(self) -> str:
        return ", ".join(sorted(self.undecodable))

    def raw_json(self) -> dict[str, str]:
        """The undecodable bytes, base64-encoded, for an error record."""
        return {name: base64.b64encode(raw).decode() for name, raw in self.undecodable.items()}


def decode_fields(names: tuple[str, ...], raw: list) -> RawFields:
    out = RawFields({})
    for name, value in zip(names, raw):
        if isinstance(value, bytes):
            try:
                value = value.decode()
            except UnicodeDecodeError:
                out.undecodable[name] = value
                value = value.decode(errors="surrogateescape")
        out.values[name] = value
    return out


def decode_hash(flat: dict | list) -> RawFields:
    """An HGETALL reply read without decoding."""
    items = flat.items() if isinstance(flat, dict) else zip(flat[::2], flat[1::2])
    names, values = [], []
    for k, v in items:
        names.append(k.decode(errors="replace") if isinstance(k, bytes) else k)
        values.append(v)
    return decode_fields(tuple(names), values)


def wire(text: str) -> bytes | str:
    """A string decoded with surrogateescape goes back to Redis as its original bytes."""
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return text.encode(errors="surrogateescape")
