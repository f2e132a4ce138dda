"""How worker pods end, recorded by the operator and named by the stalls they leave, on a
real API server and a real Redis.

The control plane here has no kubelet: each test creates a worker pod (the labels the
operator's Deployments give, bound to node n1) and writes its status through the status
subresource as a kubelet would (tests/operator/test_worker_health.py does the same for
crash loops). A worker process of that pod is played in this process: it announces the
pod with its lease tokens' prefix and leases tasks, then its pod ends; the operator's pod
watch records how, and the operator's own maintenance recovers the leases when they run
out, with the cause in each attempt's history. Three such stalls make the Queue
Stalling (a Warning Event), Ready all along; once the stalls are older than the window
it is not Stalling any more.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timezone

import pytest
import yaml

import effectmq
from effectmq.client.models import PodIdentity
from effectmq.client.queue import MINUTE_SLOTS
from effectmq_operator import builders, stalls
from tests.operator.test_operator_queues import apply, condition, events, get, queue_manifest
from tests.support.operator import wait_for

pytestmark = pytest.mark.kube
LEASE = 6.0  # seconds: the ending is recorded well within it (the pod watch and a record: about a second)
# Reconciles at least every second; the status may lag under this shared machine's load.
SEEN_WITHIN = LEASE + 20


def stamp(at: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if at is None else at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def queue_without_workers(plane, ns, redis_url) -> None:
    """A Queue whose worker pods the test makes itself (no Deployment), polled every second."""
    body = yaml.safe_load(queue_manifest("emails", redis_url, lockTimeoutSeconds=int(LEASE), lockRefreshSeconds=2,
                                         maxStalledCount=10, scaling={"pollIntervalSeconds": 1}))
    del body["spec"]["worker"]
    apply(plane, ns, yaml.safe_dump(body))
    wait_for(lambda: (condition(get(plane, ns, "queue", "emails"), "Ready") or {}).get("status") == "True",
             timeout=30, what="the Queue Ready")


def worker_pod(plane, ns, name: str) -> dict:
    """A worker pod of Queue `emails` on node n1, its container reported running."""
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {**builders.worker_labels("emails"), "pod-template-hash": "7d9f"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "worker", "image": "effectmq-worker:test"}]}}
    plane.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(body))
    kubelet_reports(plane, ns, name, {"running": {"startedAt": stamp()}})
    return plane.kubectl_json("get", "pod", name, "-n", ns)


def kubelet_reports(plane, ns, name: str, state: dict, *, restarts: int = 0, last: dict | None = None,
                    **pod_status) -> None:
    container = {"name": "worker", "image": "effectmq-worker:test", "imageID": "", "ready": "running" in state,
                 "restartCount": restarts, "started": "running" in state, "state": state,
                 "lastState": {"terminated": last} if last else {}}
    status = {"phase": "Running", "startTime": stamp(), "containerStatuses": [container], **pod_status}
    plane.kubectl("patch", "pod", name, "-n", ns, "--subresource=status", "--type=merge",
                  "-p", json.dumps({"status": status}))


async def leases_of(pod: dict, q: effectmq.TaskQueue, ids: list[str]) -> None:
    """The pod's worker process: it announces its pod, then leases `ids` and holds them."""
    for task_id in ids:
        await q.offer("send_email", {"to": "a@b.c"}, task_id=task_id)
    meta = pod["metadata"]
    await q.worker_beat("w", len(ids), len(ids), 60, pod=PodIdentity(meta["name"], meta["uid"], "n1"))
    for task_id in ids:
        lease = await q.acquire(lock_timeout=LEASE)
        assert lease is not None and lease.task_id == task_id
    # The kubelet's finishedAt has whole seconds: the pod ends at least a second after the
    # worker announced itself, so the ending is of this run, not of one before it.
    await asyncio.sleep(1.1)


async def stall_cause(q: effectmq.TaskQueue, task_id: str) -> dict | None:
    info = await q.get(task_id)
    stalled = [a for a in (info.attempts if info else []) if a.outcome == "stalled"]
    return stalled[-1].cause if stalled else None


async def wait_for_cause(q: effectmq.TaskQueue, task_id: str, timeout: float = SEEN_WITHIN) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cause = await stall_cause(q, task_id)
        if cause is not None:
            return cause
        await asyncio.sleep(0.25)
    raise AssertionError(f"{task_id} not recovered as stalled within {timeout}s")


def oom_killed(plane, ns, name):
    kubelet_reports(plane, ns, name, {"running": {"startedAt": stamp()}}, restarts=1,
                    last={"exitCode": 137, "reason": "OOMKilled", "startedAt": stamp(time.time() - 2),
                          "finishedAt": stamp()})


EVICTION = ("The node was low on resource: memory. Threshold quantity: 100Mi, available: 92344Ki. Container worker "
            "was using 1523448Ki, request is 256Mi, has larger consumption of memory.")


def evicted(plane, ns, name):
    kubelet_reports(plane, ns, name, {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": stamp(),
                                                     "finishedAt": stamp()}},
                    phase="Failed", reason="Evicted", message=EVICTION,
                    conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                                 "message": EVICTION, "lastTransitionTime": stamp()}])


def force_deleted(plane, ns, name):
    plane.kubectl("delete", "pod", name, "-n", ns, "--grace-period=0", "--force")


