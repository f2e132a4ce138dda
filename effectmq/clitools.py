"""Helpers shared by the `effectmq` subcommands."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

# --url has no default of its own: what it leaves unsaid, effectmq.connection.url_from_env
# reads when a command connects (so --help and an explicit --url never read the file).
URL_HELP = ("Redis URL: redis://, rediss://, unix://, redis+sentinel://h1:p1,h2:p2/<service> or "
            "redis+cluster://h1:p1,h2:p2 (a Redis Cluster) [EFFECTMQ_REDIS_URL, or EFFECTMQ_REDIS_URL_FILE: "
            "a file that holds it, e.g. a mounted Secret]")


CAST_KINDS: dict[Callable, str] = {int: "an integer", float: "a number"}


def env(name: str, default: Any = None, cast: Callable = str) -> Any:
    """An option's default from the environment (how the operator configures pods); a
    value that does not parse is a usage error (exit 2) that names the variable."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return cast(value)
    except ValueError:
        print(f"effectmq: {name} must be {CAST_KINDS.get(cast, 'valid')}, got {value!r}", file=sys.stderr)
        raise SystemExit(2) from None


def env_flag(name: str) -> bool:
    """A yes/no option's default from the environment: true only for "true" (any case)."""
    return (env(name) or "").lower() == "true"


def emit(args, value: Any, human: Callable[[Any], str]) -> None:
    """Print JSON with --json, else the human rendering."""
    print(json.dumps(value, indent=2, default=str) if args.json else human(value), flush=True)
