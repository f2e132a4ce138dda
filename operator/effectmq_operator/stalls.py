"""When a Queue's stalls cluster, and what to do about their cause (pure).

A stall is an attempt whose worker stopped renewing its lease, recovered by maintenance;
its cause is how that worker ended (pod_endings.py) or `unknown`. One stall now and then
is chance (a node drained, a pod rescheduled); several in a few minutes is a pattern with
a cause a person can fix. The Queue's `Stalling` condition says which, with the advice
for it, and a Warning Event is posted when it turns True (or its cause changes).

`Stalling` is not one of kstatus' abnormal-true conditions (Reconciling, Stalled), on
purpose: a stalling queue still works (its attempts are retried), so Flux, Argo CD and
`kubectl wait --for=condition=Ready` keep calling it healthy, and the condition, the
Event and the EffectMQStallsClustering alert carry the warning.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from effectmq.client.models import STALL_CAUSES

from .api import Event
from .status import Check

WINDOW_SECONDS = 600  # the stalls counted (TaskQueue.recent_stalls); the chart's alert uses the same 10 min
# Stalls within the window that make a cluster: fewer is what a node drain or a rollout
# leaves behind; three in ten minutes is a recurring cause. The chart's
# EffectMQStallsClustering alert fires at the same count.
CLUSTER = 3
CONDITION = "Stalling"
EVENT_REASON = "Stalling"

# The cause's word in the condition's reason and the messages (CamelCase, as kube says them).
REASONS = {
    "oom_killed": "OOMKilled",
    "evicted": "Evicted",
    "error_exit": "ErrorExit",
    "deleted": "Deleted",
    "node_lost": "NodeLost",
    "drained": "Drained",
    "unknown": "Unknown",
}
# What a person can do about each cause (the Queue's fields, as users write them).
ADVICE = {
    "oom_killed": "raise worker.resources.limits.memory (or lower worker.concurrency)",
    "evicted": "set worker.resources.requests to what a worker uses, so the kubelet evicts others first under "
               "node pressure, and protect the workers with a PodDisruptionBudget",
    "error_exit": "the worker process exits with an error: read its log (kubectl logs --previous) and the "
                  "stalled attempts (effectmq task ID)",
    "deleted": "worker pods are deleted before their tasks finish: raise worker.terminationGracePeriodSeconds "
               "above your longest task",
    "node_lost": "nodes go away with worker pods on them: look at the nodes (kubectl get nodes, their events)",
    "drained": "workers drained but left attempts behind: raise worker.terminationGracePeriodSeconds above "
               "your longest task",
    "unknown": "no pod ending explains them: a handler may block its worker's event loop past "
               "lockTimeoutSeconds; see the attempts' history (effectmq task ID)",
}


def dominant(stalls: Mapping[str, int]) -> str:
    """The cause with the most stalls; a tie goes to the cause listed first in STALL_CAUSES."""
    counted = [cause for cause in STALL_CAUSES if stalls.get(cause, 0) > 0]
    return max(counted, key=lambda cause: stalls[cause]) if counted else "unknown"


def describe(stalls: Mapping[str, int]) -> str:
    """'5 stalls in 10 min: OOMKilled; raise ...', or with each cause's count when they differ."""
    total = sum(stalls.values())
    window = f"{WINDOW_SECONDS // 60} min"
    if total == 0:
        return f"no stalls in {window}"
    plural = "s" if total != 1 else ""
    causes = [cause for cause in sorted(stalls, key=lambda c: (-stalls[c], _order(c))) if stalls[cause] > 0]
    if len(causes) == 1:
        said = REASONS.get(causes[0], causes[0])
    else:
        said = ", ".join(f"{REASONS.get(c, c)} {stalls[c]}" for c in causes)
    return f"{total} stall{plural} in {window}: {said}"


def _order(cause: str) -> int:
    return STALL_CAUSES.index(cause) if cause in STALL_CAUSES else len(STALL_CAUSES)


def check(stalls: Mapping[str, int]) -> Check:
    """The Stalling condition for the stalls of the last WINDOW_SECONDS, by cause."""
    total = sum(stalls.values())
    if total >= CLUSTER:
        cause = dominant(stalls)
        return Check(CONDITION, "True", REASONS[cause], f"{describe(stalls)}; {ADVICE[cause]}")
    if total == 0:
        return Check(CONDITION, "False", "NoStalls", describe(stalls))
    return Check(CONDITION, "False", "FewStalls", f"{describe(stalls)} (a warning from {CLUSTER})")


def event(now: Check, previous: Iterable[Mapping[str, Any]]) -> Event | None:
    """A Warning when stalls start to cluster, or their dominant cause changes: not on
    every poll while they go on (the condition's message keeps the count current)."""
    if now.status != "True":
        return None
    was = next((c for c in previous if c.get("type") == CONDITION), None)
    if was is not None and was.get("status") == "True" and was.get("reason") == now.reason:
        return None
    return Event("Warning", EVENT_REASON, now.message)
