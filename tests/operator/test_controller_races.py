"""Narrow tests of the Queue reconciler's bookkeeping (real Redis, a scripted API).

The API side is a small stand-in so that a race can be staged exactly: a watch
event that arrives while a reconcile is awaiting its apply."""

from __future__ import annotations

import copy

import pytest
import yaml

from effectmq_operator.redis_pool import Connections
from effectmq_operator.queue_controller import QueueController
from effectmq_operator.runtime.kube import Kube, NotLeader
from tests.support.processes import ROOT

QUEUE = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())


class ScriptedKube:
    """Answers like the API server; `during_apply` runs while an apply is in flight."""

    def __init__(self):
        self.during_apply = None
        self.status_writes: list[dict] = []

    def check_leader(self):
        pass

    async def apply(self, body):
        applied = copy.deepcopy(body)
        applied["metadata"].update(resourceVersion="5", generation=1)
        if self.during_apply:
            self.during_apply()
        return applied

    async def patch_status(self, plural, namespace, name, status):
        self.status_writes.append(status)
        return None

    async def post_events(self, *args, **kwargs):
        pass

    async def list_resources(self, plural, namespaces):
        return []


def queue_body(redis_url):
    body = copy.deepcopy(QUEUE)
    body["metadata"] = {"name": "emails", "namespace": "shop", "uid": "u1", "generation": 1, "resourceVersion": "1"}
    body["spec"]["redis"] = {"url": redis_url}
    return body


def rolled_out(deployment, rv):
    d = copy.deepcopy(deployment)
    d["metadata"]["resourceVersion"] = rv
    d["status"] = {"observedGeneration": 1, "replicas": 0, "updatedReplicas": 0, "availableReplicas": 0,
                   "readyReplicas": 0}
    return d


async def test_a_deployment_event_during_the_apply_is_not_lost(redis_url):
    kube = ScriptedKube()
    controller = QueueController(kube, Connections(kube))
    body = queue_body(redis_url)
    controller.observe_queue("ADDED", body)

    def controller_reports_rollout():  # the deployment controller is faster than our apply's reply
        applied = {"metadata": {"name": "emails-worker", "namespace": "shop", "generation": 1,
                                "labels": {"effectmq.io/queue": "emails"}, "annotations": {}},
                   "spec": {"replicas": 0}}
        controller.observe_deployment("MODIFIED", rolled_out(applied, "6"))
    kube.during_apply = controller_reports_rollout
    key = ("shop", "emails")
    await controller.work.run_due([key])
    assert controller.deployments[key]["metadata"]["resourceVersion"] == "6"  # not the older reply
    assert controller.work.due(key) == 0.0  # the change seen meanwhile is reconciled at once
    kube.during_apply = None
    await controller.work.run_due([key])
    ready = kube.status_writes[-1]["conditions"][0]
    assert (ready["type"], ready["status"]) == ("Ready", "True"), kube.status_writes[-1]["conditions"]
    await controller.connections.close()


async def test_a_deposed_leader_writes_nothing():
    kube = Kube()  # points nowhere: any call that got through would fail differently
    kube.may_write = lambda: False
    with pytest.raises(NotLeader):
        await kube.patch_status("queues", "shop", "emails", {"replicas": 1})
    with pytest.raises(NotLeader):
        await kube.apply({"metadata": {"name": "emails-worker", "namespace": "shop"}})
    with pytest.raises(NotLeader):
        await kube.post_event({"metadata": {"name": "emails", "namespace": "shop", "uid": "u"}}, type="Normal",
                              reason="Scaled", message="scale up to 1")
    assert kube.requests == 0


def test_a_namespace_being_deleted_is_not_a_failure():
    import json

    from kubernetes.client.rest import ApiException

    from effectmq_operator.runtime.kube import namespace_terminating

    refused = ApiException(status=403, reason="Forbidden")
    refused.body = json.dumps({"kind": "Status", "code": 403, "reason": "Forbidden", "details": {
        "causes": [{"reason": "NamespaceTerminating", "field": "metadata.namespace"}]}})
    forbidden = ApiException(status=403, reason="Forbidden")
    forbidden.body = json.dumps({"kind": "Status", "code": 403, "reason": "Forbidden"})
    assert namespace_terminating(refused) and not namespace_terminating(forbidden)


def test_a_status_write_of_a_queue_does_not_wake_its_schedules(redis_url):
    # Every Queue status write used to re-reconcile each of its Schedules (one Redis read
    # and status comparison each): with thousands of Schedules, work for nothing.
    kube = ScriptedKube()
    controller = QueueController(kube, Connections(kube))
    told = []
    controller.listeners.append(told.append)
    key = ("shop", "emails")
    body = queue_body(redis_url)
    controller.observe_queue("ADDED", body)
    assert told == [key]

    status_only = copy.deepcopy(body)
    status_only["metadata"]["resourceVersion"] = "2"
    status_only["status"] = {"observedGeneration": 1, "conditions": [{"type": "Ready", "status": "True"}]}
    controller.observe_queue("MODIFIED", status_only)
    assert told == [key]

    respecified = copy.deepcopy(status_only)
    respecified["metadata"].update(resourceVersion="3", generation=2)
    controller.observe_queue("MODIFIED", respecified)
    deleting = copy.deepcopy(respecified)
    deleting["metadata"].update(resourceVersion="4", deletionTimestamp="2026-12-01T18:00:00Z")
    controller.observe_queue("MODIFIED", deleting)
    controller.observe_queue("DELETED", deleting)
    assert told == [key] * 4
