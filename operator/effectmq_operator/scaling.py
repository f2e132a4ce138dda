"""Backlog scaling: how many worker replicas a queue needs (pure, no I/O).

Used by the operator for Deployments and by the local runner for processes.

  demand   = ready backlog (waiting) + in-flight (active); tasks parked by their group's cap
           or pause are not in it: they start only as their group's attempts end (or it
           resumes), whatever the replicas
  target   = ceil(demand / targetTasksPerReplica), clamped to [min, max]
  0 -> 1   only when waiting >= activationTasks
  up       at once, but at most max(2x, +4) replicas per decision
  down     to the highest target seen during scaleDownStabilizationSeconds
  -> 0     only after demand stayed 0 for cooldownSeconds
  never    below the replicas in-flight work needs: ceil(active / leases per replica), and
           the number of worker processes that still hold leases
  paused   down to minReplicas at once (busy workers are kept until they drain)
  cap      never above maxReplicas, nor ceil(maxActive / leases per replica) when maxActive is set
  rate     while the queue's rate limit holds the backlog back, only the replicas its attempts
           in flight occupy, plus one: the limit lets no more run at once (starts per second
           times seconds per attempt), so more pods would only wait for it; with a rate limit
           but no attempt in flight yet, one replica (what the limit allows is unknown); and
           up one replica a decision, however large the backlog
  reason   describes the final decision, after every clamp, naming the bound that decided it
           (paused, maxReplicas, maxActive, minReplicas, work in flight) before the backlog
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class ScalingSpec:
    min_replicas: int = 0
    max_replicas: int = 10
    target_tasks_per_replica: int = 50
    activation_tasks: int = 1
    poll_interval: float = 10.0
    scale_down_stabilization: float = 300.0
    cooldown: float = 300.0
    # leases per replica (its concurrency and prefetch): how many replicas in-flight work occupies
    concurrency: int = 10
    paused: bool = False  # a paused queue needs only minReplicas (busy workers are kept until they drain)
    replica_cap: int | None = None  # from maxActive: more replicas than this would only idle
    has_rate_limit: bool = False  # the queue limits its starts per period (spec.rateLimit)

    @property
    def upper(self) -> int:
        hi = max(self.min_replicas, self.max_replicas)
        return hi if self.replica_cap is None else min(hi, self.replica_cap)

    @property
    def lower(self) -> int:
        return min(self.min_replicas, self.upper)


@dataclass(frozen=True)
class Observation:
    waiting: int
    active: int
    current_replicas: int
    busy_workers: int = 0  # worker processes that announced attempts in flight
    rate_limited: bool = False  # the queue's rate limit held starts back when this was read


@dataclass(frozen=True)
class ScalingState:
    """What a decision remembers: recent targets and when demand was last seen."""

    recommendations: tuple[tuple[float, int], ...] = ()
    last_demand_at: float | None = None
    last_scale_at: float | None = None


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    state: ScalingState = field(default_factory=ScalingState)


def max_step_up(current: int) -> int:
    """Largest replica count one decision may scale up to (HPA's default policy)."""
    return max(current * 2, current + 4)


def decide(spec: ScalingSpec, seen: Observation, state: ScalingState, now: float) -> Decision:
    current = seen.current_replicas
    demand = seen.waiting + seen.active
    last_demand_at = now if demand > 0 else state.last_demand_at
    in_flight_floor = max(math.ceil(seen.active / spec.concurrency), seen.busy_workers)
    lo, hi = spec.lower, spec.upper

    if spec.paused:
        wanted, why = lo, "queue paused"
    else:
        wanted = math.ceil(demand / spec.target_tasks_per_replica)
        why = (f"{demand} tasks ({seen.waiting} waiting + {seen.active} active) / "
               f"{spec.target_tasks_per_replica} per replica")
        if current == 0 and wanted > 0 and seen.active == 0 and seen.waiting < spec.activation_tasks:
            wanted, why = 0, f"{seen.waiting} waiting is below the activation threshold of {spec.activation_tasks}"
        usable = math.ceil(seen.active / spec.concurrency) + 1
        if spec.has_rate_limit and seen.active == 0 and wanted > 1:
            wanted, why = 1, (f"{seen.waiting} waiting under a rate limit: one replica until attempts show what "
                              "it allows")
        elif seen.rate_limited and usable < wanted:
            wanted, why = usable, (f"the rate limit holds {seen.waiting} waiting back: its {seen.active} attempts in "
                                   f"flight fill {usable - 1} {'replica' if usable == 2 else 'replicas'}, plus one")
    floored = max(wanted, lo, in_flight_floor)
    target = min(floored, hi)

    # Keep the recommendations of the stabilization window; scale down to their max.
    window_start = now - spec.scale_down_stabilization
    known = state.recommendations or ((now, current),)  # no history yet: the current size counts
    history = tuple((t, r) for t, r in known if t > window_start) + ((now, target),)
    stable = target if spec.paused else min(max(r for _, r in history), hi)

    waiting_for = ""
    if target > current:
        # Under a rate limit, one more at a time: how much of the limit the pods use shows
        # only once they run (a pod just started has started few tasks in the window yet).
        replicas = min(target, current + 1 if spec.has_rate_limit else max_step_up(current))
    elif stable < current:
        replicas = stable
        if (replicas == 0 and hi > 0 and last_demand_at is not None and now - last_demand_at < spec.cooldown
                and not spec.paused):
            replicas = 1  # idle, but not yet for the whole cooldown
            waiting_for = f"idle for less than the {spec.cooldown:g}s cooldown"
    else:
        replicas = current
        if target < current:
            waiting_for = f"scale down waits for the {spec.scale_down_stabilization:g}s stabilization window"
    replicas = min(max(replicas, lo), hi)
    reason = _reason(spec, current, replicas, target, wanted, floored, in_flight_floor, why, waiting_for)
    new_state = ScalingState(history, last_demand_at, now if replicas != current else state.last_scale_at)
    return Decision(replicas, reason, new_state)


def _cap_name(spec: ScalingSpec) -> str:
    """Which bound sets `upper`: maxActive (through the leases per replica) or maxReplicas."""
    by_max_active = spec.replica_cap is not None and spec.replica_cap < max(spec.min_replicas, spec.max_replicas)
    return "maxActive / concurrency" if by_max_active else "maxReplicas"


def _reason(spec: ScalingSpec, current: int, replicas: int, target: int, wanted: int, floored: int,
            in_flight_floor: int, why: str, waiting_for: str) -> str:
    """Describe the final decision (after every clamp), so Events say what was done and
    which bound decided it: paused, maxReplicas or maxActive (a cap), minReplicas (a
    floor), work in flight, or else the backlog itself (`why`)."""
    lo, hi = spec.lower, spec.upper
    if replicas > current:
        head = f"scale up to {replicas}"
    elif replicas < current:
        head = "scale to zero" if replicas == 0 else f"scale down to {replicas}"
    else:
        head = f"hold at {current}"
    notes = []
    if spec.paused:
        cause = why
        if replicas == lo and lo > 0 and lo >= in_flight_floor:
            notes.append(f"minReplicas is {lo}")
    elif floored > hi and replicas == hi:
        # a cap decided: more would be wanted (by the backlog, minReplicas or work in flight)
        cause = f"capped at {hi} by {_cap_name(spec)}" + (f" ({why})" if wanted > hi else "")
    elif replicas == lo and lo > max(wanted, in_flight_floor):
        cause = f"minReplicas is {lo} (the backlog alone needs {wanted}: {why})"
    elif replicas == 0 and current > 0 and wanted == 0 and not waiting_for:
        cause = f"no tasks for {spec.cooldown:g}s"
    else:
        cause = why
    if replicas > current and replicas < target:
        notes.append(f"step limited, target {target}")
    if in_flight_floor > max(wanted, lo) and replicas == in_flight_floor and not (floored > hi and replicas == hi):
        notes.append(f"{in_flight_floor} kept for work in flight")
    if waiting_for:
        notes.append(waiting_for)
    return f"{head}: {cause}" + "".join(f"; {n}" for n in notes)


def restore_state(last_scale_at: float | None, now: float, current: int) -> ScalingState:
    """State after an operator restart: assume demand just now, so nothing scales
    down (or to zero) before a full window of fresh observations."""
    return replace(ScalingState(), recommendations=((now, current),), last_demand_at=now if current else None,
                   last_scale_at=last_scale_at)
