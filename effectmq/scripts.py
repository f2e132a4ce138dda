"""The Lua scripts of the storage protocol, one per atomic operation.

Each script in ``lua/`` is prefixed with ``lua/lib.lua`` and called by SHA; redis-py
reloads it when Redis answers NOSCRIPT (after a restart or SCRIPT FLUSH).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

OPERATIONS = (
    "offer", "acquire", "renew", "complete", "fail", "release", "progress",
    "cancel", "retry", "maintain", "stats", "configure",
)


@cache
def source(operation: str) -> str:
    lua = resources.files(__package__) / "lua"
    return (lua / "lib.lua").read_text() + "\n" + (lua / f"{operation}.lua").read_text()


def register_all(client) -> dict:
    """Script objects (EVALSHA with NOSCRIPT reload) bound to a redis-py client."""
    return {op: client.register_script(source(op)) for op in OPERATIONS}
