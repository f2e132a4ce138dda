"""The chart on the real control plane: lint, server-side dry-run of the rendered
objects, install / upgrade / uninstall, the restricted Pod Security profile,
`helm test`, and values the schema rejects."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys

import pytest
import redis as redis_client
import yaml

from tests.chart.support import (CHART, FULLNAME, RELEASE, ChartOperator, ContainerRedis, docs, find, get_object,
                                 helm_template, ref, render, sa_token_kubeconfig)
from tests.support.operator import wait_for

pytestmark = pytest.mark.kube

RECOMMENDED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                      "app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by",
                      "helm.sh/chart")
CRD_NAMES = ("queues.effectmq.io", "schedules.effectmq.io")
VALUE_SETS = {
    "defaults": [],
    "redis": ["--set", "redis.enabled=true", "--set", "redis.maxmemory=256mb", "--set", "redis.appendfsync=always"],
    "no-persistence": ["--set", "redis.enabled=true", "--set", "redis.persistence.enabled=false",
                       "--set", "tests.enabled=false"],
    "digest": ["--set", "image.digest=sha256:" + "a" * 64, "--set", "replicaCount=2", "--set", "verbose=true"],
    "tracing": ["--set", "tracing.otlpEndpoint=http://otel-collector.observability:4318",
                "--set", "tracing.sampleRatio=0.5"],
}


def test_helm_lint(kube_control_plane):
    for args in [[], ["--set", "redis.enabled=true"], ["--set", "watchNamespaces={shop,billing}"]]:
        result = kube_control_plane.helm("lint", str(CHART), "--strict", *args)
        assert "0 chart(s) failed" in result.stdout, result.stdout


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_template_passes_server_side_dry_run(kube_control_plane, make_namespace, values):
    plane = kube_control_plane
    namespace = make_namespace("dry")
    rendered = helm_template(plane, namespace, "--include-crds", *VALUE_SETS[values]).stdout
    result = plane.kubectl("apply", "--dry-run=server", "-f", "-", "-o", "name", input=rendered)
    assert len(result.stdout.split()) == len(docs(rendered)), result.stdout


def test_namespaced_template_passes_server_side_dry_run(kube_control_plane, make_namespace):
    plane = kube_control_plane
    namespace, shop, billing = make_namespace("dry"), make_namespace("shop"), make_namespace("billing")
    rendered = helm_template(plane, namespace, "--set", f"watchNamespaces={{{shop},{billing}}}").stdout
    objects = docs(rendered)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] == "Role"} == {namespace, shop, billing}
    plane.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)


def _pod_from(workload: dict, namespace: str) -> dict:
    """The pod a Deployment's or StatefulSet's controller would create."""
    name, template = workload["metadata"]["name"], copy.deepcopy(workload["spec"]["template"])
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        claim_name = claim["metadata"]["name"]
        template["spec"].setdefault("volumes", []).append(
            {"name": claim_name, "persistentVolumeClaim": {"claimName": f"{claim_name}-{name}-0"}})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": template["metadata"].get("labels", {})},
            "spec": template["spec"]}


def test_every_pod_meets_the_restricted_pod_security_standard(kube_control_plane, make_namespace):
    """A namespace enforcing `restricted` admits every pod the chart makes (the
    operator, the bundled Redis, the test pod), and rejects a pod without them."""
    plane = kube_control_plane
    namespace = make_namespace("restricted", {"pod-security.kubernetes.io/enforce": "restricted",
                                             "pod-security.kubernetes.io/enforce-version": "latest"})
    objects = render(plane, namespace, "--set", "redis.enabled=true")
    pods = [_pod_from(o, namespace) for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    pods.append(find(objects, "Pod"))
    assert len(pods) == 3
    plane.kubectl("apply", "-f", "-", input=json.dumps(find(objects, "ServiceAccount")))  # pods name it
    for pod in pods:
        plane.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod))
    operator = copy.deepcopy(pods[0])
    del operator["spec"]["containers"][0]["securityContext"]
    refused = plane.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(operator), check=False)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr
    # the whole release installs there without Pod Security warnings
    plane.kubectl("delete", "serviceaccount", FULLNAME, "-n", namespace)
    install = plane.helm("install", RELEASE, str(CHART), "-n", namespace, "--set", "redis.enabled=true",
                         "--set", "redis.persistence.enabled=false")
    assert "PodSecurity" not in install.stderr, install.stderr
    plane.helm("uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s")


def _labels_ok(obj: dict) -> list[str]:
    labels = obj["metadata"].get("labels") or {}
    problems = [f"{obj['kind']}/{obj['metadata']['name']} lacks {k}" for k in RECOMMENDED_LABELS if k not in labels]
    template = (obj.get("spec") or {}).get("template")
    if template:
        tlabels = template["metadata"].get("labels") or {}
        problems += [f"{obj['kind']}/{obj['metadata']['name']} pod template lacks {k}"
                     for k in RECOMMENDED_LABELS if k not in tlabels]
    return problems


def _manifest(plane, namespace: str) -> list[dict]:
    return docs(plane.helm("get", "manifest", RELEASE, "-n", namespace).stdout)


def _present(plane, objects: list[dict], namespace: str) -> dict[tuple, dict | None]:
    return {ref(o, namespace): get_object(plane, *ref(o, namespace)) for o in objects}


def _upgrade_crds_as_documented(plane, tmp_path) -> None:
    """The chart README, "CRD upgrades": the documented command updates CRDs that Helm created
    (and the plain server-side apply meets Helm's field ownership, hence the flag)."""
    upgraded = tmp_path / "crds"
    upgraded.mkdir()
    for source in sorted((CHART / "crds").glob("*.yaml")):
        crd = yaml.safe_load(source.read_text())
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] = "upgraded by the test"
        (upgraded / source.name).write_text(yaml.safe_dump(crd))
    conflict = plane.kubectl("apply", "--server-side", "-f", str(upgraded), check=False)
    assert conflict.returncode != 0 and 'conflict with "helm"' in conflict.stderr, conflict.stderr
    plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(upgraded))
    for name in CRD_NAMES:
        schema = get_object(plane, "crd", "", name)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert schema["description"] == "upgraded by the test"
    plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))  # back as shipped
    for name in CRD_NAMES:
        schema = get_object(plane, "crd", "", name)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert schema.get("description") != "upgraded by the test"


