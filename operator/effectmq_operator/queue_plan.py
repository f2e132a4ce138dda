"""The control core of a Queue: observed facts in, decisions out (pure, no I/O).

Used by the operator (worker Deployments) and by `effectmq local` (worker
processes): the drivers read, call these functions and write.

- `scale` decides the replica count (backlog scaling honouring paused/maxActive);
- `plan` turns the facts of one reconcile (spec, Redis, the Deployment as it is
  after this reconcile's apply, and its pods while it is not available) into the
  status, the Events and pod costs;
- `judge_pods` reads the kubelet's reports on the worker pods of the current template
  (crash loops, image pulls, readiness), so a scale-up that never comes up is Stalled
  although the Deployment controller judges only rollouts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping

from . import api, builders, scaling, stalls, throttling
from .api import Event
from .spec import QueueSpec
from .status import Check, Problem, conditions, now_iso, problem_event


# The Deployment controller names its new ReplicaSet in the Progressing condition's message:
# 'Created new replica set "x"', 'Found new replica set "x"', 'ReplicaSet "x" is progressing.',
# '... has successfully progressed.', '... has timed out progressing.'
NEW_REPLICA_SET = re.compile(r'[Rr]eplica ?[Ss]et "([^"]+)"')


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
    new_replica_set: str | None = None  # the ReplicaSet of the current template, as Progressing names it
    progress_deadline: float = 600.0  # spec.progressDeadlineSeconds
    progressing_reason: str | None = None

    @classmethod
    def of(cls, deployment: Mapping[str, Any]) -> "DeploymentFacts":
        status = deployment.get("status") or {}
        spec = deployment.get("spec") or {}
        progressing: Mapping[str, Any] = next(
            (c for c in status.get("conditions") or [] if c.get("type") == "Progressing"), {})
        failure = None
        if progressing.get("status") == "False" and progressing.get("reason") == "ProgressDeadlineExceeded":
            failure = progressing.get("message") or "progress deadline exceeded"
        named = NEW_REPLICA_SET.search(progressing.get("message") or "")
        return cls(
            generation=int(deployment["metadata"].get("generation") or 0),
            observed_generation=int(status.get("observedGeneration") or 0),
            replicas=int(spec.get("replicas") or 0),
            updated=int(status.get("updatedReplicas") or 0), available=int(status.get("availableReplicas") or 0),
            ready=int(status.get("readyReplicas") or 0), current=int(status.get("replicas") or 0),
            progress_failure=failure, new_replica_set=named.group(1) if named else None,
            progress_deadline=float(spec.get("progressDeadlineSeconds") or 600),
            progressing_reason=progressing.get("reason"),
        )

    @property
    def rolled_out(self) -> bool:
        """The controller saw the latest spec and every wanted replica is updated and available."""
        return (self.observed_generation >= self.generation and self.updated >= self.replicas
                and self.available >= self.replicas and self.current <= self.replicas)

    @property
    def controller_times_out(self) -> bool:
        """Whether the Deployment controller holds this rollout to the progress deadline
        itself. After a completed rollout it does not (a scale-up with the same template
        is not a rollout: no ProgressDeadlineExceeded ever comes); then the operator does."""
        return self.progressing_reason not in (None, "NewReplicaSetAvailable")

    @property
    def current_replica_set(self) -> str | None:
        """The ReplicaSet of the current template, when the controller has seen that template."""
        return self.new_replica_set if self.observed_generation >= self.generation else None


# -- worker pods: what the kubelet says about them ------------------------------------

RESTART_LIMIT = 3  # restarts of a worker container, not ready meanwhile, before a crash loop is Stalled
CRASH_UNREADY = 30.0  # ...and not ready for this long (a long-lived pod's one crash is not a loop)
# Seconds of failed image pulls (about three at the kubelet's back-off), or of a container
# that cannot be created, before Stalled.
START_FAILURE_LIMIT = 90.0
START_GRACE = 30.0  # seconds a running worker may take to pass its first readiness probe
IMAGE_PULL = frozenset({"ErrImagePull", "ImagePullBackOff", "RegistryUnavailable", "InvalidImageName",
                        "ErrImageNeverPull", "SignatureValidationFailed"})
NEVER_HEALS = frozenset({"InvalidImageName", "ErrImageNeverPull"})  # nothing a retry can change
CRASHING = frozenset({"CrashLoopBackOff", "RunContainerError"})
STARTING = frozenset({"ContainerCreating", "PodInitializing"})
WORKER_CONTAINER = "worker"


def _epoch(stamp: Any) -> float | None:
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def last_line(text: str | None, limit: int = 300) -> str:
    """The last non-empty line of a termination message or log tail (a traceback's last
    line is the exception), shortened."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


