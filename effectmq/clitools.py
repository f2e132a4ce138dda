"""Helpers shared by the `effectmq` subcommands."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

URL_HELP = ("Redis URL: redis://, rediss://, unix://, redis+sentinel://h1:p1,h2:p2/<service> or "
            "redis+cluster://h1:p1,h2:p2 (a Redis Cluster) [EFFECTMQ_REDIS_URL]")


def env(name: str, default: Any = None, cast: Callable = str) -> Any:
    """An option's default from the environment (how the operator configures pods)."""
    value = os.environ.get(name)
    return default if value in (None, "") else cast(value)


def emit(args, value: Any, human: Callable[[Any], str]) -> None:
    """Print JSON with --json, else the human rendering."""
    print(json.dumps(value, indent=2, default=str) if args.json else human(value), flush=True)
