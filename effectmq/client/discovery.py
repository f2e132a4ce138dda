"""What a Redis holds, found by SCAN (never KEYS: Redis is not blocked): the queues
(every queue has keys ``{<prefix>:<queue>}:...``, keys.py; the scheduler namespaces are
found by scheduler/store.py with the same means). The dashboard and the CLI show them,
and name them when a name given matches none."""

from __future__ import annotations

from typing import Any

from ..protocol.keys import QUEUE_NAME, QueueKeys

# Keys every queue that was ever used has: "seq" (a task was enqueued) or "meta" (it
# was configured). Matched by SCAN on the server, so only those keys travel.
MARKERS = ("seq", "meta")
SCAN_COUNT = 1000


def queue_name_of(key: str, prefix: str) -> str | None:
    """The queue a key belongs to, or None. A queue name holds no "}", so the first one
    ends the hash tag (a task id after it may hold anything)."""
    head = "{" + prefix + ":"
    if not key.startswith(head):
        return None
    name, brace, _ = key[len(head):].partition("}")
    return name if brace and QUEUE_NAME.match(name) else None


async def discover_queues(redis: Any, prefix: str = "emq") -> list[str]:
    """Names of the queues found in this Redis (SCAN, so Redis is never blocked), sorted.
    Keys are read as bytes: one that is not UTF-8 names no queue of ours, and is skipped."""
    found: set[str] = set()
    pattern_base = QueueKeys(glob_escape(prefix), "*").base
    for marker in MARKERS:
        async for raw in redis.scan_iter(match=pattern_base + marker, count=SCAN_COUNT, NEVER_DECODE=True):
            try:
                key = raw.decode() if isinstance(raw, bytes) else raw
            except UnicodeDecodeError:
                continue
            name = queue_name_of(key, prefix)
            if name is not None:
                found.add(name)
    return sorted(found)


async def queue_exists(redis: Any, prefix: str, name: str) -> bool:
    """Whether the queue has one of its MARKERS keys: two keys of one slot, O(1)."""
    keys = QueueKeys(prefix, name)
    return bool(await redis.exists(*(keys.key(marker) for marker in MARKERS)))


def glob_escape(text: str) -> str:
    """Text matched as itself in a SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
