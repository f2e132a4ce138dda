"""The operator on a real control plane with Queues whose Redis is a Redis Cluster
(3 masters + 3 replicas as local processes), reached through a redis+cluster:// URL
from a Secret, as users give it."""

from __future__ import annotations

from urllib.parse import quote

import yaml

import effectmq
from effectmq.protocol.keys import QueueKeys
from tests.support.operator import wait_for

from .test_operator_queues import apply, condition, get, queue_manifest

PASSWORD = "cl@ster/secret"
QUEUES = [f"cq{i}" for i in range(10)]
SCALING = {"minReplicas": 0, "maxReplicas": 10, "targetTasksPerReplica": 100, "activationTasks": 5,
           "pollIntervalSeconds": 1}


def test_queues_on_a_redis_cluster_get_deployments_conditions_and_scaling(kube_control_plane, kube_namespace,
                                                                          start_operator, make_redis_cluster):
    """Was: "does not hold a redis://, rediss:// or unix:// URL" (Stalled), or through one
    node's URL the Queues of the other masters skipped with a log line only."""
    plane, ns = kube_control_plane, kube_namespace
    cluster = make_redis_cluster(password=PASSWORD)
    url = cluster.url()
    names = {name: f"{ns}/{name}" for name in QUEUES}
    masters = {cluster.master_of_slot(cluster.slot_of(QueueKeys("emq", full).base)).port for full in names.values()}
    assert len(masters) == 3  # the Queues live on every master
    plane.kubectl("create", "secret", "generic", "redis-cluster", "-n", ns, f"--from-literal=url={url}")
    start_operator()
    for name in QUEUES:
        manifest = yaml.safe_load(queue_manifest(name, None, scaling=SCALING))
        manifest["spec"]["redis"] = {"urlFrom": {"secretKeyRef": {"name": "redis-cluster", "key": "url"}}}
        apply(plane, ns, yaml.safe_dump(manifest))

    def ready(name):
        return (condition(get(plane, ns, "queue", name), "Ready") or {}).get("status") == "True"

    wait_for(lambda: all(get(plane, ns, "deployment", f"{name}-worker") for name in QUEUES), timeout=30,
             what="a Deployment per Queue")
    wait_for(lambda: all(ready(name) for name in QUEUES), timeout=30, what="every Queue Ready")
    # The CRD takes the URL form in spec.redis.url too.
    apply(plane, ns, queue_manifest("inline", url.replace(quote(PASSWORD, safe=""), "x"), scaling=SCALING))
    deployment = get(plane, ns, "deployment", f"{QUEUES[0]}-worker")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "EFFECTMQ_REDIS_URL_FILE", "value": "/etc/effectmq/redis-url/url"} in env  # the Secret, mounted
    assert not any(e["name"] == "EFFECTMQ_REDIS_URL" for e in env)

    # Scaling follows the backlog on every master: 250 tasks at 100 per replica: 3 replicas.
    loaded = {}
    for full in names.values():
        port = cluster.master_of_slot(cluster.slot_of(QueueKeys("emq", full).base)).port
        loaded.setdefault(port, full)
    assert len(loaded) == 3
    for full in loaded.values():
        q = effectmq.SyncTaskQueue(full, url=url)
        q.offer_many([("send_email", {"to": "a@b.c"})] * 250)
        q.close()
    for full in loaded.values():
        name = full.split("/", 1)[1]
        wait_for(lambda: get(plane, ns, "deployment", f"{name}-worker")["spec"]["replicas"] == 3, timeout=20,
                 what=f"{name} scaled to 3")
        # the status is written after the Deployment is scaled: a moment later, not at once
        wait_for(lambda: (get(plane, ns, "queue", name)["status"].get("backlog") or {}).get("waiting") == 250,
                 timeout=10, what=f"{name}'s status showing its 250 waiting tasks")
        assert get(plane, ns, "queue", name)["status"]["desiredReplicas"] == 3
    for name in QUEUES:
        text = yaml.safe_dump(get(plane, ns, "queue", name))
        assert PASSWORD not in text and quote(PASSWORD, safe="") not in text