@dataclass(frozen=True)
class PodFacts:
    """What one worker pod's status says (the kubelet's view), for judging the workers."""

    name: str
    replica_set: str | None = None  # its owner
    created: float | None = None  # epoch seconds
    deleting: bool = False
    phase: str = "Pending"
    ready: bool = False
    unready_since: float | None = None  # the Ready condition's last transition, while not ready
    unschedulable: str | None = None  # PodScheduled=False's message
    restarts: int = 0  # of the worker container
    waiting: tuple[str, str] | None = None  # (reason, message) of a waiting worker container
    running_since: float | None = None
    last_exit: tuple[int | None, str, str] | None = None  # (exit code, reason, message) of its last termination

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> "PodFacts":
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        owner = next((o.get("name") for o in meta.get("ownerReferences") or [] if o.get("kind") == "ReplicaSet"), None)
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        ready_condition = conditions.get("Ready") or {}
        ready = ready_condition.get("status") == "True"
        scheduled = conditions.get("PodScheduled") or {}
        statuses = status.get("containerStatuses") or []
        container = next((c for c in statuses if c.get("name") == WORKER_CONTAINER), statuses[0] if statuses else {})
        state, last = container.get("state") or {}, container.get("lastState") or {}
        waiting = state.get("waiting")
        terminated = state.get("terminated") or last.get("terminated")
        return cls(
            name=str(meta.get("name") or "?"), replica_set=owner, created=_epoch(meta.get("creationTimestamp")),
            deleting=bool(meta.get("deletionTimestamp")), phase=str(status.get("phase") or "Pending"), ready=ready,
            unready_since=None if ready else _epoch(ready_condition.get("lastTransitionTime")),
            unschedulable=(scheduled.get("message") or "unschedulable") if scheduled.get("status") == "False" else None,
            restarts=int(container.get("restartCount") or 0),
            waiting=(str(waiting.get("reason") or "Waiting"), str(waiting.get("message") or "")) if waiting else None,
            running_since=_epoch((state.get("running") or {}).get("startedAt")),
            last_exit=(terminated.get("exitCode"), str(terminated.get("reason") or ""),
                       str(terminated.get("message") or "")) if terminated else None,
        )

    def describe_exit(self) -> str:
        if self.last_exit is None:
            return "exited"
        code, reason, message = self.last_exit
        text = f"exit code {code}" + (f", {reason}" if reason else "")
        line = last_line(message)
        return f"{text}: {line}" if line else text


@dataclass(frozen=True)
class WorkerPods:
    """The worker pods' verdict: how many of the current template are available, and the
    first trouble found among them (None: they are starting, or all fine)."""

    known: bool  # the pods of the current template could be told apart from older ones
    available: int = 0  # ready pods of the current template
    total: int = 0  # pods of the current template (not terminating)
    old_available: int = 0  # ready pods of earlier templates, still serving
    problem: Problem | None = None


# Order of the troubles, most telling first (a permanent one wins over any transient one).
TROUBLE_ORDER = ("WorkersCrashLooping", "ImagePullFailed", "WorkerContainerFailed", "WorkersUnschedulable",
                 "WorkersCannotReachRedis", "ProgressDeadlineExceeded")


