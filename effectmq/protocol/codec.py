"""JSON in and out of Redis: strict (no NaN, no pickle), with clear errors."""

from __future__ import annotations

import json
import math
import re
import reprlib
from typing import Any

from ..errors import UNSTORABLE, CorruptValue, InvalidPayload

_encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))

# How deep a value we store may nest: Python decodes one level per stack frame (the limit
# is 1000 frames, some already taken where a worker decodes), so deeper JSON is refused
# when written, never found undecodable by a worker after it was accepted.
MAX_DEPTH = 500
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')


def _depth(text: str) -> int:
    """How deep JSON text nests (its strings skipped)."""
    depth = deepest = 0
    for char in re.findall(r"[\[\]{}]", _STRINGS.sub("", text)):
        depth += 1 if char in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _too_deep(what: str) -> InvalidPayload:
    return InvalidPayload(f"{what} is nested more than {MAX_DEPTH} levels deep")


def dumps(value: Any, what: str = "payload") -> str:
    """Encode a JSON value, or raise InvalidPayload naming what was wrong."""
    try:
        text = _encoder.encode(value)
        if not text.isascii():
            text.encode()  # a lone surrogate has no UTF-8 form
    except RecursionError:
        raise _too_deep(what) from None
    except UnicodeEncodeError as exc:
        raise InvalidPayload(f"{what} must be plain JSON text; it holds a lone surrogate "
                             f"{exc.object[exc.start:exc.end]!r} that has no UTF-8 form") from None
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"{what} must be plain JSON (dict, list, str, number, bool, None): {exc}") from None
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(text) > MAX_DEPTH:
        raise _too_deep(what)
    return text


def loads(raw: str | bytes | None, what: str = "value") -> Any:
    """Decode a stored JSON value; a corrupt one raises CorruptValue."""
    if raw is None or raw == "" or raw == b"":
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CorruptValue(f"stored {what} is not valid JSON: {exc}") from None
    except RecursionError:  # written by another producer: ours refuse more than MAX_DEPTH
        raise CorruptValue(f"stored {what} is nested too deep to decode (more than {MAX_DEPTH} levels "
                           f"are refused when written)") from None


# -- values stored where Lua reads them back (error data: engine.error_json) ---------------

def text(value: Any) -> str:
    """`value` as text that has a UTF-8 form; never raises (a str() that raises, or a lone
    surrogate, which is kept as its escape \\udcXX)."""
    if not isinstance(value, str):
        try:
            value = str(value)
        except Exception as exc:  # a user's __str__ may raise anything
            value = f"<{type(value).__name__} whose str() raised {type(exc).__name__}>"
        if not isinstance(value, str):  # a __str__ that returned a str subclass gone wrong
            value = f"<{type(value).__name__}>"
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def human_size(n: int) -> str:
    """1048576 -> '1 MiB', 524288 -> '512 KiB'."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n:,} bytes"


def why_unstorable(value: Any, *, max_depth: int, max_int: int, max_bytes: int) -> str | None:
    """Why `value` cannot be stored as JSON that Redis's Lua cjson reads and writes back
    unchanged, or None when it can: not JSON, nested deeper than `max_depth` containers,
    an integer beyond +-max_int (Lua reads numbers as doubles: 10**400 becomes inf, which
    cjson cannot encode again), a non-finite float, a lone surrogate, or certainly more
    than `max_bytes` of JSON (a lower bound of its size is summed on the way, so a huge
    value is given up early, never encoded whole; `storable` measures the rest exactly).
    Never raises."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    size = 0  # at least this many bytes of JSON
    while stack:
        item, depth = stack.pop()
        if item is None or isinstance(item, bool):
            size += 4
        elif isinstance(item, str):
            size += len(item) + 2
            if not item.isascii():
                try:
                    item.encode()
                except UnicodeEncodeError:
                    return "text with a lone surrogate (it has no UTF-8 form)"
        elif isinstance(item, int):
            if not -max_int <= item <= max_int:
                return f"an integer beyond ±2**53 ({_digits(item)}): Lua reads numbers as doubles"
            size += 1
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"a non-finite number ({item!r})"
            size += 3
        elif isinstance(item, (list, tuple, dict)):
            if depth >= max_depth:
                return f"nested deeper than {max_depth} levels"
            size += 1 + len(item) * (2 if isinstance(item, dict) else 1)  # brackets, commas, colons
            if isinstance(item, dict):
                for key, member in item.items():
                    if not (isinstance(key, (str, int, float)) or key is None):  # bool is an int
                        return f"not JSON (a dict key of type {type(key).__name__})"
                    stack.append((key, max_depth))  # checked as a scalar: a JSON key is text
                    stack.append((member, depth + 1))
            else:
                stack.extend((member, depth + 1) for member in item)
        else:
            return f"not JSON (a value of type {type(item).__name__})"
        if size > max_bytes:
            return f"more than {human_size(max_bytes)} as JSON"
    return None


class _Preview(reprlib.Repr):
    """A short repr that never raises: no int of thousands of digits, no deep recursion."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 6
        self.maxstring = self.maxother = self.maxlong = 400
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = self.maxdeque = 20

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 1000:
            return f"<int of {_digits(x)}>"
        return super().repr_int(x, level)


def _digits(n: int) -> str:
    """'16 digits', or 'about 5,000 digits' where str() would refuse (over 4,300 digits)."""
    if n.bit_length() < 14_000:
        return f"{len(str(abs(n))):,} digits"
    return f"about {int(n.bit_length() * 0.30103) + 1:,} digits"


PREVIEW_CHARS = 1000


def preview(value: Any) -> str:
    """A short, safe repr of `value` (at most PREVIEW_CHARS characters), for messages."""
    try:
        shown = _Preview().repr(value)
    except Exception:  # a user's __repr__ may raise anything
        shown = f"<{type(value).__name__}>"
    shown = text(shown)
    return shown if len(shown) <= PREVIEW_CHARS else shown[:PREVIEW_CHARS - 3] + "..."


def storable(value: Any, *, max_depth: int, max_int: int, max_bytes: int) -> tuple[Any, str | None]:
    """`value` itself when it can be stored (see why_unstorable), else the placeholder
    string "~unstorable: <why>; was <preview>" (errors.UNSTORABLE) and why. Never raises."""
    why = why_unstorable(value, max_depth=max_depth, max_int=max_int, max_bytes=max_bytes)
    if why is None:
        try:
            size = len(_encoder.encode(value).encode())
            if size > max_bytes:
                why = f"more than {human_size(max_bytes)} as JSON ({size:,} bytes)"
        except Exception as exc:  # whatever the encoder finds
            why = f"not JSON ({type(exc).__name__}: {text(exc)[:200]})"
    if why is None:
        return value, None
    return f"{UNSTORABLE}: {why}; was {preview(value)}", why


def fitted(message: str, room: int, why: str) -> str:
    """`message` when its JSON string content is at most `room` bytes, else cut to fit and
    ending " ... [truncated from <n> bytes: <why>]"."""
    size = len(dumps(message).encode()) - 2
    if size <= room:
        return message
    note = f" ... [truncated from {len(message.encode()):,} bytes: {why}]"
    cut = message.encode()[:max(0, room - len(note.encode()))].decode("utf-8", "ignore")
    while cut and (over := len(dumps(cut + note).encode()) - 2 - room) > 0:  # escapes take more room
        cut = cut[:max(0, len(cut) - over)]
    return cut + note
