"""A Python module a docs test needs: under CI its absence fails the test, elsewhere it
skips with what to install (the test extra has them all)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.fixtures.redis import IN_CI


def require_module(name: str, hint: str) -> None:
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        message = f"no module {name!r}: install {hint}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
