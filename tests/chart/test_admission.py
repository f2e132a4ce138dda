"""Admission: the chart's ValidatingAdmissionPolicies,
on the test API server, confine what the operator's ServiceAccount and Queue authors
may write, whatever RBAC grants them (requests made as them, by impersonation)."""

from __future__ import annotations

import copy
import json

import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException

from tests.chart.support import CHART, FULLNAME, RELEASE, sa_token_kubeconfig
from tests.support.operator import wait_for
from tests.support.processes import ROOT

pytestmark = pytest.mark.kube

QUEUE = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())
COST = "controller.kubernetes.io/pod-deletion-cost"
WORKER_LABELS = {  # builders.worker_labels("emails")
    "app.kubernetes.io/name": "effectmq-worker", "app.kubernetes.io/instance": "emails",
    "app.kubernetes.io/component": "worker", "app.kubernetes.io/part-of": "effectmq",
    "app.kubernetes.io/managed-by": "effectmq-operator", "effectmq.io/queue": "emails",
}


def pod(name: str, namespace: str, labels: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "main", "image": "example.invalid/worker:1"}]}}


def deployment(name: str, labels: dict[str, str]) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": 0, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "main", "image": "example.invalid/w:1"}]}}}}


def as_user(plane, user: str, *args: str, input: str | None = None):
    return plane.kubectl(f"--as={user}", *args, check=False, input=input)


def refused(result, text: str) -> bool:
    return result.returncode != 0 and "denied request" in result.stderr and text in result.stderr


@pytest.fixture
def install(kube_control_plane):
    """helm install, and uninstall after the test: the policies are cluster-scoped and would
    outlive the test's namespace (an allow-list would refuse other tests' Queues)."""
    releases: list[str] = []

    def install(namespace: str, *args: str) -> None:
        kube_control_plane.helm("install", RELEASE, str(CHART), "-n", namespace, *args)
        releases.append(namespace)

    yield install
    for namespace in releases:
        kube_control_plane.helm("uninstall", RELEASE, "-n", namespace, "--wait", check=False)


def type_checked(plane, name: str) -> None:
    """The API server found no type error in the policy's expressions."""
    status = wait_for(lambda: plane.kubectl_json("get", "validatingadmissionpolicy", name).get("status"),
                      what=f"{name} type-checked")
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status


class Outcome:
    """What the API server answered a request made with the operator's own token."""

    def __init__(self, call, *args, **kwargs):
        self.returncode, self.stderr = 0, ""
        try:
            call(*args, **kwargs)
        except ApiException as exc:
            self.returncode, self.stderr = exc.status, f"{exc.reason}: {exc.body}"


