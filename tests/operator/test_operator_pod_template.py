"""The worker fields that are core types, on a real API server: a Queue
applied with them gets a worker Deployment that has them, accepted by the API server's
own Deployment validation."""

from __future__ import annotations

import json

from tests.operator.test_operator_queues import apply, get, queue_manifest
from tests.support.operator import wait_for

WORKER = {
    "image": "registry.example/shop/workers:1.4.2",
    "handlers": "shop.tasks:app",
    "imagePullPolicy": "Always",
    "env": [{"name": "LOG_LEVEL", "value": "debug"}],
    "envFrom": [{"configMapRef": {"name": "shop-settings"}, "prefix": "SHOP_"},
                {"secretRef": {"name": "shop-api", "optional": True}}],
    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
    "podTemplate": {
        "priorityClassName": "queue-workers",
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "emails"}},
            "matchLabelKeys": ["pod-template-hash"]}],
        "imagePullSecrets": [{"name": "registry-credentials"}],
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "queues", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "emails"}}}}]}},
    },
}


def test_core_typed_worker_fields_reach_the_deployment(kube_control_plane, kube_namespace, start_operator,
                                                       redis_url):
    plane, ns = kube_control_plane, kube_namespace
    plane.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "queue-workers"},
        "value": 1000}))
    start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, worker=WORKER))
    deployment = wait_for(lambda: get(plane, ns, "deployment", "emails-worker"), what="worker Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["imagePullPolicy"] == "Always"
    assert container["envFrom"] == WORKER["envFrom"]
    assert {e["name"]: e.get("value") for e in container["env"]}["LOG_LEVEL"] == "debug"
    assert container["resources"] == WORKER["resources"]
    template = WORKER["podTemplate"]
    for field in ("priorityClassName", "topologySpreadConstraints", "imagePullSecrets", "affinity"):
        assert pod[field] == template[field], field
    assert pod["tolerations"] == template["tolerations"]
    # An edit of one of them rolls the Deployment to it.
    plane.kubectl("patch", "queue", "emails", "-n", ns, "--type=merge", "-p",
                  json.dumps({"spec": {"worker": {"imagePullPolicy": "IfNotPresent"}}}))
    wait_for(lambda: get(plane, ns, "deployment", "emails-worker")["spec"]["template"]["spec"]["containers"][0]
             ["imagePullPolicy"] == "IfNotPresent", what="the Deployment follows the edit")
