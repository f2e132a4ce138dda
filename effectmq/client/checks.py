"""Checks of what users configure: numeric options shared by producers and the worker
protocol, and the Redis a worker is given."""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..errors import InvalidOption


def check_number(name: str, value: Any, *, minimum: float = 0, integer: bool = False, allow_none=True,
                 maximum: float | None = None):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise InvalidOption(f"{name} must be {kind}, got {value!r}")
    if not math.isfinite(value):
        raise InvalidOption(f"{name} must be a finite number, got {value!r}")
    if value < minimum:
        raise InvalidOption(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise InvalidOption(f"{name} must be <= {shown(maximum)}, got {value!r}")
    return value


def check_below_socket_timeout(name: str, value: float, socket_timeout: float | None) -> None:
    """A wait that Redis answers at its end (WAIT's timeout) below the client's socket
    timeout: else the socket gives up first, and the call ends in a dropped connection
    instead of Redis's answer."""
    if socket_timeout and value >= float(socket_timeout):
        raise InvalidOption(f"{name} must be below the socket timeout ({shown(float(socket_timeout))} s), "
                            f"got {value!r}")


def shown(limit: float) -> str:
    """A limit as a message shows it: 315360000, not 3.1536e+08."""
    if isinstance(limit, float) and limit.is_integer():
        return str(int(limit))
    return str(limit)


def eviction_warning(policy: str | None) -> str | None:
    """What to tell whoever runs a Redis that evicts keys under memory pressure (None: all
    is well, or Redis would not say): an evicted task hash or index is lost work."""
    if policy is None or policy == "noeviction":
        return None
    return (f"Redis evicts keys when full (maxmemory-policy {policy}): an evicted task is lost work; "
            "set maxmemory-policy noeviction")


NEARLY_FULL = 0.9  # of maxmemory: worth saying before offers start failing


def human_bytes(n: int) -> str:
    """1,536 -> '1.5 KiB' (as Redis's own *_human fields, one decimal)."""
    if abs(n) < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if abs(size) < 1024 or unit == "GiB":
            break
    return f"{size:,.1f} {unit}"


def redis_write_notes(info: Mapping[str, Any]) -> list[str]:
    """What to tell whoever watches the queues about Redis taking new tasks, from INFO's
    memory, persistence and replication fields (read-only: nothing is written to find
    out). A full Redis under noeviction refuses offers (OOM) while reads, settlements
    and maintenance still go through; an evicting one loses tasks instead. A failed RDB
    save refuses writes (MISCONF) unless stop-writes-on-bgsave-error is off, which INFO
    does not say; too few replicas (NOREPLICAS) it does not say either."""
    notes = []
    if info.get("role") == "slave" and str(info.get("slave_read_only")) == "1":
        notes.append("this Redis is a read-only replica: it refuses new tasks (point the URL at the primary)")
    maxmemory = int(info.get("maxmemory") or 0)
    if maxmemory > 0:
        used = int(info.get("used_memory") or 0) - int(info.get("mem_not_counted_for_evict") or 0)
        policy = str(info.get("maxmemory_policy") or "")
        shown = f"{human_bytes(used)} used of maxmemory {human_bytes(maxmemory)}"
        if policy == "noeviction" and used > maxmemory:
            notes.append(f"Redis is full ({shown}, maxmemory-policy noeviction): it refuses new tasks; "
                         "workers still settle the tasks they hold")
        elif policy == "noeviction" and used >= NEARLY_FULL * maxmemory:
            notes.append(f"Redis is nearly full ({shown}): when full it refuses new tasks")
    warning = eviction_warning(str(info["maxmemory_policy"])) if info.get("maxmemory_policy") else None
    if warning:
        notes.append(warning)
    if info.get("rdb_last_bgsave_status") == "err":
        # Refused only with save points and stop-writes-on-bgsave-error on (CONFIG, when it answers).
        save, stop = info.get("config_save"), info.get("config_stop-writes-on-bgsave-error")
        if save is None or stop is None:
            notes.append("Redis's last RDB save failed: unless stop-writes-on-bgsave-error is off or no save "
                         "points are set, it refuses new tasks (MISCONF) until a save succeeds")
        elif save.strip() and stop == "yes":
            notes.append("Redis's last RDB save failed: it refuses new tasks (MISCONF) until a save succeeds")
        else:
            notes.append("Redis's last RDB save failed (it still takes new tasks: its data is not being saved)")
    if str(info.get("aof_enabled")) == "1" and info.get("aof_last_write_status") == "err":
        notes.append("Redis could not write its AOF: it refuses new tasks (MISCONF) until a write succeeds")
    return notes
