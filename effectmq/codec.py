"""JSON in and out of Redis: strict (no NaN, no pickle), with clear errors."""

from __future__ import annotations

import json
from typing import Any

from .errors import CorruptValue, InvalidPayload

_encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def dumps(value: Any, what: str = "payload") -> str:
    """Encode a JSON value, or raise InvalidPayload naming what was wrong."""
    try:
        text = _encoder.encode(value)
        if not text.isascii():
            text.encode()  # a lone surrogate has no UTF-8 form
        return text
    except UnicodeEncodeError as exc:
        raise InvalidPayload(f"{what} must be plain JSON text; it holds a lone surrogate "
                             f"{exc.object[exc.start:exc.end]!r} that has no UTF-8 form") from None
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"{what} must be plain JSON (dict, list, str, number, bool, None): {exc}") from None


def loads(raw: str | bytes | None, what: str = "value") -> Any:
    """Decode a stored JSON value; a corrupt one raises CorruptValue."""
    if raw is None or raw == "" or raw == b"":
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CorruptValue(f"stored {what} is not valid JSON: {exc}") from None