def pod_trouble(pod: PodFacts, now: float, deadline: float, redis_reachable: bool) -> Problem | None:
    """What keeps one not-ready pod of the current template from serving (None: starting)."""
    since = pod.unready_since or pod.created or now
    unready_for = max(0.0, now - since)
    age = max(0.0, now - (pod.created or now))
    over_deadline = unready_for >= deadline
    who = f"worker pod {pod.name}"
    reason, message = pod.waiting or ("", "")
    if reason in IMAGE_PULL:
        detail = f"{reason}: {message}" if message else reason
        return Problem("ImagePullFailed", f"{who} cannot pull its image ({detail})",
                       permanent=reason in NEVER_HEALS or age >= min(START_FAILURE_LIMIT, deadline))
    restarted_lately = pod.restarts > 0 and pod.last_exit is not None and (
        pod.running_since is None or now - pod.running_since < START_GRACE)  # between two crashes, or waiting
    if reason in CRASHING or restarted_lately:
        stalled = (pod.restarts >= RESTART_LIMIT and unready_for >= CRASH_UNREADY) or over_deadline
        if stalled and pod.restarts >= RESTART_LIMIT:
            restarts = f"{RESTART_LIMIT} times or more"  # the same message on every further restart
        else:
            restarts = f"{pod.restarts} time{'s' if pod.restarts != 1 else ''}"
        return Problem("WorkersCrashLooping", f"{who} keeps exiting ({pod.describe_exit()}); restarted {restarts}",
                       permanent=stalled)
    if reason and reason not in STARTING:  # CreateContainerConfigError (a missing Secret key), CreateContainerError...
        detail = f"{reason}: {message}" if message else reason
        return Problem("WorkerContainerFailed", f"{who} cannot start its container ({detail})",
                       permanent=age >= min(START_FAILURE_LIMIT, deadline))
    if pod.unschedulable is not None:
        return Problem("WorkersUnschedulable", f"{who} cannot be scheduled: {pod.unschedulable}",
                       permanent=over_deadline)
    if pod.running_since is not None and now - pod.running_since >= START_GRACE:
        # A running worker is ready exactly while its last Redis call worked (/readyz).
        return Problem("WorkersCannotReachRedis",
                       f"{who} runs but is not ready: its readiness probe fails while its last Redis call "
                       f"failed (the operator itself reaches Redis; check the network path from the pods)"
                       if redis_reachable else f"{who} runs but is not ready: it cannot reach Redis either",
                       permanent=over_deadline and redis_reachable)
    if over_deadline:
        return Problem("ProgressDeadlineExceeded",
                       f"{who} has not become available within the {deadline:g}s progress deadline of a "
                       f"scale-up ({pod.phase})", permanent=True)
    return None


def judge_pods(d: DeploymentFacts, pods: list[PodFacts] | None, now: float, redis_reachable: bool = True) -> WorkerPods:
    """The pods of the Deployment's current template (by their ReplicaSet), and the first
    trouble among those not ready. Pods of earlier templates never count as available for
    the current one; a failing earlier pod is not the current template's problem."""
    current_rs = d.current_replica_set
    if pods is None or current_rs is None:
        return WorkerPods(known=False)
    live = [p for p in pods if not p.deleting and p.phase not in ("Succeeded", "Failed")]
    current = sorted((p for p in live if p.replica_set == current_rs), key=lambda p: p.name)
    # A rollout's deadline is the Deployment controller's to judge (its ProgressDeadlineExceeded);
    # a scale-up's is the operator's, as that controller never judges it.
    deadline = float("inf") if d.controller_times_out else d.progress_deadline
    troubles = [t for p in current if not p.ready
                if (t := pod_trouble(p, now, deadline, redis_reachable)) is not None]
    troubles.sort(key=lambda t: (not t.permanent, TROUBLE_ORDER.index(t.reason)))
    return WorkerPods(known=True, available=sum(p.ready for p in current), total=len(current),
                      old_available=sum(p.ready for p in live if p.replica_set != current_rs),
                      problem=troubles[0] if troubles else None)


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
    pods: tuple[PodFacts, ...] | None = None  # the worker pods, listed while the Deployment is not available
    stalls: Mapping[str, int] | None = None  # stalls of the last stalls.WINDOW_SECONDS by cause (None: not read)


