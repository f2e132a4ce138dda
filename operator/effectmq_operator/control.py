"""The control core of a Queue: observed facts in, decisions out (pure, no I/O).

Used by the operator (worker Deployments) and by `effectmq local` (worker
processes): the drivers read, call these functions and write.

- `scale` decides the replica count (backlog scaling honouring paused/maxActive);
- `plan` turns the facts of one reconcile (spec, Redis, the Deployment as it is
  after this reconcile's apply) into the status, the Events and pod costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping

from . import builders, scaling
from .spec import QueueSpec
from .status import Check, Event, Problem, conditions, now_iso, problem_event


@dataclass(frozen=True)
class DeploymentFacts:
    """What the worker Deployment says about its rollout."""

    generation: int
    observed_generation: int
    replicas: int  # spec.replicas
    updated: int
    available: int
    ready: int
    current: int  # status.replicas
    progress_failure: str | None = None  # message of Progressing=False ProgressDeadlineExceeded

    @classmethod
    def of(cls, deployment: Mapping[str, Any]) -> "DeploymentFacts":
        status = deployment.get("status") or {}
        failure = next((c.get("message") or "progress deadline exceeded" for c in status.get("conditions") or []
                        if c.get("type") == "Progressing" and c.get("status") == "False"
                        and c.get("reason") == "ProgressDeadlineExceeded"), None)
        return cls(
            generation=int(deployment["metadata"].get("generation") or 0),
            observed_generation=int(status.get("observedGeneration") or 0),
            replicas=int((deployment.get("spec") or {}).get("replicas") or 0),
            updated=int(status.get("updatedReplicas") or 0), available=int(status.get("availableReplicas") or 0),
            ready=int(status.get("readyReplicas") or 0), current=int(status.get("replicas") or 0),
            progress_failure=failure,
        )

    @property
    def rolled_out(self) -> bool:
        """The controller saw the latest spec and every wanted replica is updated and available."""
        return (self.observed_generation >= self.generation and self.updated >= self.replicas
                and self.available >= self.replicas and self.current <= self.replicas)


@dataclass(frozen=True)
class QueueFacts:
    """Everything one reconcile observed. A problem stops the checks after it."""

    spec_problem: Problem | None = None
    redis_problem: Problem | None = None
    write_problem: Problem | None = None  # Redis answers but refuses new writes (offers); NotChecked: cannot tell
    stats: Any = None  # effectmq.QueueStats when Redis answered
    has_worker: bool = True
    deployment: DeploymentFacts | None = None
    apply_problem: Problem | None = None


# Backlog figures change on every poll of a busy queue; written alone, at most this often
# (a status write per Queue per poll would be most of the API server's traffic). A queue
# that drained or got work says so sooner: "0 waiting" read a minute late misleads.
FIGURES = frozenset({"backlog", "oldestWaitingSeconds"})
FIGURES_EVERY = 60.0
FIGURES_SOON = 10.0  # seconds since the last write; bounds a queue that flaps between the two
PENDING = ("waiting", "delayed", "active")


NOT_CHECKED = "NotChecked"  # the reason of a check that could not be made (status Unknown)
IN_PROGRESS = frozenset({"RollingOut", "DeploymentMissing"})  # not Ready yet, but nothing to warn about


def needs_write(live: Mapping[str, Any], new: Mapping[str, Any], figures_age: float | None) -> bool:
    """Whether a computed status must be written: anything but the figures changed, or the
    figures changed and were last written `figures_age` seconds ago (None: never), at
    least FIGURES_EVERY, or FIGURES_SOON when the queue went from idle to busy or back."""
    changed = {k for k, v in new.items() if live.get(k) != v}
    if changed - FIGURES:
        return True
    if not changed:
        return False
    if figures_age is None or figures_age >= FIGURES_EVERY:
        return True
    return figures_age >= FIGURES_SOON and _idle(live) != _idle(new)


def _idle(status: Mapping[str, Any]) -> bool:
    """No task waiting, delayed or running, by these figures."""
    backlog = status.get("backlog") or {}
    return not any(backlog.get(state) for state in PENDING)


@dataclass(frozen=True)
class Plan:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)


def scale(spec: QueueSpec, stats: Any, workers: Mapping[str, tuple[int, int]], current: int,
          state: scaling.ScalingState, now: float) -> scaling.Decision:
    """Replicas for a queue from its backlog and the workers that hold leases."""
    busy = sum(1 for in_flight, _ in workers.values() if in_flight > 0)
    return scaling.decide(spec.scaling, scaling.Observation(stats.waiting, stats.active, current, busy), state, now)


def foreign_spec_edits(deployment: Mapping[str, Any]) -> list[str]:
    """Field managers other than the operator that own fields of the Deployment's spec
    (kubectl edit, set image, scale...): after a restart they show drift that the
    operator did not see happen. Status writers (the deployment controller) do not count."""
    return [m.get("manager", "?") for m in deployment["metadata"].get("managedFields") or []
            if m.get("manager") != builders.FIELD_MANAGER and m.get("subresource") != "status"
            and "f:spec" in (m.get("fieldsV1") or {})]


def needs_apply(live: Mapping[str, Any] | None, desired: Mapping[str, Any], applied_generation: int | None) -> bool:
    """Whether the worker Deployment must be applied: missing, another spec or replica
    count than desired, or edited by someone else since our last apply (a generation we
    did not make; when we made none yet in this term, fields owned by another manager)."""
    if live is None:
        return True
    annotations = live["metadata"].get("annotations") or {}
    if (annotations.get(builders.SPEC_HASH) != desired["metadata"]["annotations"][builders.SPEC_HASH]
            or live["spec"].get("replicas") != desired["spec"]["replicas"]):
        return True
    if applied_generation is None:
        return bool(foreign_spec_edits(live))
    return live["metadata"].get("generation") != applied_generation


def pod_costs(workers: Mapping[str, tuple[int, int]], pods: list[str]) -> dict[str, str]:
    """pod-deletion-cost per pod: its attempts in flight, so a scale-in removes idle pods first."""
    return {pod: str(workers.get(pod, (0, 0))[0]) for pod in pods}


def _workers_check(facts: QueueFacts) -> tuple[Check, Problem | None]:
    if not facts.has_worker:
        return Check.of("WorkersDeployed", True, "NoWorkers", "spec.worker is not set: the operator runs no Deployment"), None
    if facts.apply_problem is not None:
        p = facts.apply_problem
        return Check.of("WorkersDeployed", False, p.reason, p.message), p
    d = facts.deployment
    if d is None:
        p = Problem("DeploymentMissing", "the worker Deployment does not exist yet")
        return Check.of("WorkersDeployed", False, p.reason, p.message), p
    if d.progress_failure is not None:
        p = Problem("ProgressDeadlineExceeded", f"the worker rollout failed: {d.progress_failure}", permanent=True)
        return Check.of("WorkersDeployed", False, p.reason, p.message), p
    if d.rolled_out:
        message = "scaled to zero" if d.replicas == 0 else f"{d.available} of {d.replicas} replicas available"
        return Check.of("WorkersDeployed", True, "Available", message), None
    p = Problem("RollingOut", f"{d.updated} of {d.replicas} replicas updated, {d.available} available")
    return Check.of("WorkersDeployed", False, p.reason, p.message), p


def plan(facts: QueueFacts, *, generation: int | None, previous: Mapping[str, Any],
         decision: scaling.Decision | None, replicas_before: int | None, now: datetime | None = None) -> Plan:
    """The Queue's status and Events after one reconcile. `previous` is the live status."""
    prev_conditions = previous.get("conditions") or []
    problem = facts.spec_problem
    checks: list[Check] = []
    if problem is not None:
        checks = [Check("RedisReachable", "Unknown", NOT_CHECKED, "the spec is invalid"),
                  Check("AcceptingTasks", "Unknown", NOT_CHECKED, "the spec is invalid"),
                  Check("WorkersDeployed", "Unknown", NOT_CHECKED, "the spec is invalid")]
    else:
        if facts.redis_problem is not None:
            checks.append(Check.of("RedisReachable", False, facts.redis_problem.reason, facts.redis_problem.message))
            checks.append(Check("AcceptingTasks", "Unknown", NOT_CHECKED, "Redis is not reachable"))
            problem = facts.redis_problem
        else:
            checks.append(Check.of("RedisReachable", True, "Connected", "queue settings written to Redis"))
            p = facts.write_problem
            if p is not None and p.reason == NOT_CHECKED:  # an ACL that forbids the probe
                checks.append(Check("AcceptingTasks", "Unknown", p.reason, p.message))
            elif p is not None:
                checks.append(Check.of("AcceptingTasks", False, p.reason, p.message))
                problem = p
            else:
                checks.append(Check.of("AcceptingTasks", True, "Accepting", "Redis takes new tasks"))
        workers, workers_problem = _workers_check(facts)
        checks.append(workers)
        if workers_problem is not None and (problem is None or (workers_problem.permanent and not problem.permanent)):
            problem = workers_problem
    status: dict[str, Any] = {k: v for k, v in previous.items() if k in (
        "backlog", "oldestWaitingSeconds", "lastScaleTime", "lastScaleReason", "desiredReplicas")}
    status["observedGeneration"] = generation
    status["conditions"] = conditions(checks, problem, generation, prev_conditions, now)
    if facts.stats is not None:
        s = facts.stats
        status["backlog"] = {"waiting": s.waiting, "delayed": s.delayed, "active": s.active, "failed": s.failed,
                             "completed": s.completed}
        status["oldestWaitingSeconds"] = round(s.oldest_waiting_seconds, 3)
    d = facts.deployment
    status["replicas"] = d.current if d else 0
    status["readyReplicas"] = d.ready if d else 0
    events: list[Event] = []
    if decision is not None:
        status["desiredReplicas"] = decision.replicas
        if replicas_before is not None and decision.replicas != replicas_before:
            status["lastScaleTime"] = now_iso(now)
            status["lastScaleReason"] = decision.reason
            events.append(Event("Normal", "Scaled", decision.reason))
    warning = problem_event(problem, prev_conditions)
    if warning is not None and warning.reason not in IN_PROGRESS:
        events.append(warning)
    return Plan(status, events)
