"""How a worker pod, or one run of its worker container, ended (pure: a pod object in,
`WorkerEnding`s out), read from what the kubelet and the control plane write on the pod.

One run of the worker container ends each time the container terminates: the kubelet
shows the run before the current one in `lastState.terminated` (the container restarted)
and the current one in `state.terminated` (the pod is going away, or restarts it next).
The pod's own fields say why the last run ended when the pod was disrupted: `status.reason`
(Evicted by the kubelet under node pressure; NodeShutdown, Shutdown, Terminated by the
kubelet's graceful node shutdown; NodeLost) and the `DisruptionTarget` condition
(EvictionByEvictionAPI, PreemptionByScheduler, DeletionByTaintManager, DeletionByPodGC,
TerminationByKubelet). The cause of a run, most specific first:

    the container's reason is OOMKilled                         oom_killed (any run)
    the pod was evicted or preempted                            evicted    (its last run)
    its node went away or shut down                             node_lost  (its last run)
    the pod was deleted: exit 0                                 drained
                         a kill's exit (137, 143) or none       deleted
                         another exit code                      error_exit
    the container exited 0                                      drained
    the container exited with another code                      error_exit

A run is one (pod uid, run index) pair: the run in lastState is restartCount - 1, the
one in state is restartCount, so the same run reported by several watch events (and by
the DELETED event's final body) is the same run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping

from effectmq.client.models import WorkerEnding
from effectmq.protocol.protocol import MAX_ENDING_MESSAGE

from .api import GROUP
from .queue_plan import WORKER_CONTAINER, last_line

QUEUE_LABEL = f"{GROUP}/queue"  # on every worker pod: the name of its Queue (builders.worker_labels)
# What the operator watches, filtered by the API server (not every pod of the cluster):
# the pods of the worker Deployments it made (builders.worker_labels sets both labels).
WORKER_POD_SELECTOR = f"app.kubernetes.io/managed-by=effectmq-operator,{QUEUE_LABEL}"
KILL_EXITS = frozenset({137, 143})  # 128 + SIGKILL, 128 + SIGTERM: what a deletion's kill leaves
EVICTIONS = frozenset({"EvictionByEvictionAPI", "PreemptionByScheduler"})  # DisruptionTarget reasons
NODE_GONE = frozenset({"DeletionByTaintManager", "DeletionByPodGC"})  # unreachable past its toleration; deleted
# status.reason of a pod that ended with its node: the graceful node shutdown's (Shutdown
# before Kubernetes 1.21, NodeShutdown for a pod refused meanwhile, Terminated since) and
# the old node controller's NodeLost.
NODE_SHUTDOWN = frozenset({"Shutdown", "NodeShutdown", "Terminated", "NodeLost"})
ENDED_PHASES = frozenset({"Succeeded", "Failed"})

Run = tuple[str, int]  # (pod uid, run index of the worker container)


@dataclass(frozen=True)
class PodEnding:
    """One run of a worker pod's container that ended, and the Queue whose worker it was."""

    namespace: str
    queue: str  # the Queue's name (its key is (namespace, queue))
    run: Run
    ending: WorkerEnding

    @property
    def key(self) -> tuple[str, int, str]:
        """What makes it one record: a run is recorded again only with a better-informed cause
        (the kubelet writes the container's exit before the pod's eviction reason)."""
        return (*self.run, self.ending.cause)


def _epoch_ms(stamp: Any) -> int | None:
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        return None