# Backlog figures change on every poll of a busy queue; written alone, at most this often
# (a status write per Queue per poll would be most of the API server's traffic). A queue
# that drained or got work says so sooner: "0 waiting" read a minute late misleads.
FIGURES = frozenset({"backlog", "oldestWaitingSeconds"})
FIGURES_EVERY = 60.0
FIGURES_SOON = 10.0  # seconds since the last write; bounds a queue that flaps between the two
# When the backlog was last read: carried along with any other write, and written on its
# own only this often (every idle Queue writing it per poll would be most of the traffic).
POLL_TIME = "lastPollTime"
POLL_TIME_EVERY = 300.0
PENDING = ("waiting", "delayed", "active", "parked")


NOT_CHECKED = "NotChecked"  # the reason of a check that could not be made (status Unknown)
IN_PROGRESS = frozenset({"RollingOut", "DeploymentMissing"})  # not Ready yet, but nothing to warn about


def needs_write(live: Mapping[str, Any], new: Mapping[str, Any], figures_age: float | None) -> bool:
    """Whether a computed status must be written: anything but the figures changed, or the
    figures changed and were last written `figures_age` seconds ago (None: never), at
    least FIGURES_EVERY, or FIGURES_SOON when the queue went from idle to busy or back."""
    changed = {k for k, v in new.items() if live.get(k) != v}
    if changed - FIGURES - {POLL_TIME}:
        return True
    if not changed:
        return False
    if figures_age is None:
        return True
    if not changed & FIGURES:  # only the poll time moved
        return figures_age >= POLL_TIME_EVERY
    if figures_age >= FIGURES_EVERY:
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
    held_back = throttling.Throttle.of(stats).holding_back
    return scaling.decide(spec.scaling, scaling.Observation(stats.waiting, stats.active, current, busy, held_back),
                          state, now)


