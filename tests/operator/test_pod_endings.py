"""How a worker ended, read from the pod as the kubelet and the control plane write it.

The pods below have the shapes of core/v1 Pod (PodStatus, ContainerStatus, PodCondition)
with the values Kubernetes writes in each case: the kubelet's OOM kill and node-pressure
eviction, the Eviction API, scheduler preemption, the taint manager and pod GC on a lost
node, the graceful node shutdown, a deletion (drained, killed at the grace period's end,
forced) and an error exit."""

from __future__ import annotations

import copy
from datetime import datetime, timezone

from effectmq.client.models import STALL_CAUSES

from effectmq_operator import builders
from effectmq_operator.pod_endings import WORKER_POD_SELECTOR, pod_endings, queue_of

STARTED, FINISHED = "2026-12-05T20:01:02Z", "2026-12-05T20:14:07Z"
FINISHED_MS = int(datetime(2026, 12, 5, 20, 14, 7, tzinfo=timezone.utc).timestamp() * 1000)
TRACEBACK = ('Traceback (most recent call last):\n  File "/app/shop/tasks.py", line 12, in handle\n'
             "RuntimeError: the payment service refused the key\n")
UID = "3f1b6d2c-4a5e-4f7e-9d1a-2b7c8e9f0a11"


def worker_pod(*, state=None, last=None, restarts=0, phase="Running", reason=None, message=None,
               conditions=(), deleting=False, sidecar=False) -> dict:
    """A worker pod of Queue shop/emails on node n1, as the API server returns it."""
    container = {"name": "worker", "image": "registry.example/shop-workers:1.4.2",
                 "imageID": "registry.example/shop-workers@sha256:" + "ab" * 32,
                 "containerID": "containerd://" + "cd" * 32, "ready": phase == "Running" and "running" in (state or {}),
                 "restartCount": restarts, "started": "running" in (state or {}),
                 "state": state or {"running": {"startedAt": STARTED}}, "lastState": {}}
    if last is not None:
        container["lastState"] = {"terminated": last}
    statuses = [container]
    if sidecar:  # a container of the user's pod template, listed first
        statuses.insert(0, {**copy.deepcopy(container), "name": "proxy", "restartCount": 0,
                            "state": {"running": {"startedAt": STARTED}}, "lastState": {}})
    status = {"phase": phase, "hostIP": "10.0.0.7", "podIP": "10.244.0.12", "startTime": STARTED,
              "qosClass": "Burstable",
              "conditions": [{"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                              "lastTransitionTime": STARTED},
                             *conditions],
              "containerStatuses": statuses}
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "emails-worker-7d9f8c6b5-x2kqp", "generateName": "emails-worker-7d9f8c6b5-",
                        "namespace": "shop", "uid": UID, "resourceVersion": "48213",
                        "creationTimestamp": STARTED, "labels": {**builders.worker_labels("emails"),
                                                                 "pod-template-hash": "7d9f8c6b5"},
                        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                             "name": "emails-worker-7d9f8c6b5", "uid": "9a8b", "controller": True,
                                             "blockOwnerDeletion": True}]},
           "spec": {"nodeName": "n1",
                    "containers": [{"name": "worker", "image": "registry.example/shop-workers:1.4.2"}],
                    "restartPolicy": "Always", "terminationGracePeriodSeconds": 60},
           "status": status}
    if deleting:
        pod["metadata"]["deletionTimestamp"] = FINISHED
        pod["metadata"]["deletionGracePeriodSeconds"] = 60
    return pod


def terminated(code: int, reason: str, message: str = "") -> dict:
    out = {"exitCode": code, "reason": reason, "startedAt": STARTED, "finishedAt": FINISHED,
           "containerID": "containerd://" + "cd" * 32}
    if message:
        out["message"] = message
    return out


def disruption(reason: str, message: str) -> dict:
    return {"type": "DisruptionTarget", "status": "True", "lastProbeTime": None, "lastTransitionTime": FINISHED,
            "reason": reason, "message": message}


def one(pod: dict, deleted: bool = False):
    (ending,) = pod_endings(pod, deleted=deleted)
    return ending


def test_an_oom_kill_of_a_restarted_container_is_recorded_for_the_run_that_ended():
    pod = worker_pod(restarts=2, last=terminated(137, "OOMKilled"))
    ending = one(pod)
    assert (ending.namespace, ending.queue, ending.run) == ("shop", "emails", (UID, 1))  # runs 0, 1 ended; 2 runs
    e = ending.ending
    assert (e.pod, e.uid, e.node) == ("emails-worker-7d9f8c6b5-x2kqp", UID, "n1")
    assert (e.cause, e.exit_code) == ("oom_killed", 137)
    assert e.finished_at_ms == FINISHED_MS
    assert e.checked() == e  # what the runtime accepts as it is


