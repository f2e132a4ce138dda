"""The Queue and Schedule CRDs, checked by a real kube-apiserver, and the control
plane fixture itself (controller manager, garbage collection, CI behaviour)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from effectmq.protocol import settings
from tooling.testbed.controlplane import REPO_ROOT, KubeControlPlane, wait_until

pytestmark = pytest.mark.kube

EXAMPLES = REPO_ROOT / "examples" / "k8s"

QUEUE = {
    "apiVersion": "effectmq.io/v1alpha1",
    "kind": "Queue",
    "metadata": {"name": "q"},
    "spec": {
        "redis": {"url": "redis://redis:6379/0"},
        "worker": {"image": "example/workers:1", "handlers": "app.tasks:app"},
    },
}

SCHEDULE = {
    "apiVersion": "effectmq.io/v1alpha1",
    "kind": "Schedule",
    "metadata": {"name": "s"},
    "spec": {
        "queueRef": {"name": "q"},
        "schedule": "*/5 * * * *",
        "task": {"name": "tick"},
    },
}


def manifest(base: dict, name: str | None = None, **spec_changes) -> str:
    """A copy of base with spec keys replaced (None deletes), as JSON text."""
    obj = copy.deepcopy(base)
    if name:
        obj["metadata"]["name"] = name
    for key, value in spec_changes.items():
        if value is None:
            obj["spec"].pop(key, None)
        else:
            obj["spec"][key] = value
    return json.dumps(obj)


def get(kube: KubeControlPlane, ns: str, *what: str) -> dict:
    return kube.kubectl_json("get", "-n", ns, *what)


# ---------------------------------------------------------------- the CRDs are Established, with their names


def test_crds_are_established(kube_control_plane, effectmq_crds):
    assert sorted(effectmq_crds) == ["queues.effectmq.io", "schedules.effectmq.io"]
    for crd_name, short in [("queues.effectmq.io", "emqq"), ("schedules.effectmq.io", "emqs")]:
        crd = kube_control_plane.kubectl_json("get", "crd", crd_name)
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions.get("Established") == "True", conditions
        assert conditions.get("NamesAccepted") == "True", conditions
        assert crd["status"]["acceptedNames"]["shortNames"] == [short]
        assert crd["status"]["acceptedNames"]["categories"] == ["effectmq"]
        (version,) = crd["spec"]["versions"]
        assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}


def test_api_server_reports_the_pinned_release(kube_control_plane):
    info = json.loads(kube_control_plane.kubectl("version", "-o", "json").stdout)
    server, client = info["serverVersion"], info["clientVersion"]
    assert server["gitVersion"].startswith("v1.") and server["gitVersion"] != "v0.0.0"
    assert server["major"] == "1" and server["minor"] == server["gitVersion"].split(".")[1]
    assert client["gitVersion"] == server["gitVersion"]
    helm = kube_control_plane.helm("version", "--short").stdout
    assert helm.startswith("v3."), helm


# ---------------------------------------------------------------- the examples apply and read back with defaults


def test_examples_apply_and_read_back_with_defaults(kube_control_plane, effectmq_crds, kube_namespace):
    kube, ns = kube_control_plane, kube_namespace
    kube.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / "queue.yaml"))
    kube.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / "schedule.yaml"))

    queue = get(kube, ns, "queue", "emails")["spec"]
    written = yaml.safe_load((EXAMPLES / "queue.yaml").read_text())["spec"]
    # what the example says is kept ...
    assert queue["redis"] == written["redis"]
    assert queue["worker"]["image"] == written["worker"]["image"]
    assert queue["worker"]["env"] == [{"name": "EFFECTMQ_LOG_LEVEL", "value": "info"}]
    assert queue["worker"]["resources"] == written["worker"]["resources"]
    assert queue["maxRetries"] == 5
    # ... and what it leaves out is defaulted
    assert queue["paused"] is False
    assert queue["maxActive"] == 0
    assert queue["maxStalledCount"] == settings.default("max_stalled_count")
    assert queue["retry"] == {
        "backoff": "Exponential",
        "initialDelaySeconds": 1,
        "maxDelaySeconds": 300,
        "jitter": True,
    }
    assert queue["retention"] == {"completedSeconds": 86400, "failedSeconds": 604800}
    assert queue["worker"]["terminationGracePeriodSeconds"] == 60
    assert queue["scaling"] == {
        "minReplicas": 0,
        "maxReplicas": 20,
        "targetTasksPerReplica": 50,
        "activationTasks": 1,  # a default
        "pollIntervalSeconds": 5,  # the rest as the example sets them
        "scaleDownStabilizationSeconds": 30,
        "cooldownSeconds": 60,
    }

    schedule = get(kube, ns, "schedule", "nightly-report")["spec"]
    assert schedule["queueRef"] == {"name": "emails"}
    assert schedule["timeZone"] == "Europe/Berlin"
    assert schedule["task"]["payload"] == {"report": "daily"}
    assert schedule["task"]["priority"] == 0
    assert schedule["missedTicks"] == "Coalesce"
    assert schedule["maxBackfill"] == 10
    assert schedule["suspend"] is False

    # the smallest valid resources get every default
    kube.kubectl("create", "-n", ns, "-f", "-", input=manifest(QUEUE, "minimal", worker=None))
    kube.kubectl("create", "-n", ns, "-f", "-", input=manifest(SCHEDULE, "minimal"))
    minimal = get(kube, ns, "queue", "minimal")["spec"]
    assert minimal["lockTimeoutSeconds"] == 30 and minimal["lockRefreshSeconds"] == 10
    assert minimal["scaling"]["maxReplicas"] == 10
    assert "worker" not in minimal and "maxRetries" not in minimal
    minimal_schedule = get(kube, ns, "schedule", "minimal")["spec"]
    assert minimal_schedule["timeZone"] == "UTC"
    assert minimal_schedule["missedTicks"] == "Coalesce"

    # a payload may be any JSON value, kept exactly
    payload = {"nested": {"list": [1, "two", None, {"x": 1.5}]}, "flag": True}
    kube.kubectl(
        "create", "-n", ns, "-f", "-",
        input=manifest(SCHEDULE, "payload", task={"name": "t", "payload": payload}),
    )
    assert get(kube, ns, "schedule", "payload")["spec"]["task"]["payload"] == payload


def header(output: str) -> list[str]:
    return output.splitlines()[0].split()


def test_printer_columns_and_category(kube_control_plane, effectmq_crds, kube_namespace):
    kube, ns = kube_control_plane, kube_namespace
    kube.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / "queue.yaml"))
    kube.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / "schedule.yaml"))
    kube.kubectl(
        "patch", "queue", "emails", "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"backlog": {"waiting": 42, "active": 7}, "replicas": 3}}),
    )
    kube.kubectl(
        "patch", "schedule", "nightly-report", "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"nextTickTime": "2030-01-02T01:00:00Z"}}),
    )

    queues = kube.kubectl("get", "queues", "-n", ns).stdout
    assert header(queues) == ["NAME", "WAITING", "ACTIVE", "REPLICAS", "DESIRED", "READY", "AGE"], queues
    assert queues.splitlines()[1].split()[:4] == ["emails", "42", "7", "3"], queues

    schedules = kube.kubectl("get", "schedules", "-n", ns).stdout
    lines = schedules.splitlines()
    assert header(schedules) == [
        "NAME", "SCHEDULE", "LAST", "TICK", "NEXT", "TICK", "SUSPENDED", "AGE",
    ], schedules
    assert lines[1].startswith("nightly-report"), schedules
    assert "0 2 * * *" in lines[1] and "2030-01-02T01:00:00Z" in lines[1]
    assert "false" in lines[1].split()

    wide = kube.kubectl("get", "queues", "-n", ns, "-o", "wide").stdout
    assert header(wide) == ["NAME", "WAITING", "ACTIVE", "REPLICAS", "DESIRED", "READY", "REASON", "PAUSED", "AGE"]

    both = kube.kubectl("get", "effectmq", "-n", ns, "-o", "name").stdout.split()
    assert sorted(both) == ["queue.effectmq.io/emails", "schedule.effectmq.io/nightly-report"]
    table = kube.kubectl("get", "effectmq", "-n", ns).stdout
    assert "queue.effectmq.io/emails" in table and "schedule.effectmq.io/nightly-report" in table

    short = kube.kubectl("get", "emqq,emqs", "-n", ns, "-o", "name").stdout.split()
    assert sorted(short) == sorted(both)


@pytest.mark.parametrize("values", [
    ("--set", "redis.enabled=true"), ("--set", "redis.enabled=false"),
    ("--set", "redis.enabled=true", "--set", "dashboard.enabled=true"),
    ("--set", "redis.enabled=false", "--set", "dashboard.enabled=true",
     "--set", "dashboard.redis.url=redis://r:6379/0"),
], ids=["redis", "own-redis", "redis-dashboard", "own-redis-dashboard"])
def test_the_install_notes_keep_their_paragraphs_apart(kube_control_plane, kube_namespace, values):
    """Was: the notes ran two sentences together ("single replica.Create a
    Queue") when the dashboard was off."""
    out = kube_control_plane.helm("install", "emq", str(REPO_ROOT / "charts" / "effectmq"), "-n", kube_namespace,
                                  "--dry-run=client", *values).stdout
    notes = out[out.index("NOTES:"):]
    assert re.search(r"[.:/)]Create a Queue", notes) is None, notes
    assert "\n\nCreate a Queue and a Schedule" in notes, notes
    for line in notes.splitlines():  # no sentence runs into the next one
        assert re.search(r"[a-z]\.[A-Z]", line) is None, line


# ---------------------------------------------------------------- invalid resources are refused

INVALID = {
    "min-replicas-above-max": (
        manifest(QUEUE, scaling={"minReplicas": 5, "maxReplicas": 2}),
        ["scaling.minReplicas must be less than or equal to scaling.maxReplicas"],
    ),
    "negative-lock-timeout": (
        manifest(QUEUE, lockTimeoutSeconds=-1),
        ["spec.lockTimeoutSeconds", "should be greater than or equal to 1"],
    ),
    "negative-retention": (
        manifest(QUEUE, retention={"completedSeconds": -60}),
        ["spec.retention.completedSeconds", "should be greater than or equal to 0"],
    ),
    "negative-cooldown": (
        manifest(QUEUE, scaling={"cooldownSeconds": -1}),
        ["spec.scaling.cooldownSeconds", "should be greater than or equal to 0"],
    ),
    "starting-deadline-under-a-second": (  # the scheduler refuses it (ScheduleSpec)
        manifest(SCHEDULE, startingDeadlineSeconds=0),
        ["spec.startingDeadlineSeconds", "should be greater than or equal to 1"],
    ),
    "refresh-not-below-timeout": (
        manifest(QUEUE, lockTimeoutSeconds=10, lockRefreshSeconds=10),
        ["spec.lockRefreshSeconds", "lockRefreshSeconds must be less than lockTimeoutSeconds"],
    ),
    "unknown-backoff": (
        manifest(QUEUE, retry={"backoff": "Linear"}),
        ['spec.retry.backoff: Unsupported value: "Linear"', '"Fixed", "Exponential"'],
    ),
    "unknown-missed-ticks": (
        manifest(SCHEDULE, missedTicks="Never"),
        ['spec.missedTicks: Unsupported value: "Never"', '"Skip", "Coalesce", "Backfill"'],
    ),
    "missing-queue-ref": (
        manifest(SCHEDULE, queueRef=None),
        ["spec.queueRef: Required value"],
    ),
    "redis-url-and-url-from": (
        manifest(QUEUE, redis={"url": "redis://r", "urlFrom": {"secretKeyRef": {"name": "s", "key": "url"}}}),
        ["exactly one of redis.url and redis.urlFrom must be set"],
    ),
    "redis-neither": (
        manifest(QUEUE, redis={"tls": {"enabled": True}}),
        ["exactly one of redis.url and redis.urlFrom must be set"],
    ),
    "negative-prefetch": (
        manifest(QUEUE, worker={"image": "w", "handlers": "a:b", "prefetch": -1}),
        ["spec.worker.prefetch", "should be greater than or equal to 0"],
    ),
    "worker-without-image": (
        manifest(QUEUE, worker={"handlers": "a:b"}),
        ["spec.worker.image: Required value"],
    ),
    # Beyond the runtime's bound (protocol.MAX_DURATION): the operator's configure would refuse it.
    "lock-timeout-over-ten-years": (
        manifest(QUEUE, lockTimeoutSeconds=315360001, lockRefreshSeconds=10),
        ["spec.lockTimeoutSeconds", "should be less than or equal to 315360000"],
    ),
    "retention-over-ten-years": (
        manifest(QUEUE, retention={"completedSeconds": 2 ** 40}),
        ["spec.retention.completedSeconds", "should be less than or equal to 315360000"],
    ),
    # Was accepted, then nothing ever scaled (the next poll was 68 years away).
    "poll-interval-int32-max": (
        manifest(QUEUE, scaling={"pollIntervalSeconds": 2147483647}),
        ["spec.scaling.pollIntervalSeconds", "should be less than or equal to 3600"],
    ),
    "stabilization-over-an-hour": (
        manifest(QUEUE, scaling={"scaleDownStabilizationSeconds": 3601}),
        ["spec.scaling.scaleDownStabilizationSeconds", "should be less than or equal to 3600"],
    ),
    "cooldown-over-a-day": (
        manifest(QUEUE, scaling={"cooldownSeconds": 86401}),
        ["spec.scaling.cooldownSeconds", "should be less than or equal to 86400"],
    ),
    "progress-deadline-over-a-day": (
        manifest(QUEUE, worker={"image": "w", "handlers": "a:b", "progressDeadlineSeconds": 86401}),
        ["spec.worker.progressDeadlineSeconds", "should be less than or equal to 86400"],
    ),
    "grace-period-over-a-day": (
        manifest(QUEUE, worker={"image": "w", "handlers": "a:b", "terminationGracePeriodSeconds": 86401}),
        ["spec.worker.terminationGracePeriodSeconds", "should be less than or equal to 86400"],
    ),
}


def _unbounded_intervals(schema: dict, path: str = "") -> list[str]:
    found = []
    for name, sub in (schema.get("properties") or {}).items():
        where = f"{path}.{name}" if path else name
        if name.endswith("Seconds") and sub.get("type") == "integer" and "maximum" not in sub:
            found.append(where)
        found += _unbounded_intervals(sub, where)
    return found


def test_every_interval_of_a_queue_has_a_maximum():
    """Every `...Seconds` field of the Queue's spec is bounded."""
    body = yaml.safe_load((REPO_ROOT / "crds" / "queue.yaml").read_text())
    spec = body["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert _unbounded_intervals(spec) == []


def test_the_crd_bounds_durations_as_the_runtime_does():
    from effectmq.protocol.protocol import MAX_DURATION

    text = (Path(__file__).resolve().parents[2] / "crds" / "queue.yaml").read_text()
    bounds = re.findall(r"maximum: (\d+)  # ten years", text)
    assert len(bounds) == 6 and {int(b) for b in bounds} == {int(MAX_DURATION)}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_resources_are_rejected(kube_control_plane, effectmq_crds, kube_namespace, case):
    body, expected = INVALID[case]
    result = kube_control_plane.kubectl("create", "-n", kube_namespace, "-f", "-", input=body, check=False)
    assert result.returncode != 0, f"{case} was accepted:\n{result.stdout}"
    for fragment in expected:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr}"
    assert "is invalid" in result.stderr  # kubectl's readable 'The Queue "q" is invalid: ...'


def test_the_crd_takes_every_url_form_the_runtime_connects_to(kube_control_plane, effectmq_crds, kube_namespace):
    """One list of URL forms (effectmq.transport.redaction.SCHEMES) for connect(), the operator and
    this CRD's rule: the CRD once refused redis+sentinel:// that everything else took."""
    from effectmq.transport.redaction import SCHEMES

    for scheme in sorted(SCHEMES):
        name = scheme.replace("+", "-")
        body = manifest(QUEUE, name=name, redis={"url": f"{scheme}://h:1/0"})
        result = kube_control_plane.kubectl("create", "-n", kube_namespace, "-f", "-", input=body, check=False)
        assert result.returncode == 0, f"{scheme}:// refused: {result.stderr}"
    body = manifest(QUEUE, name="http", redis={"url": "http://h:1/0"})
    result = kube_control_plane.kubectl("create", "-n", kube_namespace, "-f", "-", input=body, check=False)
    assert result.returncode != 0 and "redis.url must start with" in result.stderr, result.stderr


def test_queue_ref_is_immutable(kube_control_plane, effectmq_crds, kube_namespace):
    kube, ns = kube_control_plane, kube_namespace
    kube.kubectl("create", "-n", ns, "-f", "-", input=manifest(SCHEDULE))
    result = kube.kubectl(
        "patch", "schedule", "s", "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"queueRef": {"name": "other"}}}), check=False,
    )
    assert result.returncode != 0
    assert "spec.queueRef" in result.stderr and "queueRef is immutable" in result.stderr, result.stderr
    # other fields stay mutable
    kube.kubectl("patch", "schedule", "s", "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    spec = get(kube, ns, "schedule", "s")["spec"]
    assert spec["queueRef"] == {"name": "q"} and spec["suspend"] is True


# ---------------------------------------------------------------- status subresource and generation

QUEUE_STATUS = {
    "observedGeneration": 1,
    "conditions": [
        {
            "type": "Ready",
            "status": "True",
            "reason": "Reconciled",
            "message": "worker Deployment at 3/3 replicas",
            "lastTransitionTime": "2030-01-01T00:00:00Z",
            "observedGeneration": 1,
        },
        {
            "type": "RedisReachable",
            "status": "True",
            "reason": "Ping",
            "message": "",
            "lastTransitionTime": "2030-01-01T00:00:00Z",
            "observedGeneration": 1,
        },
    ],
    "backlog": {"waiting": 120, "delayed": 4, "active": 16, "failed": 2, "completed": 900},
    "oldestWaitingSeconds": 12.5,
    "replicas": 3,
    "readyReplicas": 3,
    "desiredReplicas": 3,
    "lastScaleTime": "2030-01-01T00:00:00Z",
    "lastScaleReason": "backlog 136 / target 50",
    "lastPollTime": "2030-01-01T00:00:05Z",
}

SCHEDULE_STATUS = {
    "observedGeneration": 1,
    "conditions": [
        {
            "type": "ScheduleValid",
            "status": "False",
            "reason": "InvalidCron",
            "message": "expected 5 fields",
            "lastTransitionTime": "2030-01-01T00:00:00Z",
            "observedGeneration": 1,
        }
    ],
    "lastTickTime": "2030-01-01T02:00:00Z",
    "lastTaskID": "tick-nightly-20300101T020000Z",
    "nextTickTime": "2030-01-02T02:00:00Z",
    "missedTicks": {"skipped": 0, "coalesced": 3, "backfilled": 0},
    "lastError": "",
}


@pytest.mark.parametrize(
    "kind,body,status,spec_change",
    [
        ("queue", manifest(QUEUE), QUEUE_STATUS, {"paused": True}),
        ("schedule", manifest(SCHEDULE), SCHEDULE_STATUS, {"suspend": True}),
    ],
    ids=["queue", "schedule"],
)
def test_status_subresource_and_generation(
    kube_control_plane, effectmq_crds, kube_namespace, kind, body, status, spec_change
):
    kube, ns = kube_control_plane, kube_namespace
    name = json.loads(body)["metadata"]["name"]
    kube.kubectl("create", "-n", ns, "-f", "-", input=body)
    obj = get(kube, ns, kind, name)
    generation = obj["metadata"]["generation"]
    assert generation == 1

    # status through the subresource is kept whole; an undeclared field is pruned
    kube.kubectl(
        "patch", kind, name, "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {**status, "undeclaredField": "pruned"}}),
    )
    obj = get(kube, ns, kind, name)
    assert obj["status"] == status
    assert obj["metadata"]["generation"] == generation  # status change: no bump

    # spec change bumps the generation and leaves the status alone
    kube.kubectl("patch", kind, name, "-n", ns, "--type=merge", "-p", json.dumps({"spec": spec_change}))
    obj = get(kube, ns, kind, name)
    assert obj["metadata"]["generation"] == generation + 1
    assert obj["status"] == status

    # status sent to the main resource is ignored (it belongs to the subresource)
    kube.kubectl(
        "patch", kind, name, "-n", ns, "--type=merge",
        "-p", json.dumps({"status": {"observedGeneration": 99}}),
    )
    obj = get(kube, ns, kind, name)
    assert obj["status"]["observedGeneration"] == 1
    assert obj["metadata"]["generation"] == generation + 1


# ---------------------------------------------------------------- Deployments and garbage collection run

DEPLOYMENT = textwrap.dedent(
    """
    apiVersion: apps/v1
    kind: Deployment
    metadata: {name: web, labels: {app: web}}
    spec:
      replicas: 2
      selector: {matchLabels: {app: web}}
      template:
        metadata: {labels: {app: web}}
        spec:
          containers:
            - {name: web, image: registry.example/pause:3.10}
    """
)


def test_deployment_gets_replicaset_and_garbage_collection(kube_control_plane, kube_namespace):
    kube, ns = kube_control_plane, kube_namespace
    kube.kubectl("apply", "-n", ns, "-f", "-", input=DEPLOYMENT)
    deployment_uid = get(kube, ns, "deployment", "web")["metadata"]["uid"]

    def replicaset():
        items = get(kube, ns, "replicasets", "-l", "app=web")["items"]
        return items[0] if items else None

    rs = wait_until(replicaset, 60, "the Deployment's ReplicaSet")
    (owner,) = rs["metadata"]["ownerReferences"]
    assert owner["kind"] == "Deployment" and owner["uid"] == deployment_uid
    assert owner["controller"] is True
    # the ReplicaSet controller creates the pods (Pending: there is no scheduler)
    pods = wait_until(
        lambda: len(get(kube, ns, "pods", "-l", "app=web")["items"]) == 2 or None,
        60, "two pods of the ReplicaSet",
    )
    assert pods

    # deleting the owner garbage-collects what it owns
    kube.kubectl("delete", "deployment", "web", "-n", ns, "--wait=false")
    wait_until(lambda: not get(kube, ns, "replicasets")["items"], 60, "ReplicaSet garbage collection")
    wait_until(lambda: not get(kube, ns, "pods")["items"], 60, "Pod garbage collection")


def test_owner_reference_garbage_collection(kube_control_plane, kube_namespace):
    kube, ns = kube_control_plane, kube_namespace
    kube.kubectl("create", "configmap", "owner", "-n", ns, "--from-literal=a=1")
    owner_uid = get(kube, ns, "configmap", "owner")["metadata"]["uid"]
    owned = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}
            ],
        },
        "data": {"b": "2"},
    }
    kube.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(owned))
    kube.kubectl("create", "configmap", "bystander", "-n", ns, "--from-literal=c=3")
    kube.kubectl("delete", "configmap", "owner", "-n", ns)

    def owned_gone():
        return kube.kubectl("get", "configmap", "owned", "-n", ns, check=False).returncode != 0

    wait_until(owned_gone, 60, "garbage collection of the owned ConfigMap")
    kube.kubectl("get", "configmap", "bystander", "-n", ns)  # not owned: kept