def foreign_spec_edits(deployment: Mapping[str, Any]) -> list[str]:
    """Field managers other than the operator that own fields of the Deployment's spec
    (kubectl edit, set image, scale...): after a restart they show drift that the
    operator did not see happen. Status writers (the deployment controller) do not count."""
    return [m.get("manager", "?") for m in deployment["metadata"].get("managedFields") or []
            if m.get("manager") != api.FIELD_MANAGER and m.get("subresource") != "status"
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
    generation: int | None = live["metadata"].get("generation")
    return generation != applied_generation


def pod_costs(workers: Mapping[str, tuple[int, int]], pods: list[str]) -> dict[str, str]:
    """pod-deletion-cost per pod: its attempts in flight, so a scale-in removes idle pods first."""
    return {pod: str(workers.get(pod, (0, 0))[0]) for pod in pods}


def _workers_check(facts: QueueFacts, now: float) -> tuple[Check, Problem | None]:
    if not facts.has_worker:
        return Check.of("WorkersDeployed", True, "NoWorkers",
                        "spec.worker is not set: the operator runs no Deployment"), None
    if facts.apply_problem is not None:
        p = facts.apply_problem
        return Check.of("WorkersDeployed", False, p.reason, p.message), p
    d = facts.deployment
    if d is None:
        p = Problem("DeploymentMissing", "the worker Deployment does not exist yet")
        return Check.of("WorkersDeployed", False, p.reason, p.message), p
    pods = judge_pods(d, list(facts.pods) if facts.pods is not None else None, now,
                      redis_reachable=facts.redis_problem is None)
    if d.progress_failure is not None:
        detail = f"; {pods.problem.message}" if pods.problem is not None else ""
        p = Problem("ProgressDeadlineExceeded", f"the worker rollout failed: {d.progress_failure}{detail}",
                    permanent=True)
        return Check.of("WorkersDeployed", False, p.reason, p.message), p
    if d.rolled_out:
        message = "scaled to zero" if d.replicas == 0 else f"{d.available} of {d.replicas} replicas available"
        return Check.of("WorkersDeployed", True, "Available", message), None
    if pods.problem is not None:
        p = pods.problem
        serving = f"; {pods.old_available} pod{'s' if pods.old_available != 1 else ''} of the previous template " \
                  f"still serve{'s' if pods.old_available == 1 else ''}" if pods.old_available else ""
        p = Problem(p.reason, f"{p.message}{serving}", p.permanent)
        return Check.of("WorkersDeployed", False, p.reason, p.message), p
    if d.replicas == 0:
        message = f"scaling to zero: {d.current} pod{'s' if d.current != 1 else ''} still to go"
    elif pods.known:
        message = f"{pods.available} of {d.replicas} replicas of the current template available"
        if pods.total > pods.available:
            message += f", {pods.total - pods.available} starting"
        if pods.old_available:
            message += f"; {pods.old_available} of the previous template still serving"
    elif d.observed_generation < d.generation:  # its counts are still those of the previous template
        message = f"the Deployment controller has not yet seen generation {d.generation} of the worker Deployment"
    else:
        # Without the pods: availableReplicas counts old pods too; those of the new template
        # are at least what is available beyond the old pods (status.replicas - updated).
        new_available = max(0, min(d.updated, d.available - max(0, d.current - d.updated)))
        message = f"{d.updated} of {d.replicas} replicas updated, at least {new_available} of them available"
    p = Problem("RollingOut", message)
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
        moment = (now or datetime.now(timezone.utc)).timestamp()
        workers, workers_problem = _workers_check(facts, moment)
        checks.append(workers)
        if workers_problem is not None and (problem is None or (workers_problem.permanent and not problem.permanent)):
            problem = workers_problem
        stalling = _stalling_check(facts, prev_conditions)
        if stalling is not None:  # a warning beside Ready, never a problem: the queue still works
            checks.append(stalling)
        throttled = throttling.check(throttling.Throttle.of(facts.stats) if facts.stats is not None else None,
                                     prev_conditions)
        if throttled is not None:  # why the backlog waits, beside Ready: the queue works as asked
            checks.append(throttled)
        capped = throttling.group_check(facts.stats, prev_conditions)
        if capped is not None:  # the same, for tasks parked by their group's cap or pause
            checks.append(capped)
    status: dict[str, Any] = {k: v for k, v in previous.items() if k in (
        "backlog", "oldestWaitingSeconds", "lastScaleTime", "lastScaleReason", "desiredReplicas", POLL_TIME)}
    status["observedGeneration"] = generation
    status["conditions"] = conditions(checks, problem, generation, prev_conditions, now)
    if facts.stats is not None:
        s = facts.stats
        status["backlog"] = {"waiting": s.waiting, "delayed": s.delayed, "active": s.active, "failed": s.failed,
                             "completed": s.completed, "parked": s.parked}
        status["oldestWaitingSeconds"] = round(s.oldest_waiting_seconds, 3)
        status[POLL_TIME] = now_iso(now)
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
    stalling = next((c for c in checks if c.type == stalls.CONDITION), None)
    stall_warning = stalls.event(stalling, prev_conditions) if stalling is not None else None
    if stall_warning is not None:
        events.append(stall_warning)
    return Plan(status, events)


def _stalling_check(facts: QueueFacts, previous: list[dict[str, Any]]) -> Check | None:
    """The Stalling condition from the stalls read; Unknown when they could not be read and
    the Queue has the condition (its last verdict is stale); none when its driver reads none."""
    if facts.stalls is not None:
        return stalls.check(facts.stalls)
    if not any(c.get("type") == stalls.CONDITION for c in previous):
        return None
    return Check(stalls.CONDITION, "Unknown", NOT_CHECKED, "the stalls could not be read from Redis")
