"""Backlog scaling: how many worker replicas a queue needs (pure, no I/O).

Used by the operator for Deployments and by the local runner for processes.

  demand   = ready backlog (waiting) + in-flight (active)
  target   = ceil(demand / targetTasksPerReplica), clamped to [min, max]
  0 -> 1   only when waiting >= activationTasks
  up       at once, but at most max(2x, +4) replicas per decision
  down     to the highest target seen during scaleDownStabilizationSeconds
  -> 0     only after demand stayed 0 for cooldownSeconds
  never    below the replicas in-flight work needs: ceil(active / concurrency), and
           the number of worker processes that still hold leases
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
    concurrency: int = 10  # attempts per replica: how many replicas in-flight work occupies

    @classmethod
    def from_crd(cls, scaling: dict, concurrency: int) -> "ScalingSpec":
        return cls(
            min_replicas=int(scaling.get("minReplicas", 0)),
            max_replicas=int(scaling.get("maxReplicas", 10)),
            target_tasks_per_replica=max(1, int(scaling.get("targetTasksPerReplica", 50))),
            activation_tasks=int(scaling.get("activationTasks", 1)),
            poll_interval=float(scaling.get("pollIntervalSeconds", 10)),
            scale_down_stabilization=float(scaling.get("scaleDownStabilizationSeconds", 300)),
            cooldown=float(scaling.get("cooldownSeconds", 300)),
            concurrency=max(1, int(concurrency)),
        )


@dataclass(frozen=True)
class Observation:
    waiting: int
    active: int
    current_replicas: int
    busy_workers: int = 0  # worker processes that announced attempts in flight


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

    @property
    def changed(self) -> bool:
        return self.reason.startswith("scale")


def max_step_up(current: int) -> int:
    """Largest replica count one decision may scale up to (HPA's default policy)."""
    return max(current * 2, current + 4)


def decide(spec: ScalingSpec, seen: Observation, state: ScalingState, now: float) -> Decision:
    current = seen.current_replicas
    demand = seen.waiting + seen.active
    last_demand_at = now if demand > 0 else state.last_demand_at
    in_flight_floor = max(math.ceil(seen.active / spec.concurrency), seen.busy_workers)
    lo, hi = spec.min_replicas, max(spec.min_replicas, spec.max_replicas)

    target = math.ceil(demand / spec.target_tasks_per_replica)
    why = f"{demand} tasks ({seen.waiting} waiting + {seen.active} active) / {spec.target_tasks_per_replica} per replica"
    if current == 0 and target > 0 and seen.active == 0 and seen.waiting < spec.activation_tasks:
        target, why = 0, f"{seen.waiting} waiting is below the activation threshold of {spec.activation_tasks}"
    target = min(max(target, lo, in_flight_floor), hi)

    # Keep the recommendations of the stabilization window; scale down to their max.
    window_start = now - spec.scale_down_stabilization
    known = state.recommendations or ((now, current),)  # no history yet: the current size counts
    history = tuple((t, r) for t, r in known if t > window_start) + ((now, target),)
    stable = max(r for _, r in history)

    if target > current:
        replicas = min(target, max_step_up(current), hi)
        reason = f"scale up to {replicas}: {why}"
        if replicas < target:
            reason += f" (step limited, target {target})"
    elif stable < current:
        replicas = stable
        if replicas == 0 and last_demand_at is not None and now - last_demand_at < spec.cooldown:
            replicas = 1  # idle, but not yet for the whole cooldown
        if replicas < current:
            reason = f"scale down to {replicas}: {why}, stable for {spec.scale_down_stabilization:g}s"
            if replicas == 0:
                reason = f"scale to zero: no tasks for {spec.cooldown:g}s"
        else:
            reason = f"hold at {current}: idle for less than the {spec.cooldown:g}s cooldown"
    else:
        replicas = current
        reason = f"hold at {current}: {why}"
        if target < current:
            reason += f"; scale down waits for the {spec.scale_down_stabilization:g}s stabilization window"
    replicas = min(max(replicas, lo), hi)
    new_state = ScalingState(history, last_demand_at, now if replicas != current else state.last_scale_at)
    return Decision(replicas, reason, new_state)


def restore_state(last_scale_at: float | None, now: float, current: int) -> ScalingState:
    """State after an operator restart: assume demand just now, so nothing scales
    down (or to zero) before a full window of fresh observations."""
    return replace(ScalingState(), recommendations=((now, current),), last_demand_at=now if current else None,
                   last_scale_at=last_scale_at)