def test_the_operator_service_account_writes_only_its_workers(kube_control_plane, make_namespace, install):
    plane = kube_control_plane
    system, shop = make_namespace("emq-system"), make_namespace("shop")
    install(system)
    type_checked(plane, f"{FULLNAME}-{system}-operator-writes")
    operator = f"system:serviceaccount:{system}:{FULLNAME}"
    api = kubernetes.config.new_client_from_config(str(sa_token_kubeconfig(plane, system, FULLNAME)))
    core, apps = kubernetes.client.CoreV1Api(api), kubernetes.client.AppsV1Api(api)
    victim = f"victim-{shop}"  # a pod in kube-system (no kubelet runs it: the API object is enough)
    plane.kubectl("apply", "-f", "-", input=json.dumps(pod(victim, "kube-system", {"app": "dns"})))
    plane.kubectl("apply", "-f", "-", input=json.dumps(pod("emails-worker-1", shop, WORKER_LABELS)))
    try:
        # RBAC alone lets it patch any pod: the policy refuses the image swap.
        assert as_user(plane, operator, "auth", "can-i", "patch", "pods", "-n", "kube-system").returncode == 0
        image = {"spec": {"containers": [{"name": "main", "image": "attacker.example/img:1"}]}}
        # The binding takes effect a moment after it is created: probe with a dry run (admission runs, nothing
        # is written) until it does.
        wait_for(lambda: refused(Outcome(core.patch_namespaced_pod, victim, "kube-system", image, dry_run="All"),
                                 "pod-deletion-cost"), timeout=20, what="the policy in force")
        swap = Outcome(core.patch_namespaced_pod, victim, "kube-system", image)
        assert swap.returncode == 403 and refused(swap, "only on its worker pods"), swap.stderr
        assert plane.kubectl_json("get", "pod", victim, "-n", "kube-system")["spec"]["containers"][0]["image"] \
            == "example.invalid/worker:1"
        # Not even the deletion cost of a pod that is not its worker.
        cost = {"metadata": {"annotations": {COST: "7"}}}
        assert refused(Outcome(core.patch_namespaced_pod, victim, "kube-system", cost), "pod-deletion-cost")
        # Its own worker pod: the deletion cost is fine (as kube.annotate_pod sends it), not the image,
        # another annotation or a label.
        done = Outcome(core.patch_namespaced_pod, "emails-worker-1", shop, cost)
        assert done.returncode == 0, done.stderr
        got = plane.kubectl_json("get", "pod", "emails-worker-1", "-n", shop)["metadata"]["annotations"]
        assert got[COST] == "7"
        for change in (image, {"metadata": {"annotations": {"example.com/x": "y"}}},
                       {"metadata": {"labels": {"app.kubernetes.io/instance": "other"}}}):
            assert refused(Outcome(core.patch_namespaced_pod, "emails-worker-1", shop, change),
                           "pod-deletion-cost"), change

        # Deployments: only with its worker labels, and only its own ones changed or deleted.
        plain = Outcome(apps.create_namespaced_deployment, shop, deployment("not-a-worker", {"app": "x"}))
        assert plain.returncode == 403 and refused(plain, "only Deployments labelled as its workers"), plain.stderr
        own = Outcome(apps.create_namespaced_deployment, shop, deployment("emails-worker", WORKER_LABELS))
        assert own.returncode == 0, own.stderr
        plane.kubectl("create", "-n", shop, "-f", "-", input=json.dumps(deployment("someone-else", {"app": "y"})))
        assert refused(Outcome(apps.delete_namespaced_deployment, "someone-else", shop),
                       "only Deployments labelled as its workers")
        assert refused(Outcome(apps.patch_namespaced_deployment, "someone-else", shop,
                               {"metadata": {"labels": WORKER_LABELS}}), "only Deployments labelled as its workers")
        steal = {"metadata": {"labels": {"app.kubernetes.io/managed-by": "someone"}}}
        assert refused(Outcome(apps.patch_namespaced_deployment, "emails-worker", shop, steal),
                       "only Deployments labelled as its workers")
        gone = Outcome(apps.delete_namespaced_deployment, "emails-worker", shop)
        assert gone.returncode == 0, gone.stderr
        # Admin is not confined.
        plane.kubectl("patch", "pod", victim, "-n", "kube-system", "--type=merge", "-p", json.dumps(cost))
    finally:
        plane.kubectl("delete", "pod", victim, "-n", "kube-system", "--wait=false", check=False)
        api.close()


def test_operator_policy_can_be_turned_off(kube_control_plane, make_namespace):
    plane = kube_control_plane
    system = make_namespace("emq-system")
    rendered = plane.helm("template", RELEASE, str(CHART), "-n", system,
                          "--set", "admission.operatorWrites.enabled=false",
                          "--set", "admission.queueAuthor.enabled=false").stdout
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def grant(plane, namespace: str, user: str, rules: list[dict]) -> None:
    name = f"test-{user}"
    plane.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": name, "namespace": namespace}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": name, "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}]}))


