"""Why a Queue's backlog waits although workers could take it (pure): its rate limit, and
its task groups' caps.

`RateLimited` and `GroupCapped` are conditions beside Ready, like Stalling and for the
same reason: a queue held back by its own limits works as asked, so Flux, Argo CD and
`kubectl wait --for=condition=Ready` keep calling it healthy. RateLimited says why tasks
wait (the limit reached, or starts held by a handler whose downstream service asked to
slow down), and scaling (scaling.py) adds no replicas the limit could not use.
GroupCapped says how many waiting tasks are parked for their group's cap or pause: they
start only as their group's attempts end or it resumes, so they are no demand for
replicas either (QueueStats.waiting leaves them out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .status import Check

CONDITION = "RateLimited"
GROUP_CONDITION = "GroupCapped"


@dataclass(frozen=True)
class Throttle:
    """The queue's rate limit as Redis reported it on one read."""

    limit: tuple[int, float] | None  # (tasks, period seconds); None: no limit
    window_starts: int  # attempts started in the limit's window that ends now
    held_for: float  # seconds a handler's hold of the starts (a 429's Retry-After) still lasts; 0: none
    waiting: int

    @classmethod
    def of(cls, stats: Any) -> "Throttle":
        """From effectmq.QueueStats."""
        return cls(stats.rate_limit, stats.rate_window_starts, stats.starts_held_for, stats.waiting)

    @property
    def limit_reached(self) -> bool:
        return self.limit is not None and self.window_starts >= self.limit[0]

    @property
    def holding_back(self) -> bool:
        """Tasks wait that a worker could start but for the limit or a hold."""
        return self.waiting > 0 and (self.held_for > 0 or self.limit_reached)


def describe_limit(limit: tuple[int, float]) -> str:
    tasks, period = limit
    return f"{tasks} {'start' if tasks == 1 else 'starts'} per {period:g}s"


def check(throttle: Throttle | None, previous: Iterable[dict[str, Any]] = ()) -> Check | None:
    """The RateLimited condition: none for a queue without a limit or hold; Unknown when the
    limit could not be read and the Queue has the condition (its last verdict is stale)."""
    if throttle is None:
        if any(c.get("type") == CONDITION for c in previous):
            return Check(CONDITION, "Unknown", "NotChecked", "the rate limit could not be read from Redis")
        return None
    if throttle.limit is None and throttle.held_for <= 0:
        return None
    waiting = f"{throttle.waiting} waiting"
    if throttle.holding_back and throttle.held_for > 0:
        return Check(CONDITION, "True", "StartsHeld",
                     f"{waiting}: a handler held the queue's starts for {throttle.held_for:.1f}s more "
                     "(its downstream service asked to slow down)")
    if throttle.holding_back and throttle.limit is not None:
        return Check(CONDITION, "True", "LimitReached",
                     f"{waiting}: the rate limit of {describe_limit(throttle.limit)} is reached "
                     f"({throttle.window_starts} started in the last {throttle.limit[1]:g}s)")
    said = f"the rate limit of {describe_limit(throttle.limit)}" if throttle.limit else "the rate limit"
    return Check(CONDITION, "False", "BelowLimit", f"starts are below {said}")


def group_check(stats: Any, previous: Iterable[dict[str, Any]] = ()) -> Check | None:
    """The GroupCapped condition (from effectmq.QueueStats): none for a queue that never had
    a group cap or pause; Unknown when Redis could not be read and the Queue has the
    condition (its last verdict is stale)."""
    if stats is None:
        if any(c.get("type") == GROUP_CONDITION for c in previous):
            return Check(GROUP_CONDITION, "Unknown", "NotChecked", "the parked tasks could not be read from Redis")
        return None
    parked = stats.parked
    if parked > 0:
        return Check(GROUP_CONDITION, "True", "TasksParked",
                     f"{parked} of {stats.waiting + parked} waiting tasks wait for their group's cap, rate limit or "
                     "resume; more replicas would not start them")
    if stats.group_caps:
        return Check(GROUP_CONDITION, "False", "NoneParked", "no waiting task is held back by its group's cap or pause")
    return None
