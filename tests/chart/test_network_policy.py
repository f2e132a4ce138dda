"""The chart's NetworkPolicies (it had none, and the bundled Redis
answered every pod of the cluster). This test cluster's network enforces no policies
(see the chart README, "NetworkPolicies"), so the policies are checked where they can
be: installed into a real API server, which validates and stores them, and then each
stored policy's selectors evaluated, by the rules of the NetworkPolicy API, against
the pods that really exist: the ones the API server's controllers made from the
chart's Deployments and StatefulSet, the helm-test pod, and worker pods from the
operator's own builder."""

from __future__ import annotations

import json

import pytest
import yaml

from effectmq_operator import builders
from effectmq_operator.spec import QueueSpec
from tests.chart.support import CHART, FULLNAME, RELEASE, find, render
from tests.support.operator import wait_for
from tests.support.processes import ROOT

pytestmark = pytest.mark.kube

QUEUE = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())
ALL_ON = ["--set", "networkPolicy.enabled=true", "--set", "redis.enabled=true", "--set", "dashboard.enabled=true",
          "--set", "redis.persistence.enabled=false"]


# --------------------------------------------------------------------------
# The NetworkPolicy API's rules (networking.k8s.io/v1), for pods as (namespace, labels)


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """A LabelSelector: {} selects everything; matchLabels and matchExpressions all hold."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def namespace_labels(name: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name}  # set by the API server on every namespace


def peer_admits(peer: dict, policy_namespace: str, pod: tuple[str, dict]) -> bool:
    namespace, labels = pod
    assert "ipBlock" not in peer, "the chart's policies name pods, not addresses"
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespace_labels(namespace)):
            return False
    elif namespace != policy_namespace:  # a podSelector alone: the policy's namespace
        return False
    return selects(peer.get("podSelector"), labels)


def admits(policies: list[dict], target: tuple[str, dict], source: tuple[str, dict], port: int | str) -> bool:
    """Whether traffic from `source` to `target` on `port` is allowed by the policies
    that select `target` (none selecting it: everything is allowed)."""
    selecting = [p for p in policies if p["metadata"]["namespace"] == target[0]
                 and selects(p["spec"]["podSelector"], target[1]) and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(p.get("port") in (None, port) for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(peer_admits(peer, policy["metadata"]["namespace"], source) for peer in peers):
                return True
    return False


def test_the_evaluator_follows_the_api_rules():
    """The rules above, on hand-made policies (so a wrong evaluator cannot pass the real test)."""
    policy = {"metadata": {"namespace": "a"}, "spec": {
        "podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"],
        "ingress": [{"ports": [{"port": 6379}], "from": [
            {"podSelector": {"matchLabels": {"role": "client"}}},
            {"namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In",
                                                         "values": ["b"]}]},
             "podSelector": {"matchLabels": {"role": "worker"}}}]}]}}
    db = ("a", {"app": "db"})
    assert admits([policy], db, ("a", {"role": "client"}), 6379)
    assert not admits([policy], db, ("a", {"role": "client"}), 80)
    assert not admits([policy], db, ("b", {"role": "client"}), 6379)  # podSelector alone: namespace a only
    assert admits([policy], db, ("b", {"role": "worker"}), 6379)
    assert not admits([policy], db, ("c", {"role": "worker"}), 6379)
    assert not admits([policy], db, ("a", {"role": "worker"}), 6379)
    assert admits([policy], ("a", {"app": "web"}), ("z", {}), 80)  # not selected: open


# --------------------------------------------------------------------------
# Rendering


def policies_of(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def test_by_default_only_the_bundled_redis_has_a_policy(kube_control_plane):
    assert policies_of(render(kube_control_plane, "emq")) == []
    (policy,) = policies_of(render(kube_control_plane, "emq", "--set", "redis.enabled=true"))
    assert policy["metadata"]["name"] == f"{FULLNAME}-redis"
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [6379]
    on = policies_of(render(kube_control_plane, "emq", "--set", "networkPolicy.enabled=true"))
    assert sorted(p["metadata"]["name"] for p in on) == [FULLNAME, f"{FULLNAME}-workers"]


def test_every_policy_admits_ingress_only_and_leaves_egress_open(kube_control_plane):
    objects = render(kube_control_plane, "emq", *ALL_ON, "--set", "watchNamespaces={shop,billing}")
    policies = policies_of(objects)
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in policies} == {
        ("emq", FULLNAME), ("emq", f"{FULLNAME}-dashboard"), ("emq", f"{FULLNAME}-redis"),
        ("emq", f"{FULLNAME}-workers"), ("shop", f"{FULLNAME}-workers"), ("billing", f"{FULLNAME}-workers")}
    for policy in policies:
        assert policy["spec"]["policyTypes"] == ["Ingress"], policy  # README: why egress stays open
        assert all(rule.get("from") and rule.get("ports") for rule in policy["spec"]["ingress"]), policy
    operator = find(policies, "NetworkPolicy", FULLNAME)
    assert [p["port"] for p in operator["spec"]["ingress"][0]["ports"]] == [9090, 8080]
    workers = find(policies, "NetworkPolicy", f"{FULLNAME}-workers", "shop")
    assert [p["port"] for p in workers["spec"]["ingress"][0]["ports"]] == ["metrics"]


def test_the_configured_sources_are_admitted(kube_control_plane):
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ingress = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}
    producers = {"podSelector": {"matchLabels": {"app": "shop-api"}}}
    objects = render(kube_control_plane, "emq", *ALL_ON,
                     "--set-json", f"networkPolicy.metricsFrom=[{json.dumps(monitoring)}]",
                     "--set-json", f"networkPolicy.dashboardFrom=[{json.dumps(ingress)}]",
                     "--set-json", f"redis.networkPolicy.extraFrom=[{json.dumps(producers)}]")
    policies = policies_of(objects)
    prometheus, nginx, api = ("monitoring", {"app": "prometheus"}), ("ingress", {"app": "nginx"}), \
        ("emq", {"app": "shop-api"})
    operator = ("emq", pod_labels(find(objects, "Deployment", FULLNAME)))
    dashboard = ("emq", pod_labels(find(objects, "Deployment", f"{FULLNAME}-dashboard")))
    redis = ("emq", pod_labels(find(objects, "StatefulSet", f"{FULLNAME}-redis")))
    worker = ("emq", worker_labels())
    assert admits(policies, operator, prometheus, 9090) and not admits(policies, operator, nginx, 9090)
    assert admits(policies, worker, prometheus, "metrics") and not admits(policies, worker, nginx, "metrics")
    assert admits(policies, dashboard, nginx, 8080) and not admits(policies, dashboard, prometheus, 8080)
    assert admits(policies, redis, api, 6379) and not admits(policies, redis, prometheus, 6379)


def test_the_schema_knows_the_new_values(kube_control_plane):
    for setting, where in (("networkPolicy.enabled=yes", "/networkPolicy/enabled"),
                           ("networkPolicy.metricsFrom=x", "/networkPolicy/metricsFrom"),
                           ("redis.auth.enabled=maybe", "/redis/auth/enabled"),
                           ("redis.networkPolicy.extraFrom=x", "/redis/networkPolicy/extraFrom")):
        result = kube_control_plane.helm("template", RELEASE, str(CHART), "--set", setting, check=False)
        assert result.returncode != 0 and where in result.stderr, (setting, result.stderr)


# --------------------------------------------------------------------------
# On the API server, against the pods that exist


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def worker_labels() -> dict[str, str]:
    spec = QueueSpec.parse(QUEUE["spec"], "emails")
    return pod_labels(builders.worker_deployment("any", "emails", spec, 1))


def worker_deployment(namespace: str) -> dict:
    deployment = builders.worker_deployment(namespace, "emails", QueueSpec.parse(QUEUE["spec"], "emails"), 1)
    deployment["metadata"]["namespace"] = namespace
    return deployment


def pods(plane, namespace: str, selector: dict[str, str]) -> list[dict]:
    labels = ",".join(f"{k}={v}" for k, v in selector.items())
    return plane.kubectl_json("get", "pods", "-n", namespace, "-l", labels)["items"]


def one_pod(plane, namespace: str, selector: dict[str, str], what: str) -> tuple[str, dict]:
    pod = wait_for(lambda: (found := pods(plane, namespace, selector)) and found[0], timeout=60,
                   what=f"the {what} pod made by its controller")
    return namespace, pod["metadata"]["labels"]


def test_installed_policies_admit_the_release_and_no_one_else(kube_control_plane, make_namespace, effectmq_crds):
    plane = kube_control_plane
    system, shop, other = make_namespace("emq-system"), make_namespace("shop"), make_namespace("other")
    install = plane.helm("install", RELEASE, str(CHART), "-n", system, *ALL_ON, "--set", f"watchNamespaces={{{shop}}}")
    try:
        assert "STATUS: deployed" in install.stdout
        stored = [p for ns in (system, shop, other)
                  for p in plane.kubectl_json("get", "networkpolicies", "-n", ns)["items"]]
        assert len(stored) == 5, [p["metadata"]["name"] for p in stored]
        rendered = render(plane, system, *ALL_ON, "--set", f"watchNamespaces={{{shop}}}")

        # the pods as the API server's controllers made them (no kubelet runs them here)
        operator = one_pod(plane, system, find(rendered, "Deployment", FULLNAME)["spec"]["selector"]["matchLabels"],
                           "operator")
        dashboard = one_pod(plane, system, find(rendered, "Deployment", f"{FULLNAME}-dashboard")
                            ["spec"]["selector"]["matchLabels"], "dashboard")
        redis = one_pod(plane, system, find(rendered, "StatefulSet", f"{FULLNAME}-redis")
                        ["spec"]["selector"]["matchLabels"], "Redis")
        test_pod = find(rendered, "Pod")
        plane.kubectl("create", "-n", system, "-f", "-", input=json.dumps(test_pod))
        tester = (system, plane.kubectl_json("get", "pod", test_pod["metadata"]["name"], "-n", system)
                  ["metadata"]["labels"])
        workers = {}
        for namespace in (system, shop, other):
            deployment = worker_deployment(namespace)
            plane.kubectl("apply", "-f", "-", input=json.dumps(deployment))
            workers[namespace] = one_pod(plane, namespace, deployment["spec"]["selector"]["matchLabels"],
                                         f"worker in {namespace}")
        plane.kubectl("run", "stranger", "-n", system, "--image=example.invalid/any:1", "--labels=app=shop-api")
        plane.kubectl("run", "stranger", "-n", other, "--image=example.invalid/any:1",
                      f"--labels={','.join(f'{k}={v}' for k, v in operator[1].items())}")  # the operator's labels
        stranger = (system, plane.kubectl_json("get", "pod", "stranger", "-n", system)["metadata"]["labels"])
        impostor = (other, plane.kubectl_json("get", "pod", "stranger", "-n", other)["metadata"]["labels"])

        # the bundled Redis: the release's operator, dashboard, test pod and workers, no one else, on 6379 only
        assert [p["metadata"]["name"] for p in stored if selects(p["spec"]["podSelector"], redis[1])
                and p["metadata"]["namespace"] == system] == [f"{FULLNAME}-redis"]
        for admitted in (operator, dashboard, tester, workers[system], workers[shop]):
            assert admits(stored, redis, admitted, 6379), admitted
            assert not admits(stored, redis, admitted, 6380)
        for refused in (stranger, impostor, workers[other]):
            assert not admits(stored, redis, refused, 6379), refused

        # the operator: its metrics and health ports, from its namespace
        assert admits(stored, operator, tester, 9090) and admits(stored, operator, tester, 8080)
        assert not admits(stored, operator, tester, 6379)
        assert not admits(stored, operator, impostor, 9090) and not admits(stored, operator, workers[shop], 9090)
        # the dashboard: its port, from its namespace
        assert admits(stored, dashboard, stranger, 8080) and not admits(stored, dashboard, impostor, 8080)
        assert not admits(stored, dashboard, stranger, 9090)
        # workers in the release namespace and the watched one: metrics only, from their own namespace
        for namespace in (system, shop):
            worker = workers[namespace]
            same = stranger if namespace == system else workers[namespace]
            assert admits(stored, worker, same, "metrics") and not admits(stored, worker, same, 8080)
            assert not admits(stored, worker, impostor, "metrics")
        # a namespace the release does not serve gets no policy of the chart
        assert admits(stored, workers[other], impostor, 8080)
    finally:
        plane.helm("uninstall", RELEASE, "-n", system, "--wait", "--timeout", "60s", check=False)