QUEUES = {"apiGroups": ["effectmq.io"], "resources": ["queues"], "verbs": ["create", "get", "patch", "update"]}
DEPLOYMENTS = {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create"]}


def queue(name: str, **worker) -> str:
    body = copy.deepcopy(QUEUE)
    body["metadata"] = {"name": name}
    body["spec"]["redis"] = {"url": "redis://example.invalid:6379/0"}
    body["spec"]["worker"].update(worker)
    return json.dumps(body)


def test_a_queue_author_must_be_allowed_to_create_its_deployment(kube_control_plane, make_namespace, install):
    plane = kube_control_plane
    system, team = make_namespace("emq-system"), make_namespace("team")
    install(system, "--set", "admission.queueAuthor.allowedImagePrefixes={registry.example/team/}",
            "--set", "admission.queueAuthor.allowedServiceAccounts={team-workers}")
    type_checked(plane, f"{FULLNAME}-{system}-queue-author")
    queues_only, both = f"queues-only-{team}", f"both-{team}"
    grant(plane, team, queues_only, [QUEUES])
    grant(plane, team, both, [QUEUES, DEPLOYMENTS])
    image = "registry.example/team/workers:1"

    wait_for(lambda: refused(as_user(plane, queues_only, "create", "--dry-run=server", "-n", team, "-f", "-",
                                     input=queue("q1", image=image)), "must be allowed"),
             timeout=20, what="the policy in force")  # a dry run: admission runs, nothing is written
    denied = as_user(plane, queues_only, "create", "-n", team, "-f", "-", input=queue("q1", image=image))
    assert refused(denied, "must be allowed"), denied.stderr
    assert (f"a Queue makes the effectmq operator create a worker Deployment in namespace {team}, so its author "
            f"must be allowed to create Deployments there: {queues_only} is not") in denied.stderr
    created = as_user(plane, both, "create", "-n", team, "-f", "-", input=queue("q1", image=image))
    assert created.returncode == 0, created.stderr

    # A spec change by the Deployment-less user is refused too; a metadata-only one is not.
    patch = json.dumps({"spec": {"worker": {"concurrency": 2}}})
    assert refused(as_user(plane, queues_only, "patch", "queue", "q1", "-n", team, "--type=merge", "-p", patch),
                   "must be allowed")
    label = as_user(plane, queues_only, "patch", "queue", "q1", "-n", team, "--type=merge", "-p",
                    json.dumps({"metadata": {"labels": {"team": "a"}}}))
    assert label.returncode == 0, label.stderr

    # The allow-lists.
    other = as_user(plane, both, "create", "-n", team, "-f", "-", input=queue("q2", image="attacker.example/img:1"))
    assert refused(other, "spec.worker.image attacker.example/img:1 does not start with an allowed prefix: "
                          "registry.example/team/"), other.stderr
    admin_sa = as_user(plane, both, "create", "-n", team, "-f", "-",
                       input=queue("q3", image=image, podTemplate={"serviceAccountName": "namespace-admin"}))
    assert refused(admin_sa, "serviceAccountName namespace-admin is not an allowed ServiceAccount: team-workers")
    listed = as_user(plane, both, "create", "-n", team, "-f", "-",
                     input=queue("q4", image=image, podTemplate={"serviceAccountName": "team-workers"}))
    assert listed.returncode == 0, listed.stderr

    # Secrets the worker pods would read (envFrom is a second way, beside env): the
    # author needs the right to create the Deployment, whose pods could read them anyway.
    for name, reads in (("q5", {"envFrom": [{"secretRef": {"name": "other-teams-secret"}}]}),
                        ("q6", {"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {
                            "name": "other-teams-secret", "key": "token"}}}]})):
        denied = as_user(plane, queues_only, "create", "-n", team, "-f", "-", input=queue(name, image=image, **reads))
        assert refused(denied, "must be allowed to create Deployments there"), denied.stderr
        created = as_user(plane, both, "create", "-n", team, "-f", "-", input=queue(name, image=image, **reads))
        assert created.returncode == 0, created.stderr
        spec = plane.kubectl_json("get", "queue", name, "-n", team)["spec"]["worker"]
        assert {k: spec[k] for k in reads} == reads  # kept, not pruned: the CRD knows envFrom
