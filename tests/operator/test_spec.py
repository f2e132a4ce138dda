"""The typed Queue spec: defaults from one table, held against the CRD's schema."""

import pytest
import yaml

from effectmq.protocol import settings
from effectmq_operator.spec import MAX_QUEUE_NAME, QUEUE_DEFAULTS, InvalidSpec, QueueSpec
from tests.support.processes import ROOT

CRD = yaml.safe_load((ROOT / "crds/queue.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
MINIMAL = {"redis": {"url": "redis://r:6379/0"}}


def schema_defaults(schema: dict, path: str = "") -> dict:
    out = {}
    for name, sub in (schema.get("properties") or {}).items():
        where = f"{path}.{name}" if path else name
        if "default" in sub:
            out[where] = sub["default"]
        out.update(schema_defaults(sub, where))
    return out


def test_the_defaults_table_is_the_crds():
    assert QUEUE_DEFAULTS == schema_defaults(SPEC_SCHEMA)


def test_a_minimal_spec_gets_every_default():
    spec = QueueSpec.parse(MINIMAL)
    assert spec.worker is None and spec.lock_timeout == settings.default("lock_timeout")
    assert spec.max_stalled_count == settings.default("max_stalled_count")
    assert spec.scaling.max_replicas == 10 and spec.scaling.poll_interval == 10
    assert spec.retry == {"backoff": "Exponential", "initialDelaySeconds": 1, "maxDelaySeconds": 300, "jitter": True}


def test_max_active_caps_the_replicas():
    spec = QueueSpec.parse({**MINIMAL, "maxActive": 20, "worker": {"image": "w", "handlers": "a:b", "concurrency": 8}})
    assert spec.scaling.replica_cap == 3 and spec.scaling.upper == 3


def test_a_rate_limit_reaches_redis_and_scaling():
    from effectmq_operator.builders import queue_settings

    spec = QueueSpec.parse({**MINIMAL, "rateLimit": {"tasks": 50, "periodSeconds": 0.5}})
    assert spec.rate_limit == (50, 0.5) and spec.scaling.has_rate_limit
    assert queue_settings(spec)["rate_limit"] == (50, 0.5)
    unlimited = QueueSpec.parse(MINIMAL)
    assert unlimited.rate_limit is None and not unlimited.scaling.has_rate_limit
    assert queue_settings(unlimited)["rate_limit"] is None  # removing the field lifts the limit in Redis


def test_a_queue_wide_group_cap_reaches_redis():
    from effectmq_operator.builders import queue_settings

    spec = QueueSpec.parse({**MINIMAL, "groups": {"maxActive": 4}})
    assert spec.group_max_active == 4 and queue_settings(spec)["group_max_active"] == 4
    assert queue_settings(QueueSpec.parse(MINIMAL))["group_max_active"] == 0  # none: the field removed lifts it
    for bad, message in ((-1, "must be >= 0"), (1.5, "must be an integer"), (True, "must be an integer")):
        with pytest.raises(InvalidSpec, match=rf"spec.groups.maxActive: {message}"):
            QueueSpec.parse({**MINIMAL, "groups": {"maxActive": bad}})


def test_a_queue_wide_group_rate_limit_reaches_redis():
    from effectmq_operator.builders import queue_settings

    spec = QueueSpec.parse({**MINIMAL, "groups": {"rateLimit": {"tasks": 5, "periodSeconds": 0.5}}})
    assert spec.group_rate_limit == (5, 0.5) and queue_settings(spec)["group_rate_limit"] == (5, 0.5)
    assert queue_settings(QueueSpec.parse(MINIMAL))["group_rate_limit"] is None  # none: the field removed lifts it
    for rate, message in (({"tasks": 0, "periodSeconds": 1}, r"spec.groups.rateLimit.tasks: must be >= 1"),
                          ({"tasks": 5}, r"spec.groups.rateLimit.periodSeconds: must be a number"),
                          ({"tasks": 5, "periodSeconds": 86_401}, r"spec.groups.rateLimit.periodSeconds: must be <=")):
        with pytest.raises(InvalidSpec, match=message):
            QueueSpec.parse({**MINIMAL, "groups": {"rateLimit": rate}})


@pytest.mark.parametrize("rate, message", [
    ({"tasks": 0, "periodSeconds": 1}, r"spec.rateLimit.tasks: must be >= 1"),
    ({"tasks": 10**9, "periodSeconds": 1}, r"spec.rateLimit.tasks: must be <= 100000"),
    ({"tasks": 1.5, "periodSeconds": 1}, r"spec.rateLimit.tasks: must be an integer"),
    ({"periodSeconds": 1}, r"spec.rateLimit.tasks: must be an integer"),
    ({"tasks": 5, "periodSeconds": 0}, r"spec.rateLimit.periodSeconds: must be >= 0.001"),
    ({"tasks": 5, "periodSeconds": "1m"}, r"spec.rateLimit.periodSeconds: must be a number"),
    ({"tasks": 5, "periodSeconds": float("inf")}, r"spec.rateLimit.periodSeconds: must be a number"),
    ({"tasks": 5, "periodSeconds": 10**7}, r"spec.rateLimit.periodSeconds: must be <= 86400"),
    ({"tasks": 5}, r"spec.rateLimit.periodSeconds: must be a number"),
])
def test_an_invalid_rate_limit_names_its_field(rate, message):
    with pytest.raises(InvalidSpec, match=message):
        QueueSpec.parse({**MINIMAL, "rateLimit": rate})


def test_prefetched_leases_count_toward_the_replicas_in_flight_work_occupies():
    worker = {"image": "w", "handlers": "a:b", "concurrency": 8, "prefetch": 8}
    spec = QueueSpec.parse({**MINIMAL, "maxActive": 20, "worker": worker})
    assert spec.worker.prefetch == 8
    assert spec.scaling.concurrency == 16 and spec.replica_cap == spec.scaling.replica_cap == 2
    auto = QueueSpec.parse({**MINIMAL, "maxActive": 20, "worker": {**worker, "prefetch": None}})
    assert auto.worker.prefetch is None  # the worker's auto: it holds none while handlers are long
    assert auto.scaling.concurrency == 8 and auto.replica_cap == 3


@pytest.mark.parametrize("spec, name, message", [
    ({}, "q", "exactly one of url and urlFrom"),
    ({"redis": {"url": "redis://r", "urlFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}}, "q", "exactly one"),
    ({"redis": {"urlFrom": {"secretKeyRef": {"name": "s"}}}}, "q", "needs name and key"),
    ({**MINIMAL, "worker": {"image": "w"}}, "q", "spec.worker needs image and handlers"),
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "env": [{"value": "x"}]}}, "q", "spec.worker.env"),
    ({**MINIMAL, "scaling": {"minReplicas": 3, "maxReplicas": 2}}, "q", "minReplicas must be less"),
    ({**MINIMAL, "lockTimeoutSeconds": 5, "lockRefreshSeconds": 5}, "q", "lockRefreshSeconds must be less"),
    ({**MINIMAL, "maxActive": "lots"}, "q", "spec.maxActive: must be an integer"),
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "prefetch": -1}}, "q",
     r"spec.worker.prefetch: must be >= 0"),
    (MINIMAL, "x" * (MAX_QUEUE_NAME + 1), "at most 63 characters"),
    # the core-typed worker fields, as a local run (YAML that never met the API server) reads them
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "imagePullPolicy": "Sometimes"}}, "q",
     r"spec.worker.imagePullPolicy: one of Always, IfNotPresent, Never"),
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "envFrom": {"secretRef": {"name": "s"}}}}, "q",
     r"spec.worker.envFrom: a list of EnvFromSource objects"),
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "envFrom": [{"prefix": "A_"}]}}, "q",
     r"spec.worker.envFrom\[0\]: one of configMapRef and secretRef, with a name"),
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "envFrom": [{"secretRef": {}}]}}, "q",
     r"spec.worker.envFrom\[0\]: one of configMapRef and secretRef, with a name"),
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "podTemplate": {"priorityClassName": 5}}}, "q",
     r"spec.worker.podTemplate.priorityClassName: must be a string"),
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "podTemplate": {
        "topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]}}}, "q",
     r"spec.worker.podTemplate.topologySpreadConstraints\[0\]: needs maxSkew, topologyKey and whenUnsatisfiable"),
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "podTemplate": {"imagePullSecrets": [{"name": ""}]}}},
     "q", r"spec.worker.podTemplate.imagePullSecrets\[0\].name: must not be empty"),
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "podTemplate": {"tolerations": {"key": "x"}}}}, "q",
     r"spec.worker.podTemplate.tolerations: must be a list of objects"),
    ({**MINIMAL, "worker": {"image": "w", "handlers": "a:b", "podTemplate": {"affinity": []}}}, "q",
     r"spec.worker.podTemplate.affinity: must be an object"),
])
def test_invalid_specs_name_the_field(spec, name, message):
    with pytest.raises(InvalidSpec, match=message):
        QueueSpec.parse(spec, name)


