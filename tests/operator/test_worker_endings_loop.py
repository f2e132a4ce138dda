"""The recording of worker endings against a real Redis, without an API server: the
leader records each container run once (however many watch events show it), and a stall
of an attempt that pod's worker held names it; a standby, a Queue whose Redis is not
resolved yet and a deposed leader record nothing and keep it; a Queue that is gone or an
ending that waited too long is forgotten."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

from effectmq.client.models import PodIdentity

from effectmq_operator import builders
from effectmq_operator.pod_endings import QUEUE_LABEL
from effectmq_operator.queue_controller import QueueController
from effectmq_operator.redis_pool import Connections, RedisTarget
from effectmq_operator.runtime.kube import NotLeader
from effectmq_operator.worker_endings import PENDING_FOR, WorkerEndings

UID = "3f1b6d2c-4a5e-4f7e-9d1a-2b7c8e9f0a11"
KEY = ("shop", "emails")


class Kube:
    """What the recording asks of the operator's Kube: whether it may still write."""

    def __init__(self) -> None:
        self.leading = True

    def check_leader(self) -> None:
        if not self.leading:
            raise NotLeader("not the leader any more: write skipped")


def oom_killed_pod(finished: float, restarts: int = 1) -> dict:
    stamp = datetime.fromtimestamp(finished, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"name": "emails-worker-7d9f-x2", "namespace": "shop", "uid": UID,
                         "labels": builders.worker_labels("emails")},
            "spec": {"nodeName": "n1"},
            "status": {"phase": "Running", "containerStatuses": [{
                "name": "worker", "restartCount": restarts, "state": {"running": {"startedAt": stamp}},
                "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": stamp,
                                             "finishedAt": stamp}}}]}}


def parts(redis_url: str, clock=time.monotonic):
    kube = Kube()
    connections = Connections(kube)  # type: ignore[arg-type]
    queues = QueueController(kube, connections, namespaces=["shop"])  # type: ignore[arg-type]
    queues.queues.items[KEY] = {"metadata": {"namespace": "shop", "name": "emails", "uid": "q1"}}
    queues.queues.synced.set()
    queues.targets[KEY] = RedisTarget(redis_url)
    return kube, connections, queues, WorkerEndings(queues, connections, clock=clock)


async def test_the_leader_records_a_run_once_and_the_stall_it_left_names_it(redis_url):
    kube, connections, queues, endings = parts(redis_url)
    q = connections.queue(queues.targets[KEY], "shop/emails")
    try:
        await q.offer("send_email", {}, task_id="t1", max_stalled_count=5)
        await q.worker_beat("w", 1, 1, 60, pod=PodIdentity("emails-worker-7d9f-x2", UID, "n1"))
        assert (await q.acquire(lock_timeout=0.05)).task_id == "t1"
        pod = oom_killed_pod(time.time() + 1)  # the kubelet's whole second, after the announcement
        endings.observe("MODIFIED", pod)
        endings.observe("MODIFIED", pod)  # the same run, reported again (a readiness change, a relist)
        assert list(endings.pending) == [(UID, 0, "oom_killed")]
        await endings.record_pending()
        assert not endings.pending and list(endings.recorded) == [(UID, 0, "oom_killed")]
        endings.observe(None, pod)  # a watch that restarted lists it again: recorded already
        assert not endings.pending
        endings.observe("MODIFIED", oom_killed_pod(time.time() + 1, restarts=2))  # the next run ended too
        assert list(endings.pending) == [(UID, 1, "oom_killed")]

        await asyncio.sleep(0.1)
        report = await q.maintain()
        assert report.stall_causes == {"oom_killed": 1}
        info = await q.get("t1")
        assert info.attempts[-1].cause == {"kind": "oom_killed", "pod": "emails-worker-7d9f-x2", "node": "n1",
                                           "exit_code": 137}
    finally:
        await connections.close()


async def test_nothing_is_recorded_without_leadership_or_a_known_redis_and_it_waits(redis_url):
    kube, connections, queues, endings = parts(redis_url)
    try:
        endings.observe("MODIFIED", oom_killed_pod(time.time()))
        kube.leading = False  # deposed: a Redis write too is refused
        await endings.record_pending()
        assert list(endings.pending) == [(UID, 0, "oom_killed")] and not endings.recorded
        kube.leading = True
        target = queues.targets.pop(KEY)  # the Queue's reconcile has not resolved its Redis yet
        await endings.record_pending()
        assert list(endings.pending) == [(UID, 0, "oom_killed")]
        queues.targets[KEY] = target
        await endings.record_pending()
        assert not endings.pending and list(endings.recorded) == [(UID, 0, "oom_killed")]
    finally:
        await connections.close()


async def test_a_standby_keeps_endings_for_when_it_leads_and_forgets_old_ones(redis_url):
    now = [1000.0]
    kube, connections, queues, endings = parts(redis_url, clock=lambda: now[0])
    try:
        endings.observe("MODIFIED", oom_killed_pod(time.time()))
        standby = asyncio.create_task(endings.run(lambda: False))
        await asyncio.sleep(0.7)
        assert list(endings.pending) == [(UID, 0, "oom_killed")] and not endings.recorded
        now[0] += PENDING_FOR + 1
        endings.observe("MODIFIED", oom_killed_pod(time.time(), restarts=2))  # a newer run, seen now
        await asyncio.sleep(0.7)
        assert list(endings.pending) == [(UID, 1, "oom_killed")]  # the one that waited too long is gone
        standby.cancel()
        await asyncio.gather(standby, return_exceptions=True)

        leader = asyncio.create_task(endings.run(lambda: True))
        deadline = time.monotonic() + 5
        while endings.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        leader.cancel()
        await asyncio.gather(leader, return_exceptions=True)
        assert list(endings.recorded) == [(UID, 1, "oom_killed")]
    finally:
        await connections.close()


async def test_the_endings_of_a_queue_that_is_gone_are_forgotten(redis_url):
    kube, connections, queues, endings = parts(redis_url)
    try:
        endings.observe("MODIFIED", oom_killed_pod(time.time()))
        del queues.queues.items[KEY]
        await endings.record_pending()
        assert not endings.pending and not endings.recorded
    finally:
        await connections.close()


def test_a_pod_of_no_queue_is_not_kept():
    endings = WorkerEndings(None, None)  # type: ignore[arg-type]  # observing needs neither
    stranger = oom_killed_pod(time.time())
    del stranger["metadata"]["labels"][QUEUE_LABEL]
    endings.observe("MODIFIED", stranger)
    assert not endings.pending
