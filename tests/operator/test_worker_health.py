"""Worker crash loops are judged from the pods themselves.

The control plane here has no kubelet: the Deployment and ReplicaSet controllers create
the worker pods, and these tests write the pods' status through the status subresource
exactly as a kubelet would (phase, the Ready condition, the worker container's state,
restartCount and lastState.terminated with its exit code, reason and message). What
the operator reads is therefore what it would read on a node; the one-node cluster
(tests/cluster) runs the same images for real.

Bound: a worker container that exits at start reaches its third restart
about 70 s after it first started (the kubelet's back-off: 10 s, 20 s, 40 s); the Queue
is Stalled, kstatus Failed, within one poll of that report (at most 10 s while its
Deployment is not available, whatever pollIntervalSeconds says, plus POD_LIST_EVERY),
or at progressDeadlineSeconds after the pod was created if that comes first. Image pulls
that keep failing are Stalled after 90 s (about three failed pulls), an image name that
cannot be parsed at once.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest
import yaml

import effectmq
from effectmq_operator.queue_plan import START_FAILURE_LIMIT
from effectmq_operator.queue_controller import POD_LIST_EVERY, UNAVAILABLE_POLL
from tests.operator.test_operator_queues import apply, condition, events, get, queue_manifest
from tests.support.operator import wait_for

pytestmark = pytest.mark.kube
FAST = {"pollIntervalSeconds": 1, "scaleDownStabilizationSeconds": 60, "cooldownSeconds": 60}
TRACEBACK = ("Traceback (most recent call last):\n  File \"/usr/local/bin/effectmq\", line 8, in <module>\n"
             "ModuleNotFoundError: No module named 'shop.taskz'\n")
# What a poll takes to see a new kubelet report, with margin for this shared 2-core machine.
JUDGED_WITHIN = UNAVAILABLE_POLL + POD_LIST_EVERY + 8


def stamp(seconds_ago: float = 0.0) -> str:
    return (datetime.now(timezone.utc) - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def kubelet_reports(plane, ns, pod: str, *, ready: bool = False, restarts: int = 0, waiting=None, running=False,
                    last_exit=None, unready_for: float = 0.0) -> None:
    """Write a worker pod's status as the kubelet would."""
    container = {"name": "worker", "image": "effectmq-worker:test", "imageID": "", "ready": ready,
                 "restartCount": restarts, "started": running, "state": {}}
    if waiting:
        container["state"]["waiting"] = {"reason": waiting[0], "message": waiting[1]}
    elif running:
        container["state"]["running"] = {"startedAt": stamp(max(unready_for, 60.0))}
    if last_exit:
        code, reason, message = last_exit
        container["lastState"] = {"terminated": {"exitCode": code, "reason": reason, "message": message,
                                                 "startedAt": stamp(2), "finishedAt": stamp(1)}}
    ready_condition = "True" if ready else "False"
    status = {
        "phase": "Running" if (running or waiting and waiting[0] == "CrashLoopBackOff" or restarts) else "Pending",
        "startTime": stamp(unready_for),
        "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp(unready_for)},
                       {"type": "Initialized", "status": "True", "lastTransitionTime": stamp(unready_for)},
                       {"type": "ContainersReady", "status": ready_condition,
                        "lastTransitionTime": stamp(unready_for)},
                       {"type": "Ready", "status": ready_condition, "lastTransitionTime": stamp(unready_for),
                        **({} if ready else {"reason": "ContainersNotReady"})}],
        "containerStatuses": [container],
    }
    plane.kubectl("patch", "pod", pod, "-n", ns, "--subresource=status", "--type=merge",
                  "-p", json.dumps({"status": status}))


def worker_pods(plane, ns, queue: str) -> list[dict]:
    return [p for p in plane.kubectl_json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={queue}")
            ["items"] if not p["metadata"].get("deletionTimestamp")]


def state(plane, ns, name, type_="Ready"):
    c = condition(get(plane, ns, "queue", name), type_)
    return c and (c["status"], c["reason"], c["message"])


def kubectl_wait_ready(plane, ns, name, timeout: str):
    return plane.kubectl("wait", "--for=condition=Ready", f"queue/{name}", "-n", ns, f"--timeout={timeout}",
                         check=False)


def offer(ns, name, redis_url, tasks=5):
    q = effectmq.SyncTaskQueue(f"{ns}/{name}", url=redis_url)
    try:
        q.offer_many([("send_email", {"to": "a@b.c"})] * tasks)
    finally:
        q.close()