def schema_maxima(schema: dict, path: str = "") -> dict:
    out = {}
    for name, sub in (schema.get("properties") or {}).items():
        where = f"{path}.{name}" if path else name
        # the settings table's counts, and its numbers (rateLimit.periodSeconds)
        if "maximum" in sub and (sub.get("type") == "integer" or where in settings.BY_FIELD):
            out[where] = sub["maximum"]
        out.update(schema_maxima(sub, where))
    return out


def test_the_maxima_table_is_the_crds():
    """Local runs (YAML that never met the API server) are bounded as the CRD bounds them."""
    from effectmq_operator.spec import QUEUE_MAXIMA

    assert QUEUE_MAXIMA == schema_maxima(SPEC_SCHEMA)


def test_the_minima_of_the_settings_table_are_the_crds():
    """A local run refuses what the API server would: minima come from the same table."""
    from effectmq_operator.spec import QUEUE_MINIMA

    for field, minimum in QUEUE_MINIMA.items():
        node = SPEC_SCHEMA
        for part in field.split("."):
            node = node["properties"][part]
        assert node["minimum"] == minimum, field
    worker = {"image": "w", "handlers": "a:b", "concurrency": 0}
    with pytest.raises(InvalidSpec, match=r"spec.worker.concurrency: must be >= 1"):
        QueueSpec.parse({**MINIMAL, "worker": worker}, "q")