def test_namespace_fixture_gives_a_fresh_namespace(kube_control_plane, kube_namespace):
    ns = get(kube_control_plane, "default", "namespace", kube_namespace)
    assert ns["status"]["phase"] == "Active"
    # the controller manager's serviceaccount controller fills new namespaces
    wait_until(
        lambda: kube_control_plane.kubectl("get", "sa", "default", "-n", kube_namespace, check=False).returncode == 0,
        60, "the default ServiceAccount",
    )
    # RBAC is on: a service account cannot list secrets unless granted
    can = kube_control_plane.kubectl(
        "auth", "can-i", "list", "secrets", "-n", kube_namespace,
        f"--as=system:serviceaccount:{kube_namespace}:default", check=False,
    )
    assert can.stdout.strip() == "no"
    # TokenRequest works (service-account keys are configured)
    token = kube_control_plane.kubectl("create", "token", "default", "-n", kube_namespace).stdout.strip()
    assert token.count(".") == 2
    # ... and authenticates as the ServiceAccount, which RBAC then limits
    as_sa = kube_control_plane.token_kubeconfig(token, f"{kube_namespace}-default")
    whoami = kube_control_plane.kubectl_json("auth", "whoami", f"--kubeconfig={as_sa}")
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{kube_namespace}:default"
    denied = kube_control_plane.kubectl("get", "secrets", "-n", kube_namespace, f"--kubeconfig={as_sa}", check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr


# ---------------------------------------------------------------- a missing control plane skips, and fails under CI

PROBE_TEST = textwrap.dedent(
    """
    def test_needs_control_plane(kube_control_plane):
        pass
    """
)


def _run_probe(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE_TEST)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["EFFECTMQ_CONTROLPLANE_BIN"] = str(empty)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [
            sys.executable, "-m", "pytest", "-p", "tests.fixtures.kube", "-p", "no:cacheprovider",
            "-rA", "-q", f"--rootdir={tmp_path}", str(probe),
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


def test_missing_control_plane_fails_under_ci(tmp_path):
    result = _run_probe(tmp_path, ci="true")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "1 error" in out or "1 failed" in out, out
    assert "skipped" not in out, out
    assert "control plane binaries missing" in out and "build.sh" in out, out


def test_missing_control_plane_skips_outside_ci(tmp_path):
    result = _run_probe(tmp_path, ci=None)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "1 skipped" in out and "control plane binaries missing" in out, out