def assert_failed_and_not_ready(plane, ns, name, kstatus, reason):
    queue = get(plane, ns, "queue", name)
    assert condition(queue, "Ready")["status"] == "False" and condition(queue, "Ready")["reason"] == reason
    assert condition(queue, "Stalled")["status"] == "True" and condition(queue, "Reconciling")["status"] == "False"
    assert kstatus(queue).status == "Failed", kstatus(queue)
    assert ("Warning", reason) in [(t, r) for t, r, _ in events(plane, ns, name)]
    waited = kubectl_wait_ready(plane, ns, name, "5s")
    assert waited.returncode != 0 and "timed out" in waited.stderr, waited.stderr


def test_a_crash_loop_after_a_scale_from_zero_is_failed_not_rolling_out(kube_control_plane, kube_namespace,
                                                                        start_operator, redis_url, kstatus):
    """Was: Ready=False RollingOut and kstatus InProgress for ever, no Warning, no Stalled."""
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    manifest = yaml.safe_load(queue_manifest("emails", redis_url, scaling=FAST))
    manifest["spec"]["worker"]["handlers"] = "shop.taskz:app"  # the wrong module
    apply(plane, ns, yaml.safe_dump(manifest))
    wait_for(lambda: get(plane, ns, "deployment", "emails-worker"), what="worker Deployment")
    assert kubectl_wait_ready(plane, ns, "emails", "30s").returncode == 0  # at zero there is nothing to judge

    offer(ns, "emails", redis_url)
    (pod,) = wait_for(lambda: worker_pods(plane, ns, "emails"), timeout=20, what="a worker pod after the scale-up")
    name = pod["metadata"]["name"]
    kubelet_reports(plane, ns, name, restarts=1, waiting=("CrashLoopBackOff", f"back-off 10s restarting failed "
                    f"container=worker pod={name}"), last_exit=(1, "Error", TRACEBACK), unready_for=12)
    ready = wait_for(lambda: (s := state(plane, ns, "emails")) and s[1] == "WorkersCrashLooping" and s,
                     timeout=JUDGED_WITHIN, what="the crash loop reported")
    assert ready[0] == "False" and name in ready[2] and "exit code 1" in ready[2]
    assert "No module named 'shop.taskz'" in ready[2], ready
    assert state(plane, ns, "emails", "Stalled")[0] == "False"  # one restart: it may still come up
    assert kstatus(get(plane, ns, "queue", "emails")).status == "InProgress"

    kubelet_reports(plane, ns, name, restarts=3, waiting=("CrashLoopBackOff", f"back-off 40s restarting failed "
                    f"container=worker pod={name}"), last_exit=(1, "Error", TRACEBACK), unready_for=72)
    reported = time.monotonic()
    wait_for(lambda: kstatus(get(plane, ns, "queue", "emails")).status == "Failed", timeout=JUDGED_WITHIN,
             what="kstatus Failed after the third restart")
    took = time.monotonic() - reported
    assert_failed_and_not_ready(plane, ns, "emails", kstatus, "WorkersCrashLooping")
    assert get(plane, ns, "deployment", "emails-worker")["spec"]["replicas"] == 1
    print(f"third restart reported -> kstatus Failed in {took:.1f}s")


@pytest.mark.parametrize("change, kubelet, reason", [
    ("handlers", {"restarts": 3, "waiting": ("CrashLoopBackOff", "back-off 40s restarting failed container"),
                  "last_exit": (1, "Error", TRACEBACK), "unready_for": 72}, "WorkersCrashLooping"),
    ("image", {"waiting": ("InvalidImageName", 'Failed to apply default image tag "Registry.example/Shop:1": '
                           "couldn't parse image name: invalid reference format")}, "ImagePullFailed"),
])
def test_a_broken_new_template_is_failed_while_the_old_pod_still_serves(kube_control_plane, kube_namespace,
                                                                        start_operator, redis_url, kstatus,
                                                                        change, kubelet, reason):
    """Was: "1 of 1 replicas updated, 1 available" (the available one the old pod) until
    the 600 s progress deadline."""
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, scaling={**FAST, "minReplicas": 1}))
    (old,) = wait_for(lambda: worker_pods(plane, ns, "emails"), timeout=20, what="the first worker pod")
    old_name = old["metadata"]["name"]
    kubelet_reports(plane, ns, old_name, ready=True, running=True, unready_for=120)
    wait_for(lambda: (state(plane, ns, "emails") or ("",))[0] == "True", timeout=30, what="Ready with a running pod")

    patch = {"handlers": "shop.taskz:app"} if change == "handlers" else {"image": "Registry.example/Shop:1"}
    plane.kubectl("patch", "queue", "emails", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"worker": patch}}))
    new = wait_for(lambda: [p for p in worker_pods(plane, ns, "emails") if p["metadata"]["name"] != old_name],
                   timeout=20, what="the pod of the new template")
    new_name = new[0]["metadata"]["name"]
    seen = set()

    def rolling():
        s = state(plane, ns, "emails", "WorkersDeployed")
        if s and s[0] == "False":
            seen.add(s[2])
            return "of the current template" in s[2] and s
        return None

    judged = wait_for(rolling, timeout=JUDGED_WITHIN, what="the rollout seen")
    assert "0 of 1 replicas of the current template available" in judged[2], judged
    assert not [m for m in seen if "1 available" in m or "at least 1" in m], seen  # the old pod is not the new one

    kubelet_reports(plane, ns, new_name, **kubelet)
    wait_for(lambda: kstatus(get(plane, ns, "queue", "emails")).status == "Failed", timeout=JUDGED_WITHIN,
             what="kstatus Failed")
    assert_failed_and_not_ready(plane, ns, "emails", kstatus, reason)
    message = state(plane, ns, "emails")[2]
    assert new_name in message and "1 pod of the previous template still serves" in message, message
    assert (condition(get(plane, ns, "deployment", "emails-worker"), "Progressing") or {}).get("reason") \
        != "ProgressDeadlineExceeded"  # the Deployment itself says nothing yet: the pods told


