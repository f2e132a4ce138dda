"""Pure decisions of the heartbeat: when to renew, when ownership is gone.

Times are the worker's monotonic clock. `confirmed_until` is a local instant by
which the lease is certainly still held (the request was sent before Redis
computed the deadline), so the worker can only err on the safe side: it stops a
handler early, never late, whatever its wall clock says.
"""

from __future__ import annotations

from enum import Enum


class Action(Enum):
    KEEP = "keep"  # nothing to do yet
    RENEW = "renew"  # time to extend the lease
    INTERRUPT = "interrupt"  # ownership can no longer be confirmed: stop the handler


def safety_margin(lock_timeout: float) -> float:
    """How long before the confirmed deadline the worker gives up on a renewal."""
    return max(0.05, min(lock_timeout / 10, 5.0))


def refresh_interval(lock_timeout: float, lock_refresh: float | None) -> float:
    """Renew every `lock_refresh` (default a third of the lease), never later than the margin allows."""
    limit = lock_timeout - 2 * safety_margin(lock_timeout)
    wanted = lock_timeout / 3 if lock_refresh is None else lock_refresh
    return max(0.01, min(wanted, limit))


def tick(refresh: float) -> float:
    """How often the heartbeat looks at leases renewed every `refresh`: a quarter of it,
    within 10 ms and 1 s."""
    return max(0.01, min(refresh / 4, 1.0))


def spent(now: float, confirmed_until: float, lock_timeout: float) -> bool:
    """The lease cannot be confirmed for a safety margin more: nothing starts on it, and
    a handler on it is stopped."""
    return now >= confirmed_until - safety_margin(lock_timeout)


def decide(now: float, next_renew: float, confirmed_until: float, margin: float) -> Action:
    if now >= confirmed_until - margin:
        return Action.INTERRUPT
    if now >= next_renew:
        return Action.RENEW
    return Action.KEEP