def test_an_oom_kill_wins_over_the_pods_deletion_and_exit_code():
    pod = worker_pod(state={"terminated": terminated(137, "OOMKilled")}, deleting=True, phase="Failed",
                     conditions=[disruption("EvictionByEvictionAPI", "Eviction API: evicting")])
    assert one(pod).ending.cause == "oom_killed" and one(pod).run == (UID, 0)


def test_a_kubelet_eviction_under_node_pressure_says_which_resource():
    message = ("The node was low on resource: memory. Threshold quantity: 100Mi, available: 92344Ki. Container "
               "worker was using 1523448Ki, request is 256Mi, has larger consumption of memory. ")
    pod = worker_pod(phase="Failed", reason="Evicted", message=message,
                     state={"terminated": terminated(137, "ContainerStatusUnknown",
                                                     "The container could not be located when the pod was "
                                                     "terminated")},
                     conditions=[disruption("TerminationByKubelet", message)])
    e = one(pod).ending
    assert (e.cause, e.exit_code) == ("evicted", 137)
    assert e.message.startswith("The node was low on resource: memory.") and "1523448Ki" in e.message


def test_an_eviction_through_the_eviction_api_is_evicted_even_when_the_worker_drained():
    pod = worker_pod(deleting=True, phase="Succeeded", state={"terminated": terminated(0, "Completed")},
                     conditions=[disruption("EvictionByEvictionAPI", "Eviction API: evicting")])
    e = one(pod).ending
    assert (e.cause, e.exit_code, e.message) == ("evicted", 0, "Eviction API: evicting")
    # the DELETED event's final body is the same run: the same record
    assert one(pod, deleted=True).key == one(pod).key


def test_a_preemption_by_the_scheduler_is_evicted():
    pod = worker_pod(deleting=True, state={"terminated": terminated(143, "Error")},
                     conditions=[disruption("PreemptionByScheduler",
                                            "Kubernetes Scheduler: preempting to accommodate a higher priority pod")])
    e = one(pod).ending
    assert e.cause == "evicted" and "preempting" in e.message


def test_a_pod_deleted_with_its_unreachable_node_is_node_lost():
    # the node stopped reporting: the container still shows running when the taint manager deletes the pod
    pod = worker_pod(deleting=True, conditions=[
        {"type": "Ready", "status": "False", "lastTransitionTime": FINISHED, "reason": "NodeNotReady"},
        disruption("DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint")])
    assert pod_endings(pod) == []  # still deleting: the end comes with the DELETED event
    e = one(pod, deleted=True).ending
    assert (e.cause, e.exit_code, e.finished_at_ms) == ("node_lost", None, None)
    assert e.message == "Taint manager: deleting due to NoExecute taint"


def test_a_pod_of_a_deleted_node_removed_by_pod_gc_is_node_lost():
    pod = worker_pod(deleting=True, phase="Failed", conditions=[
        disruption("DeletionByPodGC", "PodGC: node no longer exists")])
    assert one(pod).ending.cause == "node_lost"


def test_the_graceful_node_shutdown_is_node_lost():
    pod = worker_pod(phase="Failed", reason="Terminated",
                     message="Pod was terminated in response to imminent node shutdown.",
                     state={"terminated": terminated(0, "Completed")},
                     conditions=[disruption("TerminationByKubelet",
                                            "Pod was terminated in response to imminent node shutdown.")])
    e = one(pod).ending
    assert (e.cause, e.message) == ("node_lost", "Pod was terminated in response to imminent node shutdown.")


def test_an_error_exit_keeps_the_code_and_the_tracebacks_last_line():
    pod = worker_pod(restarts=1, state={"waiting": {"reason": "CrashLoopBackOff",
                                                     "message": "back-off 10s restarting failed container"}},
                     last=terminated(1, "Error", TRACEBACK))
    e = one(pod).ending
    assert (e.cause, e.exit_code, e.message) == ("error_exit", 1, "RuntimeError: the payment service refused the key")


def test_a_deleted_pod_drained_killed_or_crashing():
    drained = worker_pod(deleting=True, state={"terminated": terminated(0, "Completed")})
    assert one(drained).ending.cause == "drained"
    killed = worker_pod(deleting=True, state={"terminated": terminated(137, "Error")})  # SIGKILL at the grace's end
    assert (one(killed).ending.cause, one(killed).ending.exit_code) == ("deleted", 137)
    crashed = worker_pod(deleting=True, state={"terminated": terminated(2, "Error", TRACEBACK)})
    assert one(crashed).ending.cause == "error_exit"
    forced = worker_pod(deleting=True)  # kubectl delete --force: gone while the container ran
    assert pod_endings(forced) == []  # draining, as far as anyone knows
    assert one(forced, deleted=True).ending.cause == "deleted"