def test_an_image_that_cannot_be_pulled_after_a_scale_from_zero_is_failed(kube_control_plane, kube_namespace,
                                                                          start_operator, redis_url, kstatus):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    manifest = yaml.safe_load(queue_manifest("emails", redis_url, scaling=FAST))
    manifest["spec"]["worker"]["image"] = "registry.example/shop-workerz:1.4.2"
    manifest["spec"]["worker"]["progressDeadlineSeconds"] = 8  # before START_FAILURE_LIMIT
    assert START_FAILURE_LIMIT > 8
    apply(plane, ns, yaml.safe_dump(manifest))
    wait_for(lambda: get(plane, ns, "deployment", "emails-worker"), what="worker Deployment")
    offer(ns, "emails", redis_url)
    (pod,) = wait_for(lambda: worker_pods(plane, ns, "emails"), timeout=20, what="a worker pod after the scale-up")
    kubelet_reports(plane, ns, pod["metadata"]["name"], waiting=(
        "ImagePullBackOff", 'Back-off pulling image "registry.example/shop-workerz:1.4.2"'))
    pulling = wait_for(lambda: (s := state(plane, ns, "emails")) and s[1] == "ImagePullFailed" and s,
                       timeout=JUDGED_WITHIN, what="the failed pull reported")
    assert "shop-workerz:1.4.2" in pulling[2]
    wait_for(lambda: kstatus(get(plane, ns, "queue", "emails")).status == "Failed", timeout=8 + JUDGED_WITHIN,
             what="kstatus Failed at the progress deadline")
    assert_failed_and_not_ready(plane, ns, "emails", kstatus, "ImagePullFailed")


def test_workers_that_lost_redis_read_as_a_redis_reason_not_a_rollout(kube_control_plane, kube_namespace,
                                                                      start_operator, redis_url, kstatus):
    """Was: a 3 s Redis outage read RollingOut: the worker pods' readiness (their last Redis
    call) lags the outage, and the operator's own poll had already got through again."""
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, scaling={**FAST, "minReplicas": 1}))
    (pod,) = wait_for(lambda: worker_pods(plane, ns, "emails"), timeout=20, what="the worker pod")
    name = pod["metadata"]["name"]
    kubelet_reports(plane, ns, name, ready=True, running=True, unready_for=300)
    wait_for(lambda: (state(plane, ns, "emails") or ("",))[0] == "True", timeout=30, what="Ready")
    kubelet_reports(plane, ns, name, ready=False, running=True, unready_for=4)  # /readyz: 503
    ready = wait_for(lambda: (s := state(plane, ns, "emails")) and s[0] == "False" and s, timeout=JUDGED_WITHIN,
                     what="the unready worker reported")
    assert ready[1] == "WorkersCannotReachRedis" and "Redis" in ready[2], ready
    assert state(plane, ns, "emails", "Reconciling")[0] == "True"
    assert kstatus(get(plane, ns, "queue", "emails")).status == "InProgress"
    kubelet_reports(plane, ns, name, ready=True, running=True, unready_for=0)
    wait_for(lambda: (state(plane, ns, "emails") or ("",))[0] == "True", timeout=JUDGED_WITHIN, what="Ready again")
