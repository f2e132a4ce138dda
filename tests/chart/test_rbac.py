"""RBAC: the operator, run as the chart's Deployment describes it and authenticated
as the chart's ServiceAccount (a token, not admin), completes the end-to-end
scenario with no permission refused; `kubectl auth can-i --list` for that account
shows exactly what the operator uses."""

from __future__ import annotations

import base64
import copy
import json

import pytest
import yaml

import effectmq
from tests.chart.support import (CHART, FULLNAME, RELEASE, ChartOperator, expand, get_object, granted,
                                 sa_token_kubeconfig)
from tests.support.operator import DeploymentWorker, wait_for
from tests.support.processes import ROOT

pytestmark = pytest.mark.kube

QUEUE = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())
SCHEDULE = yaml.safe_load((ROOT / "examples/k8s/schedule.yaml").read_text())
LEASE = f"{FULLNAME}"

# What the operator does in a namespace it serves (see charts/effectmq/templates/rbac.yaml).
SERVED = {
    "queues.effectmq.io": ["list", "watch"],
    "schedules.effectmq.io": ["list", "watch"],
    "queues.effectmq.io/status": ["patch"],
    "schedules.effectmq.io/status": ["patch"],
    "deployments.apps": ["list", "watch", "create", "patch", "delete"],
    "pods": ["list", "watch", "patch"],
    "secrets": ["get"],
    "events": ["create", "patch"],
}
CRDS = {"customresourcedefinitions.apiextensions.k8s.io": ["list", "watch"]}
NAMESPACES = {"namespaces": ["list", "watch"]}
LEADER = expand({"leases.coordination.k8s.io": ["get", "update"]}, names=LEASE) | \
    expand({"leases.coordination.k8s.io": ["create"]})


def sa_user(namespace: str, name: str = FULLNAME) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def install(plane, namespace: str, *args: str) -> tuple[dict, object]:
    plane.helm("install", RELEASE, str(CHART), "-n", namespace, *args)
    plane.kubectl("create", "serviceaccount", "nobody", "-n", namespace)  # the can-i baseline: no bindings
    deployment = plane.kubectl_json("get", "deployment", FULLNAME, "-n", namespace)
    return deployment, sa_token_kubeconfig(plane, namespace, FULLNAME)


def apply(plane, namespace: str, body: dict) -> None:
    plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))


def get(plane, namespace: str, kind: str, name: str) -> dict | None:
    return get_object(plane, kind, namespace, name)


def ready(body: dict | None) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in ((body or {}).get("status") or {})
               .get("conditions", []))


def test_cluster_wide_operator_under_the_chart_service_account(kube_control_plane, make_namespace, redis_url,
                                                               tmp_path):
    plane = kube_control_plane
    system, shop = make_namespace("emq-system"), make_namespace("shop")
    deployment, kubeconfig = install(plane, system)

    # can-i: exactly the served rules everywhere, plus the Lease in the release namespace
    baseline = sa_user(system, "nobody")
    assert granted(plane, sa_user(system), shop, baseline) == expand(SERVED) | expand(CRDS)
    assert granted(plane, sa_user(system), system, baseline) == expand(SERVED) | expand(CRDS) | LEADER
    # Secrets: only by name, never listed or watched.
    for verb in ("list", "watch"):
        answer = plane.kubectl("auth", "can-i", verb, "secrets", "--all-namespaces", f"--as={sa_user(system)}",
                               check=False)
        assert answer.stdout.strip() == "no", (verb, answer.stdout, answer.stderr)

    operator = ChartOperator(plane, deployment, kubeconfig, tmp_path)
    workers: list[DeploymentWorker] = []
    q = effectmq.SyncTaskQueue(f"{shop}/emails", url=redis_url)
    try:
        # The example Queue, its Redis URL from a Secret, scaling fast enough for a test.
        plane.kubectl("create", "secret", "generic", "redis-credentials", "-n", shop,
                      f"--from-literal=url={redis_url}")
        queue = copy.deepcopy(QUEUE)
        queue["spec"]["redis"] = {"urlFrom": {"secretKeyRef": {"name": "redis-credentials", "key": "url"}}}
        queue["spec"]["scaling"].update({"targetTasksPerReplica": 10, "maxReplicas": 3, "pollIntervalSeconds": 1,
                                         "scaleDownStabilizationSeconds": 2, "cooldownSeconds": 3})
        apply(plane, shop, queue)
        wait_for(lambda: get(plane, shop, "deployment", "emails-worker"), what="worker Deployment")
        wait_for(lambda: ready(get(plane, shop, "queue", "emails")), what="Queue Ready")
        assert "acquired leadership" in operator.log()
        lease = plane.kubectl_json("get", "lease", LEASE, "-n", system)
        assert lease["spec"]["holderIdentity"]

        # Backlog -> replicas (Deployment scale, status, an Event).
        ids = [q.offer("send_email", {"to": f"user{i}@example.com"}).task_id for i in range(25)]
        replicas = lambda: get(plane, shop, "deployment", "emails-worker")["spec"]["replicas"]  # noqa: E731
        wait_for(lambda: replicas() == 3, timeout=20, what="scaled up to 3")
        status = wait_for(lambda: (s := get(plane, shop, "queue", "emails")["status"]).get("desiredReplicas") == 3
                          and s, timeout=10, what="status")
        assert status["backlog"]["waiting"] == 25
        events = plane.kubectl_json("get", "events", "-n", shop)["items"]
        assert any(e["reason"] == "Scaled" and e["involvedObject"]["name"] == "emails" for e in events)

        # The pods the ReplicaSet created (no kubelet runs them): local processes play
        # them, with the Deployment's command and environment and the pods' names.
        selector = "app.kubernetes.io/name=effectmq-worker,app.kubernetes.io/instance=emails"
        pods = wait_for(lambda: len(p := plane.kubectl_json("get", "pods", "-n", shop, "-l", selector)["items"]) == 3
                        and p, timeout=20, what="worker pods")
        deployment_now = get(plane, shop, "deployment", "emails-worker")
        workers = [DeploymentWorker(plane, shop, deployment_now, p["metadata"]["name"], tmp_path) for p in pods]
        results = [q.wait(t, timeout=60) for t in ids]
        assert [r["delivered_to"] for r in results] == [f"user{i}@example.com" for i in range(25)]

        # Busy pods are protected: every worker pod carries a deletion cost.
        cost = "controller.kubernetes.io/pod-deletion-cost"
        wait_for(lambda: all(cost in (p["metadata"].get("annotations") or {}) for p in
                             plane.kubectl_json("get", "pods", "-n", shop, "-l", selector)["items"]),
                 timeout=20, what="pod-deletion-cost annotations")

        # The example Schedule, every second: ticks become tasks the workers run.
        schedule = copy.deepcopy(SCHEDULE)
        schedule["spec"].update({"schedule": "* * * * * *", "timeZone": "UTC"})
        apply(plane, shop, schedule)
        status = wait_for(lambda: (s := (get(plane, shop, "schedule", "nightly-report") or {}).get("status") or {})
                          .get("lastTaskID") and s, timeout=20, what="a tick")
        assert q.wait(status["lastTaskID"], timeout=30)["report"] == "daily"
        assert ready(get(plane, shop, "schedule", "nightly-report"))
        plane.kubectl("patch", "schedule", "nightly-report", "-n", shop, "--type=merge", "-p",
                      json.dumps({"spec": {"suspend": True}}))

        # Idle -> back to zero after the cooldown.
        wait_for(lambda: replicas() == 0, timeout=40, what="scaled to zero")
    except AssertionError:  # what the operator saw, for a failure CI could not repeat
        print("operator log (its end):\n" + operator.log())
        raise
    finally:
        for worker in workers:
            worker.stop()
        q.close()
        operator.stop()
    # Leaving, the operator hands its Lease back (a patch).
    assert plane.kubectl_json("get", "lease", LEASE, "-n", system)["spec"].get("holderIdentity", "") == ""
    assert operator.permission_problems() == [], operator.log()