ENDS = {
    "oom_killed": (oom_killed, {"kind": "oom_killed", "exit_code": 137}),
    "evicted": (evicted, {"kind": "evicted", "exit_code": 137, "message": EVICTION}),
    "deleted": (force_deleted, {"kind": "deleted"}),
}


@pytest.mark.parametrize("end", list(ENDS))
async def test_a_stall_names_how_the_workers_pod_ended(kube_control_plane, kube_namespace, start_operator,
                                                       redis_url, end):
    plane, ns = kube_control_plane, kube_namespace
    op = start_operator()
    queue_without_workers(plane, ns, redis_url)
    pod = worker_pod(plane, ns, "emails-worker-7d9f-x2")
    q = effectmq.TaskQueue(f"{ns}/emails", url=redis_url)
    try:
        await leases_of(pod, q, ["t1"])
        make_it_end, expected = ENDS[end]
        make_it_end(plane, ns, "emails-worker-7d9f-x2")
        # Nobody else runs maintenance: the operator recovers the lease when it runs out.
        cause = await wait_for_cause(q, "t1")
        assert cause == {**expected, "pod": "emails-worker-7d9f-x2", "node": "n1"}, (cause, op.log())
        assert await q.recent_stalls() == {end: 1}
        metrics = op.metrics()
        assert f'effectmq_operator_worker_endings_total{{cause="{end}",queue="{ns}/emails"}} 1.0' in metrics
        # the stall, counted by the process that recovered it (what the chart's alert sums)
        assert f'effectmq_stalls_total{{cause="{end}",queue="{ns}/emails"}} 1.0' in metrics
        # every other cause's series exists at 0: increase() over the window sees a first stall
        assert f'effectmq_stalls_total{{cause="unknown",queue="{ns}/emails"}} 0.0' in metrics
        assert f"worker pod emails-worker-7d9f-x2 ended: {end}" in op.log()
    finally:
        await q.close()


async def test_clustered_stalls_make_the_queue_stalling_with_a_warning_until_they_are_old(
        kube_control_plane, kube_namespace, start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    queue_without_workers(plane, ns, redis_url)
    q = effectmq.TaskQueue(f"{ns}/emails", url=redis_url)
    try:
        assert condition(get(plane, ns, "queue", "emails"), "Stalling")["reason"] == "NoStalls"
        pod = worker_pod(plane, ns, "emails-worker-7d9f-x2")
        ids = [f"t{i}" for i in range(stalls.CLUSTER)]
        await leases_of(pod, q, ids)
        oom_killed(plane, ns, "emails-worker-7d9f-x2")
        for task_id in ids:
            assert (await wait_for_cause(q, task_id))["kind"] == "oom_killed"

        def stalling():
            queue = get(plane, ns, "queue", "emails")
            c = condition(queue, "Stalling")
            return c["status"] == "True" and (queue, c)

        queue, c = wait_for(stalling, timeout=SEEN_WITHIN, what="Stalling=True")
        assert c["reason"] == "OOMKilled"
        assert c["message"] == (f"{stalls.CLUSTER} stalls in 10 min: OOMKilled; raise "
                                f"worker.resources.limits.memory (or lower worker.concurrency)")
        # a warning beside Ready, not a failure: the queue works (its attempts are retried)
        assert condition(queue, "Ready")["status"] == "True" and condition(queue, "Stalled")["status"] == "False"
        warnings = wait_for(lambda: [e for e in events(plane, ns, "emails") if e[:2] == ("Warning", "Stalling")],
                            timeout=10, what="the Stalling Warning Event")
        assert warnings == [("Warning", "Stalling", c["message"])]

        # Ten minutes later (the stalls' minutes moved back past the window in Redis): not Stalling.
        await age_stalls(q, minutes=stalls.WINDOW_SECONDS // 60 + 1)
        assert await q.recent_stalls() == {}
        calm = wait_for(lambda: (c := condition(get(plane, ns, "queue", "emails"), "Stalling"))["status"] == "False"
                        and c, timeout=SEEN_WITHIN, what="Stalling=False after the window")
        assert (calm["reason"], calm["message"]) == ("NoStalls", "no stalls in 10 min")
        assert [e for e in events(plane, ns, "emails") if e[1] == "Stalling"] == warnings  # no other Warning
    finally:
        await q.close()


async def age_stalls(q: effectmq.TaskQueue, minutes: int) -> None:
    """Move every stall count of the queue's per-minute ring `minutes` back in time (the
    ring's layout: forensics.lua's header, "m:<slot>" the minute a slot counts)."""
    key = q.keys.key("stall_minutes")
    ring = await q.redis.hgetall(key)
    slots = {field.split(":")[1]: int(value) for field, value in ring.items() if field.startswith("m:")}
    aged: dict[str, str] = {}
    for slot, minute in slots.items():
        old = (minute - minutes) % MINUTE_SLOTS
        aged[f"m:{old}"] = str(minute - minutes)
        for field, value in ring.items():
            cause, _, at = field.partition(":")
            if cause != "m" and at == slot:
                aged[f"{cause}:{old}"] = value
    await q.redis.delete(key)
    if aged:
        await q.redis.hset(key, mapping=aged)
