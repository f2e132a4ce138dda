"""The pure builders: worker Deployment, queue settings and conditions."""

from datetime import datetime, timezone

import pytest
import yaml

import effectmq
from effectmq_operator import builders, status
from effectmq_operator.spec import QueueSpec
from tests.support.processes import ROOT

QUEUE = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())
OWNER = {**QUEUE, "metadata": {"name": "emails", "namespace": "shop", "uid": "u-1"}}


def env_of(deployment):
    return {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_worker_deployment_runs_the_queue_handlers():
    d = builders.worker_deployment("shop", "emails", QueueSpec.parse(QUEUE["spec"]), 3, owner=OWNER)
    pod = d["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert (d["metadata"]["name"], d["spec"]["replicas"]) == ("emails-worker", 3)
    assert c["command"] == ["effectmq", "worker"] and c["args"] == ["shop.tasks:app"]
    assert c["image"] == QUEUE["spec"]["worker"]["image"] and c["resources"] == QUEUE["spec"]["worker"]["resources"]
    env = env_of(d)
    assert env["EFFECTMQ_QUEUE"]["value"] == "shop/emails"
    redis = QUEUE["spec"]["redis"]  # the example's: a literal URL, or a Secret's key mounted as a file
    passed = {"EFFECTMQ_REDIS_URL": redis["url"]} if "url" in redis else {"EFFECTMQ_REDIS_URL_FILE": builders.URL_FILE}
    assert {name: env[name]["value"] for name in builders.URL_VARIABLES if name in env} == passed
    assert env["EFFECTMQ_CONCURRENCY"]["value"] == "16"
    assert "EFFECTMQ_PREFETCH" not in env  # unset (auto): no new variable rolls existing Deployments
    for prefetch in (0, 4):
        with_prefetch = {**QUEUE["spec"], "worker": {**QUEUE["spec"]["worker"], "prefetch": prefetch}}
        assert env_of(builders.worker_deployment("shop", "emails", QueueSpec.parse(with_prefetch), 3, owner=OWNER)
                      )["EFFECTMQ_PREFETCH"]["value"] == str(prefetch)
    assert env["EFFECTMQ_LOG_LEVEL"]["value"] == "info"  # the user's variables are kept
    assert int(env["EFFECTMQ_DRAIN_TIMEOUT"]["value"]) < pod["terminationGracePeriodSeconds"]
    ref = d["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("Queue", "emails", "u-1", True)
    assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    # a worker never calls the API server, so it mounts no token; a
    # worker that dies at start leaves its last log lines as the termination message
    assert pod["automountServiceAccountToken"] is False
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_secret_url_tls_and_pod_template_overrides():
    spec = {
        "redis": {"urlFrom": {"secretKeyRef": {"name": "redis", "key": "url"}},
                  "tls": {"enabled": True, "caFrom": {"secretKeyRef": {"name": "ca", "key": "ca.pem"}}}},
        "worker": {"image": "w:1", "handlers": "a:b", "terminationGracePeriodSeconds": 30,
                   "podTemplate": {"nodeSelector": {"pool": "jobs"}, "serviceAccountName": "runner",
                                   "tolerations": [{"key": "jobs", "operator": "Exists"}],
                                   "labels": {"team": "x"}, "annotations": {"a": "b"}}},
    }
    d = builders.worker_deployment("ns", "q", QueueSpec.parse(spec), 0)
    env = env_of(d)
    assert "EFFECTMQ_REDIS_URL" not in env and env["EFFECTMQ_REDIS_URL_FILE"]["value"] == "/etc/effectmq/redis-url/url"
    assert env["EFFECTMQ_REDIS_TLS"]["value"] == "true"
    assert env["EFFECTMQ_REDIS_CA_FILE"]["value"] == "/etc/effectmq/redis-ca/ca.crt"
    pod = d["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "jobs"} and pod["serviceAccountName"] == "runner"
    assert "automountServiceAccountToken" not in pod  # a ServiceAccount of the user's: its own setting decides
    assert pod["tolerations"][0]["key"] == "jobs"
    assert {"name": "redis-ca", "secret": {"secretName": "ca", "items": [{"key": "ca.pem", "path": "ca.crt"}]}} \
        in pod["volumes"]
    assert d["spec"]["template"]["metadata"]["labels"]["team"] == "x"
    assert d["spec"]["template"]["metadata"]["annotations"]["a"] == "b"
    assert "ownerReferences" not in d["metadata"]


SPREAD = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
           "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "q"}}}]


def test_the_core_typed_worker_fields_reach_the_pods_as_written():
    """imagePullPolicy, envFrom, priorityClassName, topologySpreadConstraints
    (and imagePullSecrets, affinity) pass through to the Deployment's pod template."""
    worker = {"image": "w:1", "handlers": "a:b", "imagePullPolicy": "Always",
              "envFrom": [{"secretRef": {"name": "api"}}, {"configMapRef": {"name": "cfg"}, "prefix": "APP_"}],
              "podTemplate": {"priorityClassName": "high", "topologySpreadConstraints": SPREAD,
                              "imagePullSecrets": [{"name": "registry"}],
                              "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                                  {"weight": 1, "preference": {"matchExpressions": [
                                      {"key": "pool", "operator": "In", "values": ["jobs"]}]}}]}}}}
    d = builders.worker_deployment("ns", "q", QueueSpec.parse({"redis": {"url": "redis://r"}, "worker": worker}), 1)
    pod = d["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["imagePullPolicy"] == "Always" and container["envFrom"] == worker["envFrom"]
    assert pod["priorityClassName"] == "high" and pod["topologySpreadConstraints"] == SPREAD
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["affinity"] == worker["podTemplate"]["affinity"]
    # unset, none of them is written: a Deployment of an earlier version keeps its hash (no roll)
    plain = builders.worker_deployment("ns", "q", QueueSpec.parse({"redis": {"url": "redis://r"},
                                                                   "worker": {"image": "w:1", "handlers": "a:b"}}), 1)
    plain_pod = plain["spec"]["template"]["spec"]
    assert not {"imagePullPolicy", "envFrom"} & set(plain_pod["containers"][0])
    assert not {"priorityClassName", "topologySpreadConstraints", "imagePullSecrets", "affinity"} & set(plain_pod)


def test_a_url_from_a_secret_reaches_the_worker_as_a_file_readable_by_the_pods_group_only():
    """An environment variable leaks (child processes, /proc/<pid>/environ,
    crash dumps); a mounted Secret key does not. The kubelet gives the file to root and
    the pod's fsGroup, so 0440 lets the worker (any user: fsGroup is one of its groups)
    read it and nobody else."""
    spec = {"redis": {"urlFrom": {"secretKeyRef": {"name": "redis-credentials", "key": "url"}}},
            "worker": {"image": "w:1", "handlers": "a:b"}}
    d = builders.worker_deployment("ns", "q", QueueSpec.parse(spec), 1)
    pod = d["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = env_of(d)
    assert "EFFECTMQ_REDIS_URL" not in env
    assert not any("secretKeyRef" in (e.get("valueFrom") or {}) for e in container["env"])
    assert env["EFFECTMQ_REDIS_URL_FILE"] == {"name": "EFFECTMQ_REDIS_URL_FILE", "value": "/etc/effectmq/redis-url/url"}
    assert {"name": "redis-url", "secret": {"secretName": "redis-credentials", "items": [{"key": "url", "path": "url"}],
                                            "defaultMode": 0o440}} in pod["volumes"]
    assert {"name": "redis-url", "mountPath": "/etc/effectmq/redis-url", "readOnly": True} in container["volumeMounts"]
    assert isinstance(pod["securityContext"]["fsGroup"], int) and pod["securityContext"]["runAsNonRoot"] is True

    # A literal URL (no credentials, by a CRD rule) stays a value: nothing mounted, nothing rolled.
    literal = builders.worker_deployment("ns", "q", QueueSpec.parse({**spec, "redis": {"url": "redis://r:6379/0"}}), 1)
    literal_pod = literal["spec"]["template"]["spec"]
    assert env_of(literal)["EFFECTMQ_REDIS_URL"] == {"name": "EFFECTMQ_REDIS_URL", "value": "redis://r:6379/0"}
    assert "EFFECTMQ_REDIS_URL_FILE" not in env_of(literal) and "fsGroup" not in literal_pod["securityContext"]
    assert [v["name"] for v in literal_pod["volumes"]] == ["tmp"]

    # A URL variable of the user's replaces the operator's, whichever of the two names
    # either uses: the worker refuses to start with both set.
    for name, value in (("EFFECTMQ_REDIS_URL", "redis://mine:6379/0"), ("EFFECTMQ_REDIS_URL_FILE", "/mnt/url")):
        for redis in ({"url": "redis://r:6379/0"}, spec["redis"]):
            mine = {"redis": redis, "worker": {**spec["worker"], "env": [{"name": name, "value": value}]}}
            names = [e["name"] for e in builders.worker_env("ns", "q", QueueSpec.parse(mine))]
            assert [n for n in names if n.startswith("EFFECTMQ_REDIS_URL")] == [name], (name, redis)
            assert names[1] == name  # in place of the operator's


def test_workers_know_their_pod_from_the_downward_api():
    env = env_of(builders.worker_deployment("shop", "emails", QueueSpec.parse(QUEUE["spec"]), 1, owner=OWNER))
    assert {name: env[name]["valueFrom"]["fieldRef"]["fieldPath"]
            for name in ("EFFECTMQ_POD_NAME", "EFFECTMQ_POD_UID", "EFFECTMQ_NODE_NAME")} == {
        "EFFECTMQ_POD_NAME": "metadata.name", "EFFECTMQ_POD_UID": "metadata.uid", "EFFECTMQ_NODE_NAME": "spec.nodeName"}


def test_tracing_sets_the_sdks_variables_only_when_asked():
    plain = env_of(builders.worker_deployment("shop", "emails", QueueSpec.parse(QUEUE["spec"]), 1, owner=OWNER))
    assert not [name for name in plain if name.startswith("OTEL_")] and "EFFECTMQ_TRACE_LINKS" not in plain
    tracing = {"otlpEndpoint": "http://otel.observability:4318", "sampleRatio": 0.25, "links": True}
    spec = {**QUEUE["spec"], "worker": {**QUEUE["spec"]["worker"], "tracing": tracing}}
    names = [e["name"] for e in builders.worker_deployment("shop", "emails", QueueSpec.parse(spec), 1,
                                                          owner=OWNER)["spec"]["template"]["spec"]["containers"][0]["env"]]
    env = env_of(builders.worker_deployment("shop", "emails", QueueSpec.parse(spec), 1, owner=OWNER))
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel.observability:4318"
    assert env["OTEL_SERVICE_NAME"]["value"] == "emails-worker"
    assert (env["OTEL_TRACES_SAMPLER"]["value"], env["OTEL_TRACES_SAMPLER_ARG"]["value"]) == (
        "parentbased_traceidratio", "0.25")
    assert env["EFFECTMQ_TRACE_LINKS"]["value"] == "true"
    resource = dict(kv.split("=", 1) for kv in env["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(","))
    assert resource["k8s.namespace.name"] == "shop" and resource["k8s.pod.name"] == "$(EFFECTMQ_POD_NAME)"
    # the kubelet expands $(VAR) only from variables defined before it
    assert names.index("EFFECTMQ_POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert len(names) == len(set(names))
    user = {**spec, "worker": {**spec["worker"], "env": [{"name": "OTEL_SERVICE_NAME", "value": "mine"}]}}
    assert env_of(builders.worker_deployment("shop", "emails", QueueSpec.parse(user), 1,
                                            owner=OWNER))["OTEL_SERVICE_NAME"]["value"] == "mine"


@pytest.mark.parametrize("grace, drain", [(60, 50), (30, 25), (10, 5), (5, 1), (0, 1)])
def test_drain_timeout_leaves_a_margin(grace, drain):
    assert builders.drain_timeout(grace) == drain


def bare_spec() -> dict:
    return {"redis": {"url": "redis://r:6379/0"}}


def test_queue_settings_from_the_spec():
    settings = builders.queue_settings(QueueSpec.parse(
        {**QUEUE["spec"], "retry": {"backoff": "Exponential", "initialDelaySeconds": 2}}))
    assert settings["max_retries"] == 5 and settings["lock_timeout"] == 30 and settings["paused"] is False
    assert isinstance(settings["retry"], effectmq.Exponential)
    bare = QueueSpec.parse({"redis": {"url": "redis://r:6379/0"}})
    assert builders.queue_settings(bare)["max_retries"] is None  # unset: the queue's default
    assert builders.queue_settings(bare)["sensitive"] is False
    assert builders.queue_settings(QueueSpec.parse({**bare_spec(), "sensitive": True}))["sensitive"] is True


def test_user_env_overrides_an_operator_variable_in_place():
    spec = QueueSpec.parse({**QUEUE["spec"], "worker": {**QUEUE["spec"]["worker"], "env": [
        {"name": "EFFECTMQ_CONCURRENCY", "value": "3"}, {"name": "LOG_LEVEL", "value": "debug"},
        {"name": "LOG_LEVEL", "value": "warning"}]}})
    env = builders.worker_env("shop", "emails", spec)
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), names  # duplicate names make server-side apply fail
    by_name = {e["name"]: e for e in env}
    assert by_name["EFFECTMQ_CONCURRENCY"] == {"name": "EFFECTMQ_CONCURRENCY", "value": "3"}
    assert by_name["LOG_LEVEL"]["value"] == "warning"
    assert names.index("EFFECTMQ_CONCURRENCY") < names.index("EFFECTMQ_LOCK_TIMEOUT")  # kept in place


def test_spec_hash_ignores_replicas_and_follows_everything_else():
    spec = QueueSpec.parse(QUEUE["spec"])
    a = builders.worker_deployment("shop", "emails", spec, 1, owner=OWNER)
    b = builders.worker_deployment("shop", "emails", spec, 7, owner=OWNER)
    assert a["metadata"]["annotations"][builders.SPEC_HASH] == b["metadata"]["annotations"][builders.SPEC_HASH]
    other = QueueSpec.parse({**QUEUE["spec"], "worker": {**QUEUE["spec"]["worker"], "image": "w:2"}})
    c = builders.worker_deployment("shop", "emails", other, 1, owner=OWNER)
    assert c["metadata"]["annotations"][builders.SPEC_HASH] != a["metadata"]["annotations"][builders.SPEC_HASH]


def test_conditions_keep_transition_time_until_status_flips():
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    t1 = datetime(2026, 1, 2, tzinfo=timezone.utc)
    ok = [status.Check.of("RedisReachable", True, "Connected", "ok")]
    first = status.conditions(ok, None, 1, [], t0)
    by_type = {c["type"]: c for c in first}
    assert by_type["Ready"]["status"] == "True" and by_type["Ready"]["observedGeneration"] == 1
    assert (by_type["Reconciling"]["status"], by_type["Stalled"]["status"]) == ("False", "False")
    second = status.conditions(ok, None, 2, first, t1)
    assert {c["type"]: c for c in second}["Ready"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert second == status.conditions(ok, None, 2, second, t1)  # twice: nothing changes
    missing = status.Problem("SecretNotFound", "Secret shop/redis not found", permanent=True)
    third = {c["type"]: c for c in status.conditions(ok, missing, 2, second, t1)}
    assert third["Ready"]["status"] == "False" and third["Ready"]["reason"] == "SecretNotFound"
    assert third["Ready"]["lastTransitionTime"] == "2026-01-02T00:00:00Z"
    assert (third["Stalled"]["status"], third["Reconciling"]["status"]) == ("True", "False")
    down = status.Problem("RedisUnreachable", "Redis unreachable")
    fourth = {c["type"]: c for c in status.conditions(ok, down, 2, list(third.values()), t1)}
    assert (fourth["Stalled"]["status"], fourth["Reconciling"]["status"]) == ("False", "True")


def test_one_warning_per_outage_and_one_per_new_mistake():
    """Was (a fresh-clone CI run): a Redis that stopped posted two Warnings, "Connection
    closed by server" on the first poll and "Error 111 connecting" on the next: the
    detail of one transient problem changed. A permanent problem whose message changes
    is a new mistake (the spec was edited): posted again."""
    closed = status.Problem("RedisUnreachable", "Redis unavailable at redis://r:6379/0: Connection closed by server.")
    refused = status.Problem("RedisUnreachable", "Redis unavailable at redis://r:6379/0: Error 111 connecting")
    healthy = status.conditions([], None, 1)
    first = status.problem_event(closed, healthy)
    assert first is not None and (first.type, first.reason, first.message) == ("Warning", closed.reason, closed.message)
    assert status.problem_event(refused, status.conditions([], closed, 1, healthy)) is None
    bad = status.Problem("InvalidSpec", "spec.lockTimeoutSeconds: must be >= 1, got -5", permanent=True)
    worse = status.Problem("InvalidSpec", "spec.scaling.maxReplicas: must be >= 0, got -1", permanent=True)
    assert status.problem_event(bad, status.conditions([], bad, 1)) is None  # the same mistake: once
    assert status.problem_event(worse, status.conditions([], bad, 1)) is not None
    assert status.problem_event(None, healthy) is None


@pytest.mark.parametrize("spec, expected", [
    ({"queueRef": {"name": "emails"}, "schedule": "0 2 * * *", "task": {"name": "send_report"}},
     {"queue": "shop/emails", "cron": "0 2 * * *", "timezone": "UTC", "missed": "coalesce", "suspend": False,
      "payload": None, "max_backfill": 10, "starting_deadline": None, "missed_after": 60.0}),
    ({"queueRef": {"name": "q"}, "schedule": "*/5 * * * * *", "timeZone": "Europe/Berlin",
      "task": {"name": "t", "payload": {"a": 1}, "priority": 3, "maxRetries": 2, "delaySeconds": 5},
      "missedTicks": "Backfill", "maxBackfill": 4, "startingDeadlineSeconds": 600, "missedAfterSeconds": 300,
      "suspend": True},
     {"queue": "shop/q", "timezone": "Europe/Berlin", "payload": {"a": 1}, "priority": 3, "max_retries": 2,
      "delay": 5, "missed": "backfill", "max_backfill": 4, "starting_deadline": 600, "missed_after": 300.0,
      "suspend": True}),
    ({"queueRef": {"name": "q"}, "schedule": "@hourly", "task": {"name": "t"}, "missedAfterSeconds": 0},
     {"missed_after": 0.0}),  # every late tick is missed
])
def test_schedule_resource_to_scheduler_definition(spec, expected):
    from effectmq.scheduler.model import ScheduleSpec

    out = builders.schedule_spec("shop", "nightly", spec)
    assert out["id"] == "shop/nightly"
    assert {k: out[k] for k in expected} == expected
    ScheduleSpec.from_json(out)  # the scheduler accepts it as is


def test_the_schedule_crd_states_the_schedulers_defaults_and_bounds():
    """missedAfterSeconds (the 60 s grace could not be set from the
    CRD): its default and maximum are the scheduler's, and the chart's copy is the CRD."""
    from effectmq.scheduler.model import MAX_MISSED_AFTER, ScheduleSpec

    text = (ROOT / "crds/schedule.yaml").read_text()
    assert (ROOT / "charts/effectmq/crds/schedule.yaml").read_text() == text
    schema = yaml.safe_load(text)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    fields = schema["properties"]["spec"]["properties"]
    grace = fields["missedAfterSeconds"]
    assert (grace["default"], grace["minimum"], grace["maximum"]) == (60, 0, MAX_MISSED_AFTER)
    minimal = {"queueRef": {"name": "q"}, "schedule": "@hourly", "task": {"name": "t"}}
    assert builders.schedule_spec("shop", "s", minimal)["missed_after"] == grace["default"]
    assert builders.schedule_spec("shop", "s", {**minimal, "missedAfterSeconds": grace["default"]}) == \
        builders.schedule_spec("shop", "s", minimal)  # defaulted by the API server or not: one definition
    assert ScheduleSpec(id="x", queue="q", cron="@hourly", task="t").missed_after == grace["default"]
    ScheduleSpec.from_json(builders.schedule_spec("shop", "s", {**minimal, "missedAfterSeconds": grace["maximum"]}))
