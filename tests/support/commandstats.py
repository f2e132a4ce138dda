"""Counts read off Redis's INFO commandstats (commands inside scripts included)."""

from __future__ import annotations

# How a script call reaches Redis: FCALL of the library (Redis 7), else EVALSHA (EVAL by hand).
SCRIPT_COMMANDS = ("fcall", "evalsha", "eval")


def script_calls(client) -> int:
    """Script calls Redis ran, however they were sent (a call answered 'not loaded' too)."""
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{command}", {}).get("calls", 0) for command in SCRIPT_COMMANDS)