def _worker_container(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    statuses = status.get("containerStatuses") or []
    return next((c for c in statuses if c.get("name") == WORKER_CONTAINER), statuses[0] if statuses else None)


def disruption(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why the control plane or the kubelet ended the pod, when it says: (cause, message)."""
    status = pod.get("status") or {}
    reason, message = str(status.get("reason") or ""), str(status.get("message") or "")
    if reason == "Evicted":  # the kubelet, under node pressure: its message names the resource
        return "evicted", message
    target = next((c for c in status.get("conditions") or []
                   if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)
    if target is not None:
        why = str(target.get("reason") or "")
        said = str(target.get("message") or "") or message
        if why in EVICTIONS:
            return "evicted", said
        if why in NODE_GONE:
            return "node_lost", said
    if reason in NODE_SHUTDOWN:
        return "node_lost", message
    if target is not None and target.get("reason") == "TerminationByKubelet":  # without a reason of its own
        return "evicted", str(target.get("message") or "") or message
    return None


def _exit_cause(code: int | None, deleting: bool) -> str:
    if code == 0:
        return "drained"
    if deleting and (code is None or code in KILL_EXITS):
        return "deleted"
    return "error_exit"


def _ending(pod: Mapping[str, Any], cause: str, terminated: Mapping[str, Any] | None, message: str) -> WorkerEnding:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    code = (terminated or {}).get("exitCode")
    return WorkerEnding(pod=str(meta.get("name") or ""), uid=str(meta.get("uid") or ""),
                        node=str(spec.get("nodeName") or ""), cause=cause,
                        exit_code=code if isinstance(code, int) else None,
                        message=last_line(message, MAX_ENDING_MESSAGE),
                        finished_at_ms=_epoch_ms((terminated or {}).get("finishedAt")))


def _own_message(cause: str, terminated: Mapping[str, Any]) -> str:
    """What the container said as it ended, for an error exit only. With the worker's
    FallbackToLogsOnError it is the tail of its log: the traceback that ended it, but for a
    kill (OOM, a deletion's SIGKILL) whatever was logged last, maybe a handler's data."""
    return str(terminated.get("message") or "") if cause == "error_exit" else ""


def queue_of(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (namespace, name) of the Queue whose worker the pod is (None: not a worker pod)."""
    meta = pod.get("metadata") or {}
    queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
    return (str(meta.get("namespace")), str(queue)) if queue and meta.get("namespace") else None


def pod_endings(pod: Mapping[str, Any], deleted: bool = False) -> list[PodEnding]:
    """The ended runs of a worker pod's container, as this version of the pod shows them
    (`deleted`: the pod's DELETED event, its final version). A pod whose worker never ran
    (pending, or its container never started) has none: no worker of it held a lease."""
    queue = queue_of(pod)
    if queue is None:
        return []
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    uid = str(meta.get("uid") or "")
    container = _worker_container(status) or {}
    restarts = int(container.get("restartCount") or 0)
    state, last = container.get("state") or {}, container.get("lastState") or {}
    found: list[PodEnding] = []

    def add(run: int, ending: WorkerEnding) -> None:
        found.append(PodEnding(queue[0], queue[1], (uid, run), ending))

    previous = last.get("terminated")
    if previous and restarts > 0:  # a run before the current one ended, and the container restarted
        cause = "oom_killed" if previous.get("reason") == "OOMKilled" else _exit_cause(previous.get("exitCode"), False)
        add(restarts - 1, _ending(pod, cause, previous, _own_message(cause, previous)))

    current = state.get("terminated")
    deleting = deleted or bool(meta.get("deletionTimestamp"))
    ran = bool(current or state.get("running") or previous or restarts)
    if not ran:
        return found
    ended = current is not None or deleted or status.get("phase") in ENDED_PHASES
    if not ended:  # running (also while a deleted pod drains: its end comes with its exit or its DELETED event)
        return found
    pod_said = disruption(pod)
    if current is not None and current.get("reason") == "OOMKilled":
        add(restarts, _ending(pod, "oom_killed", current, ""))
    elif pod_said is not None:
        add(restarts, _ending(pod, pod_said[0], current, pod_said[1]))
    elif current is not None:
        cause = _exit_cause(current.get("exitCode"), deleting)
        add(restarts, _ending(pod, cause, current, _own_message(cause, current)))
    elif deleted:  # gone while its container ran (a force deletion, a node gone without a word)
        add(restarts, _ending(pod, "deleted", None, ""))
    return found