def test_a_killed_containers_log_tail_is_no_cause_message():
    """With FallbackToLogsOnError the kubelet puts the log's tail in a killed container's
    message: whatever was logged last (maybe a handler's data), not why it ended."""
    log_tail = "2026-12-05 21:56:39 INFO shop.tasks: charging card 4111 1111 1111 1111"
    for pod in (worker_pod(restarts=1, last=terminated(137, "OOMKilled", log_tail)),
                worker_pod(state={"terminated": terminated(137, "OOMKilled", log_tail)}, phase="Failed"),
                worker_pod(deleting=True, state={"terminated": terminated(137, "Error", log_tail)}),
                worker_pod(restarts=1, last=terminated(0, "Completed", log_tail))):
        e = one(pod).ending
        assert e.cause in ("oom_killed", "deleted", "drained") and e.message == "", e
    crashed = worker_pod(restarts=1, last=terminated(1, "Error", TRACEBACK))
    assert one(crashed).ending.message.startswith("RuntimeError")  # an error exit keeps its traceback's last line


def test_a_live_container_that_exited_zero_and_restarts_drained():
    pod = worker_pod(restarts=1, last=terminated(0, "Completed"))
    assert (one(pod).ending.cause, one(pod).ending.exit_code) == ("drained", 0)


def test_every_run_is_its_own_record_and_the_same_run_is_the_same_record():
    # the run ends (state), then restarts (lastState): one run, one key
    ended = worker_pod(restarts=0, state={"terminated": terminated(137, "OOMKilled")})
    restarted = worker_pod(restarts=1, last=terminated(137, "OOMKilled"))
    assert one(ended).key == one(restarted).key == (UID, 0, "oom_killed")
    again = worker_pod(restarts=2, last=terminated(137, "OOMKilled"))
    assert one(again).key == (UID, 1, "oom_killed")
    # a pod that ended with a run before it restarted: both runs
    both = worker_pod(restarts=1, last=terminated(1, "Error"), phase="Failed", reason="Evicted",
                      message="The node was low on resource: ephemeral-storage.",
                      state={"terminated": terminated(137, "Error")})
    assert [(e.run[1], e.ending.cause) for e in pod_endings(both)] == [(0, "error_exit"), (1, "evicted")]


def test_no_ending_for_a_worker_that_never_ran_nor_for_a_running_one():
    pending = worker_pod(phase="Pending", state={"waiting": {"reason": "ContainerCreating"}})
    assert pod_endings(pending) == [] and pod_endings(pending, deleted=True) == []
    no_status = worker_pod()
    del no_status["status"]["containerStatuses"]
    assert pod_endings(no_status, deleted=True) == []
    assert pod_endings(worker_pod()) == []
    draining = worker_pod(deleting=True)
    assert pod_endings(draining) == []


def test_only_the_worker_container_counts_and_only_worker_pods():
    pod = worker_pod(sidecar=True, restarts=1, last=terminated(137, "OOMKilled"))
    assert one(pod).ending.cause == "oom_killed"
    stranger = worker_pod(restarts=1, last=terminated(137, "OOMKilled"))
    del stranger["metadata"]["labels"]["effectmq.io/queue"]
    assert queue_of(stranger) is None and pod_endings(stranger) == []


def test_the_watch_selector_selects_the_pods_the_operator_builds():
    labels = builders.worker_labels("emails")
    for term in WORKER_POD_SELECTOR.split(","):
        key, _, value = term.partition("=")
        assert key in labels and (not value or labels[key] == value), term


def test_causes_are_the_runtimes():
    seen = {one(worker_pod(restarts=1, last=terminated(137, "OOMKilled"))).ending.cause,
            one(worker_pod(phase="Failed", reason="Evicted", state={"terminated": terminated(137, "Error")}))
            .ending.cause,
            one(worker_pod(restarts=1, last=terminated(1, "Error"))).ending.cause,
            one(worker_pod(deleting=True, state={"terminated": terminated(137, "Error")})).ending.cause,
            one(worker_pod(deleting=True, phase="Failed", conditions=[disruption("DeletionByPodGC", "gone")]))
            .ending.cause,
            one(worker_pod(restarts=1, last=terminated(0, "Completed"))).ending.cause}
    assert seen == set(STALL_CAUSES) - {"unknown"}
