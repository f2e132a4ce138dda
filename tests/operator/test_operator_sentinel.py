"""The operator on a real control plane with Queues and a Schedule whose Redis sits
behind Redis Sentinel (a primary, a replica and three Sentinels as local processes),
reached through a redis+sentinel:// URL, from a Secret and inline, as users give it.
The runtime and the CLI took these URLs; the operator refused them."""

from __future__ import annotations

import yaml

import effectmq
from tests.support.operator import wait_for

from .test_operator_queues import apply, condition, events, get, queue_manifest

PASSWORD = "sent/inel@pw"
SCALING = {"minReplicas": 0, "maxReplicas": 10, "targetTasksPerReplica": 100, "activationTasks": 1,
           "pollIntervalSeconds": 1}


def test_queues_behind_sentinel_are_served_and_follow_a_failover(kube_control_plane, kube_namespace,
                                                                 start_operator, make_sentinel):
    """Was: the CRD refused redis+sentinel:// in spec.redis.url, and from a Secret the
    Queue was Stalled with "does not hold a redis://, rediss://, unix:// or
    redis+cluster:// URL"."""
    plane, ns = kube_control_plane, kube_namespace
    sentinel = make_sentinel(password=PASSWORD)
    url = sentinel.url()
    plane.kubectl("create", "secret", "generic", "redis-sentinel", "-n", ns, f"--from-literal=url={url}")
    start_operator()
    manifest = yaml.safe_load(queue_manifest("jobs", None, scaling=SCALING))
    manifest["spec"]["redis"] = {"urlFrom": {"secretKeyRef": {"name": "redis-sentinel", "key": "url"}}}
    apply(plane, ns, yaml.safe_dump(manifest))
    # The CRD takes the URL form in spec.redis.url too (no password: it would be in the spec).
    apply(plane, ns, queue_manifest("inline", sentinel.url(password=""), scaling=SCALING))
    apply(plane, ns, yaml.safe_dump({
        "apiVersion": "effectmq.io/v1alpha1", "kind": "Schedule", "metadata": {"name": "every-second"},
        "spec": {"queueRef": {"name": "jobs"}, "schedule": "* * * * * *", "task": {"name": "send_report"}}}))

    def ready(kind, name):
        return (condition(get(plane, ns, kind, name), "Ready") or {}).get("status") == "True"

    wait_for(lambda: ready("queue", "jobs"), timeout=30, what="the Queue behind Sentinel Ready")
    wait_for(lambda: ready("schedule", "every-second"), timeout=30, what="the Schedule behind Sentinel Ready")
    inline = wait_for(lambda: (q := get(plane, ns, "queue", "inline")) and condition(q, "RedisReachable"),
                      timeout=30, what="the inline Queue checked")
    # no password given to a Redis that wants one: refused by Redis, not by the operator's URL check
    assert inline["reason"] != "InvalidRedisURL", inline
    env = get(plane, ns, "deployment", "jobs-worker")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "EFFECTMQ_REDIS_URL_FILE", "value": "/etc/effectmq/redis-url/url"} in env  # the Secret, mounted
    assert not any(e["name"] == "EFFECTMQ_REDIS_URL" for e in env)

    # Ticks land in the queue on the primary, and the backlog scales the Deployment.
    q = effectmq.SyncTaskQueue(f"{ns}/jobs", url=url)
    try:
        wait_for(lambda: q.stats().waiting >= 2, timeout=15, what="ticks offered through Sentinel")
        q.offer_many([("send_email", {"to": "a@b.c"})] * 250)
        wait_for(lambda: get(plane, ns, "deployment", "jobs-worker")["spec"]["replicas"] == 3, timeout=20,
                 what="scaled on the backlog behind Sentinel")

        # The primary dies; the Sentinels promote the replica, and the operator follows.
        old_primary, promoted = sentinel.primary, sentinel.replica
        old_primary.stop("kill")
        sentinel.wait_for_master(promoted.port, timeout=30)
        before = q.stats().waiting
        q.offer_many([("send_email", {"to": "a@b.c"})] * 200)  # only the promoted primary has these
        wait_for(lambda: (get(plane, ns, "queue", "jobs")["status"].get("backlog") or {}).get("waiting", 0)
                 >= before + 200, timeout=90, what="the status read from the promoted primary")
        wait_for(lambda: get(plane, ns, "deployment", "jobs-worker")["spec"]["replicas"] >= 5, timeout=20,
                 what="scaled on the backlog of the promoted primary")
        # (Ready itself waits for a rollout no kubelet here makes: its parts about Redis must hold)
        for part in ("RedisReachable", "AcceptingTasks"):
            wait_for(lambda: (condition(get(plane, ns, "queue", "jobs"), part) or {}).get("status") == "True",
                     timeout=30, what=f"{part} after the failover")
        ticks = q.stats().waiting
        wait_for(lambda: q.stats().waiting > ticks, timeout=15, what="ticks offered after the failover")
    finally:
        q.close()
    for kind, name in (("queue", "jobs"), ("queue", "inline"), ("schedule", "every-second")):
        text = yaml.safe_dump(get(plane, ns, kind, name)) + repr(events(plane, ns, name))
        assert PASSWORD not in text and "inel%40pw" not in text