def test_namespaced_operator_under_the_chart_service_account(kube_control_plane, make_namespace, redis_url,
                                                             tmp_path):
    plane = kube_control_plane
    system, shop, other = make_namespace("emq-system"), make_namespace("shop"), make_namespace("other")
    deployment, kubeconfig = install(plane, system, "--set", f"watchNamespaces={{{shop}}}")
    env = {e["name"]: e.get("value", "") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["EFFECTMQ_WATCH_NAMESPACES"] == shop

    baseline = sa_user(system, "nobody")
    cluster = expand(CRDS) | expand(NAMESPACES)
    assert granted(plane, sa_user(system), shop, baseline) == expand(SERVED) | cluster
    assert granted(plane, sa_user(system), system, baseline) == cluster | LEADER
    assert granted(plane, sa_user(system), other, baseline) == cluster

    operator = ChartOperator(plane, deployment, kubeconfig, tmp_path)
    try:
        for namespace in (shop, other):
            queue = copy.deepcopy(QUEUE)
            queue["spec"]["redis"] = {"url": redis_url}
            queue["spec"]["scaling"]["pollIntervalSeconds"] = 1
            apply(plane, namespace, queue)
            schedule = copy.deepcopy(SCHEDULE)
            schedule["spec"].update({"schedule": "* * * * * *", "timeZone": "UTC"})
            apply(plane, namespace, schedule)
        # Reconciled (ticks scale it to one pod, which stays Pending here: so not Ready).
        wait_for(lambda: any(c["type"] == "RedisReachable" and c["status"] == "True" for c in
                             (get(plane, shop, "queue", "emails").get("status") or {}).get("conditions", [])),
                 what="Queue reconciled")
        status = wait_for(lambda: ((get(plane, shop, "schedule", "nightly-report") or {}).get("status") or {})
                          .get("lastTaskID"), timeout=20, what="a tick")
        assert status.startswith(f"{shop}/nightly-report/")
        wait_for(lambda: get(plane, shop, "deployment", "emails-worker")["spec"]["replicas"] == 1, timeout=20,
                 what="ticks scale the Queue up")
        # Not served: no Deployment, no status in the other namespace.
        assert get(plane, other, "deployment", "emails-worker") is None
        assert not get(plane, other, "queue", "emails").get("status")
    finally:
        operator.stop()
    assert operator.permission_problems() == [], operator.log()


def test_token_is_the_service_account(kube_control_plane, make_namespace):
    """The kubeconfig the operator gets really is the ServiceAccount, not admin."""
    plane = kube_control_plane
    system = make_namespace("emq-system")
    _, kubeconfig = install(plane, system)
    token = json.loads(kubeconfig.read_text())["users"][0]["user"]["token"]
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    assert claims["sub"] == sa_user(system)
    denied = plane.kubectl(f"--kubeconfig={kubeconfig}", "get", "configmaps", "-n", system, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