def test_install_upgrade_uninstall(kube_control_plane, make_namespace, tmp_path):
    plane = kube_control_plane
    namespace, watched = make_namespace("emq"), make_namespace("shop")

    # Helm installs crds/ only when they are missing: remove them so this install
    # shows it (they are back, identical, right after).
    existing = [n for n in CRD_NAMES if get_object(plane, "crd", "", n)]
    if existing:
        # the API server deletes every Queue and Schedule of the session first: on a loaded
        # machine that took over 60 s once (the test is about the install, not deletion speed)
        plane.kubectl("delete", "crd", *existing, "--wait=true", "--timeout=180s")

    # -- install
    # (no --wait: without a kubelet the operator pod never becomes ready here)
    result = plane.helm("install", RELEASE, str(CHART), "-n", namespace)
    assert "STATUS: deployed" in result.stdout
    assert "kubectl apply --server-side --force-conflicts -f charts/effectmq/crds/" in result.stdout  # NOTES.txt
    for name in CRD_NAMES:
        crd = get_object(plane, "crd", "", name)
        assert crd and any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])
    _upgrade_crds_as_documented(plane, tmp_path)
    installed = _manifest(plane, namespace)
    kinds = sorted(o["kind"] for o in installed)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Lease", "Role", "RoleBinding", "Service",
                     "ServiceAccount", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicy",
                     "ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicyBinding"], kinds
    present = _present(plane, installed, namespace)
    assert all(present.values()), [k for k, v in present.items() if v is None]
    assert sum((_labels_ok(o) for o in present.values()), []) == []
    deployment = present[("Deployment", namespace, FULLNAME)]
    pod_spec = deployment["spec"]["template"]["spec"]
    container = pod_spec["containers"][0]
    assert pod_spec["serviceAccountName"] == FULLNAME
    assert container["image"] == "effectmq-operator:0.1.0"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health", "scheme": "HTTP"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 9090, "health": 8080}
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    assert env["EFFECTMQ_WATCH_NAMESPACES"] == "" and env["EFFECTMQ_OPERATOR_LEASE"] == FULLNAME

    # -- upgrade: namespaced, two replicas, other ports, verbose, the bundled Redis
    plane.helm("upgrade", RELEASE, str(CHART), "-n", namespace, "--set", "replicaCount=2", "--set", "verbose=true",
               "--set", "metrics.port=9191", "--set", f"watchNamespaces={{{watched}}}", "--set", "redis.enabled=true",
               "--set", "redis.persistence.size=2Gi")
    upgraded = _manifest(plane, namespace)
    present = _present(plane, upgraded, namespace)
    assert all(present.values()), [k for k, v in present.items() if v is None]
    assert sum((_labels_ok(o) for o in present.values()), []) == []
    deployment = present[("Deployment", namespace, FULLNAME)]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    assert deployment["spec"]["replicas"] == 2 and container["args"] == ["--verbose"]
    assert env["EFFECTMQ_WATCH_NAMESPACES"] == watched and env["EFFECTMQ_OPERATOR_METRICS_PORT"] == "9191"
    assert present[("Service", namespace, FULLNAME)]["spec"]["ports"][0]["port"] == 9191
    assert present[("Role", watched, FULLNAME)] and present[("RoleBinding", watched, FULLNAME)]
    cluster_role = present[("ClusterRole", "", f"{FULLNAME}-{namespace}")]
    assert {r["resources"][0] for r in cluster_role["rules"]} == {"customresourcedefinitions", "namespaces"}
    statefulset = present[("StatefulSet", namespace, f"{FULLNAME}-redis")]
    claim = statefulset["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    config = present[("ConfigMap", namespace, f"{FULLNAME}-redis")]["data"]["redis.conf"]
    assert "appendonly yes" in config and "maxmemory-policy noeviction" in config
    pvc = f"data-{FULLNAME}-redis-0"
    wait_for(lambda: get_object(plane, "pvc", namespace, pvc), timeout=30, what="the Redis claim")
    assert plane.helm("history", RELEASE, "-n", namespace, "-o", "json").stdout.count('"revision"') == 2

    # -- upgrade back to the defaults: what is no longer rendered is removed, except data
    plane.helm("upgrade", RELEASE, str(CHART), "-n", namespace, "--reset-values")
    for gone in (("Role", watched, FULLNAME), ("RoleBinding", watched, FULLNAME),
                 ("StatefulSet", namespace, f"{FULLNAME}-redis"), ("ConfigMap", namespace, f"{FULLNAME}-redis")):
        wait_for(lambda: get_object(plane, *gone) is None, timeout=30, what=f"{gone} removed")
    assert get_object(plane, "pvc", namespace, pvc), "the Redis data must outlive the StatefulSet"
    env = {e["name"]: e.get("value", "") for e in get_object(plane, "deployment", namespace, FULLNAME)
           ["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["EFFECTMQ_WATCH_NAMESPACES"] == ""

    # -- uninstall: every object goes, the CRDs (and so every Queue) and the data stay
    final = _manifest(plane, namespace)
    plane.helm("uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s")
    for key in (ref(o, namespace) for o in final):
        wait_for(lambda: get_object(plane, *key) is None, timeout=30, what=f"{key} deleted")
    assert all(get_object(plane, "crd", "", n) for n in CRD_NAMES)
    assert get_object(plane, "pvc", namespace, pvc)
    assert plane.helm("list", "-n", namespace, "-q").stdout.strip() == ""


def test_a_lease_the_operator_made_is_adopted_with_take_ownership(kube_control_plane, make_namespace, effectmq_crds):
    """The chart README, "CRD upgrades": a release from before the chart owned its Lease has one
    the operator created; Helm refuses to take it silently and adopts it with
    --take-ownership, after which uninstall removes it."""
    plane = kube_control_plane
    namespace = make_namespace("adopt")
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": FULLNAME, "namespace": namespace},
             "spec": {"holderIdentity": "old-operator-pod", "leaseDurationSeconds": 15}}
    plane.kubectl("create", "-f", "-", input=json.dumps(lease))
    refused = plane.helm("install", RELEASE, str(CHART), "-n", namespace, check=False)
    assert refused.returncode != 0 and "cannot be imported into the current release" in refused.stderr
    plane.helm("uninstall", RELEASE, "-n", namespace, check=False)  # the failed release, if recorded
    plane.helm("install", RELEASE, str(CHART), "-n", namespace, "--take-ownership")
    adopted = get_object(plane, "lease", namespace, FULLNAME)
    assert adopted["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
    assert adopted["spec"]["holderIdentity"] == "old-operator-pod"  # the leader is not disturbed
    plane.helm("uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "60s")
    wait_for(lambda: get_object(plane, "lease", namespace, FULLNAME) is None, timeout=30, what="the Lease removed")


def test_helm_test_checks_the_operator_and_the_bundled_redis(kube_control_plane, make_namespace, effectmq_crds,
                                                            tmp_path):
    """`helm test` with the kubelet's part played here: the test pod's command runs
    locally against the operator (run as the chart's Deployment, under its
    ServiceAccount) and the Redis StatefulSet's own command (its redis.conf and its
    Secret's password); its exit code becomes the pod's phase."""
    plane = kube_control_plane
    namespace = make_namespace("emq")
    plane.helm("install", RELEASE, str(CHART), "-n", namespace, "--set", "redis.enabled=true")
    deployment = plane.kubectl_json("get", "deployment", FULLNAME, "-n", namespace)
    operator = ChartOperator(plane, deployment, sa_token_kubeconfig(plane, namespace, FULLNAME), tmp_path)
    # the bundled Redis: its container's own command, with the objects the install made
    redis_name = f"{FULLNAME}-redis"
    secret = {k: base64.b64decode(v).decode() for k, v in get_object(plane, "secret", namespace, redis_name)
              ["data"].items()}
    redis = ContainerRedis(get_object(plane, "statefulset", namespace, redis_name),
                           get_object(plane, "configmap", namespace, redis_name), {redis_name: secret},
                           tmp_path / "redis").start()
    local = {f"{FULLNAME}.{namespace}.svc:8080": f"127.0.0.1:{operator.liveness_port}",
             f"{FULLNAME}.{namespace}.svc:9090": f"127.0.0.1:{operator.metrics_port}",
             f"{redis_name}.{namespace}.svc:6379": f"127.0.0.1:{redis.port}"}

    def here(value: str) -> str:
        for remote, address in local.items():
            value = value.replace(remote, address)
        return value

    client = redis_client.Redis.from_url(here(secret["url"]), socket_connect_timeout=1)

    def run_test_pod(pod: dict, overrides: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        container = pod["spec"]["containers"][0]
        env = {e["name"]: here(e["value"]) for e in container["env"]}
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for mount in container.get("volumeMounts", []):  # the Secret's files, as the kubelet writes them
            directory = tmp_path / "test-pod" / mount["name"]
            directory.mkdir(parents=True, exist_ok=True)
            for item in volumes[mount["name"]]["secret"]["items"]:
                assert volumes[mount["name"]]["secret"]["secretName"] == redis_name
                (directory / item["path"]).write_text(here(secret[item["key"]]))
            env = {k: v.replace(mount["mountPath"], str(directory)) for k, v in env.items()}
        env.update(overrides or {})
        command = container["command"] + container["args"]
        assert command[0] == "python"
        return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=180)

    helm_test = subprocess.Popen([str(plane.bin_dir / "helm"), f"--kubeconfig={plane.kubeconfig}", "test", RELEASE,
                                  "-n", namespace, "--timeout", "120s"],
                                 env=plane.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pod = wait_for(lambda: get_object(plane, "pod", namespace, f"{FULLNAME}-test"), timeout=30, what="test pod")
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        result = run_test_pod(pod)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "ok: operator liveness" in result.stdout and "ok: operator metrics" in result.stdout
        assert "maxmemory-policy noeviction, appendonly yes" in result.stdout
        assert "ok: bundled Redis without the password: a client without the password gets" in result.stdout
        assert secret["password"] not in result.stdout + result.stderr
        plane.kubectl("patch", "pod", f"{FULLNAME}-test", "-n", namespace, "--subresource=status", "--type=merge",
                      "-p", json.dumps({"status": {"phase": "Succeeded"}}))
        output, _ = helm_test.communicate(timeout=60)
        assert helm_test.returncode == 0, output
        assert "Phase:          Succeeded" in output

        # The same check fails, and says why, on a Redis that may evict.
        assert (redis.volume_dir("data") / "appendonlydir").is_dir()  # AOF files where the volume is
        client.config_set("maxmemory-policy", "allkeys-lru")
        failed = run_test_pod(pod, {"EFFECTMQ_TEST_TIMEOUT": "5"})
        assert failed.returncode != 0 and "must run with noeviction" in failed.stderr, failed.stderr
        client.close()
    finally:
        if helm_test.poll() is None:
            helm_test.kill()
            helm_test.wait()
        operator.stop()
        redis.stop()
    assert operator.permission_problems() == []


BAD_VALUES = [
    ("replicaCount=-1", "/replicaCount", "minimum"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy", "value must be one of 'Always', 'IfNotPresent', 'Never'"),
    ("watchNamespaces=shop", "/watchNamespaces", "got string, want array"),
    ("watchNamespaces={Shop_1}", "/watchNamespaces/0", "does not match pattern"),
    ("replicas=2", "additional properties 'replicas' not allowed", ""),
    ("redis.appendfsync=no", "/redis/appendfsync", "value must be one of 'always', 'everysec'"),
    ("redis.persistence.size=lots", "/redis/persistence/size", "does not match pattern"),
    ("image.digest=sha256:xyz", "/image/digest", "does not match pattern"),
    ("serviceAccount.create=false", "/serviceAccount/name", "minLength"),
    ("leaderElection.leaseDurationSeconds=1", "/leaderElection/leaseDurationSeconds", "minimum"),
    ("tracing.otlpEndpoint=collector:4318", "/tracing/otlpEndpoint", "does not match pattern"),
    ("tracing.sampleRatio=2", "/tracing/sampleRatio", "maximum"),
    ("tracing.sampleRatio=1.5", "/tracing/sampleRatio", "does not match pattern"),
]


@pytest.mark.parametrize("setting,where,why", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_schema_rejects_bad_values_readably(kube_control_plane, setting, where, why):
    plane = kube_control_plane
    for command in (["lint", str(CHART), "--strict"], ["template", RELEASE, str(CHART)]):
        result = plane.helm(*command, "--set", setting, check=False)
        output = result.stdout + result.stderr
        assert result.returncode != 0, f"helm {command[0]} accepted {setting}"
        assert where in output and why in output, output


def test_template_rejects_equal_ports(kube_control_plane):
    """A rule the schema cannot express (two values compared) fails in the template;
    `helm lint` only reports template failures, `helm template` and `install` stop."""
    plane = kube_control_plane
    message = "metrics.port and liveness.port must differ (both are 8080)"
    result = plane.helm("template", RELEASE, str(CHART), "--set", "metrics.port=8080", check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert message in plane.helm("lint", str(CHART), "--set", "metrics.port=8080", check=False).stderr


def test_the_operator_exports_traces_only_when_given_an_endpoint(kube_control_plane):
    plane = kube_control_plane

    def operator_env(*values: str) -> dict:
        rendered = helm_template(plane, "effectmq", *values).stdout
        deployment = find(docs(rendered), "Deployment", FULLNAME)
        return {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert not [name for name in operator_env() if name.startswith("OTEL_")]
    env = operator_env(*VALUE_SETS["tracing"])
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability:4318"
    assert (env["OTEL_TRACES_SAMPLER"]["value"], env["OTEL_TRACES_SAMPLER_ARG"]["value"]) == (
        "parentbased_traceidratio", "0.5")
    names = list(env)  # the kubelet expands $(VAR) only from variables defined before it
    assert names.index("POD_NAMESPACE") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    every = operator_env("--set", "tracing.otlpEndpoint=https://c:4318")
    assert "OTEL_TRACES_SAMPLER" not in every and every["OTEL_SERVICE_NAME"]["value"] == "effectmq-operator"