@pytest.mark.parametrize("section, field, value, message", [
    ("scaling", "pollIntervalSeconds", 2147483647, "spec.scaling.pollIntervalSeconds: must be <= 3600"),
    ("scaling", "scaleDownStabilizationSeconds", 3601, "must be <= 3600"),
    ("scaling", "cooldownSeconds", 86401, "spec.scaling.cooldownSeconds: must be <= 86400"),
    ("worker", "progressDeadlineSeconds", 86401, "spec.worker.progressDeadlineSeconds: must be <= 86400"),
])
def test_intervals_beyond_their_bound_are_invalid(section, field, value, message):
    """Was: pollIntervalSeconds 2147483647 was taken, then nothing ever scaled."""
    spec = {**MINIMAL, "worker": {"image": "w", "handlers": "a:b"}, "scaling": {}}
    spec[section] = {**spec[section], field: value}
    with pytest.raises(InvalidSpec, match=message):
        QueueSpec.parse(spec, "q")
    spec[section][field] = 3600 if field != "progressDeadlineSeconds" else 86400
    QueueSpec.parse(spec, "q")  # the bound itself is fine


TRACING = SPEC_SCHEMA["properties"]["worker"]["properties"]["tracing"]


@pytest.mark.parametrize("tracing, message", [
    ({}, "otlpEndpoint: an http:// or https:// URL"),
    ({"otlpEndpoint": "collector:4318"}, "otlpEndpoint: an http:// or https:// URL"),
    ({"otlpEndpoint": "http://a, http://b"}, "otlpEndpoint"),
    ({"otlpEndpoint": "http://" + "a" * 2048}, "at most 2048"),
    ({"otlpEndpoint": "http://c:4318", "sampleRatio": 1.5}, "sampleRatio: a number from 0 to 1"),
    ({"otlpEndpoint": "http://c:4318", "sampleRatio": True}, "sampleRatio"),
    ({"otlpEndpoint": "http://c:4318", "links": "yes"}, "links: must be true or false"),
    ("http://c:4318", "tracing: must be an object"),
])
def test_tracing_is_refused_as_the_crd_refuses_it(tracing, message):
    """A local run (no API server) refuses what the CRD's schema would, naming the field."""
    import re

    spec = {"redis": {"url": "redis://r"}, "worker": {"image": "i", "handlers": "m:app", "tracing": tracing}}
    with pytest.raises(InvalidSpec, match=re.escape(message)):
        QueueSpec.parse(spec)
    endpoint = tracing.get("otlpEndpoint") if isinstance(tracing, dict) else None
    if isinstance(endpoint, str):  # the CRD's own pattern and bound agree on the endpoint
        schema = TRACING["properties"]["otlpEndpoint"]
        agrees = re.search(schema["pattern"], endpoint) is not None and len(endpoint) <= schema["maxLength"]
        assert agrees == (message != "otlpEndpoint" and "URL" not in message and "at most" not in message)


def test_tracing_bounds_are_the_crds():
    from effectmq_operator.spec import MAX_ENDPOINT, OTLP_ENDPOINT

    schema = TRACING["properties"]
    assert schema["otlpEndpoint"]["maxLength"] == MAX_ENDPOINT
    assert schema["otlpEndpoint"]["pattern"] == "^" + OTLP_ENDPOINT.pattern + "$"
    assert (schema["sampleRatio"]["minimum"], schema["sampleRatio"]["maximum"]) == (0, 1)
    assert TRACING["required"] == ["otlpEndpoint"]
