"""The Queue and Schedule CRDs read like core types: every field described, `kubectl
explain` that says what, units, default and interplay, the core schemas where a field is
a core type, cron refused at apply."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import re

import pytest
import yaml

from tooling.testbed.controlplane import REPO_ROOT, wait_until
from tests.k8s.test_crds import QUEUE, SCHEDULE

CRD_FILES = ("crds/queue.yaml", "crds/schedule.yaml")


def version_schema(path: str) -> dict:
    crd = yaml.safe_load((REPO_ROOT / path).read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def undescribed(schema: dict, path: str) -> list[str]:
    """The fields under `schema` (objects' properties, arrays' items, maps' values, all
    the way down) whose description is missing or blank."""
    missing = []
    for name, sub in (schema.get("properties") or {}).items():
        where = f"{path}.{name}"
        if not str(sub.get("description") or "").strip():
            missing.append(where)
        missing += undescribed(sub, where)
    if isinstance(schema.get("items"), dict):
        missing += undescribed(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        missing += undescribed(schema["additionalProperties"], f"{path}{{}}")
    return missing


@pytest.mark.parametrize("path", CRD_FILES)
def test_every_spec_and_status_field_has_a_description(path):
    """Every field has a description: `kubectl explain` shows nothing for a field without one."""
    root = version_schema(path)
    missing = [part for part in ("spec", "status") if not root["properties"][part].get("description")]
    for part in ("spec", "status"):
        missing += undescribed(root["properties"][part], part)
    assert missing == [], f"{path}: {len(missing)} fields without a description: {', '.join(missing)}"


def test_the_walk_finds_a_field_without_a_description():
    schema = {"properties": {"a": {"description": "x", "type": "array", "items": {
        "type": "object", "properties": {"b": {"type": "string"}, "c": {"description": " "}}}}}}
    assert undescribed(schema, "spec") == ["spec.a[].b", "spec.a[].c"]


EXPLAINED = ("queue.spec", "queue.spec.worker", "queue.spec.worker.podTemplate", "queue.status",
             "queue.status.backlog", "queue.status.conditions", "schedule.spec", "schedule.spec.task",
             "schedule.status", "schedule.status.missedTicks")


def explain(kube, field: str) -> str:
    """`kubectl explain`, once the API server publishes the CRDs' OpenAPI (a moment after
    they are Established)."""
    return wait_until(lambda: kube.kubectl("explain", field, check=False).stdout, 30, f"explain {field}")


@pytest.mark.kube
@pytest.mark.parametrize("field", EXPLAINED)
def test_kubectl_explain_describes_every_field(kube_control_plane, effectmq_crds, field):
    """As a user sees it: the API server publishes the descriptions."""
    out = explain(kube_control_plane, field)
    assert "<no description>" not in out and "<empty>" not in out, out


# ---------------------------------------------------------------- core types


def load_tool(name: str):
    return importlib.import_module(f"tooling.{name}")


@pytest.mark.kube
def test_core_typed_fields_are_the_api_servers_own_schemas(kube_control_plane):
    """The fields that are core types carry the schema the API server gives them in a Pod
    (tooling/core_schemas.py writes them; run it when this fails)."""
    core_schemas = load_tool("core_schemas")
    openapi = json.loads(kube_control_plane.kubectl("get", "--raw", core_schemas.OPENAPI_PATH).stdout)
    assert core_schemas.check(openapi) == []


def queue_with_worker(name: str, **worker) -> str:
    body = copy.deepcopy(QUEUE)
    body["metadata"]["name"] = name
    body["spec"]["worker"].update(worker)
    return json.dumps(body)


def pod_template(**fields) -> dict:
    return {"podTemplate": fields}


TYPOS = {  # a field misspelt, or a value a Pod would refuse: refused at apply, as in a Pod
    "env-valeu": ({"env": [{"name": "A", "valeu": "1"}]}, ['unknown field "spec.worker.env[0].valeu"']),
    "env-value-from-typo": ({"env": [{"name": "A", "valueFrom": {"secretKeyRf": {"name": "s", "key": "k"}}}]},
                            ['unknown field "spec.worker.env[0].valueFrom.secretKeyRf"']),
    "env-without-name": ({"env": [{"value": "1"}]}, ["spec.worker.env[0].name: Required value"]),
    "env-twice": ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
                  ["spec.worker.env[1]: Duplicate value"]),
    "resources-limit": ({"resources": {"limit": {"cpu": "1"}}}, ['unknown field "spec.worker.resources.limit"']),
    "resources-quantity": ({"resources": {"requests": {"memory": "1 GB"}}},
                           ["spec.worker.resources.requests.memory", "should match"]),
    "envfrom-typo": ({"envFrom": [{"secretRef": {"nmae": "s"}}]},
                     ['unknown field "spec.worker.envFrom[0].secretRef.nmae"']),
    "pull-policy": ({"imagePullPolicy": "Sometimes"}, ['spec.worker.imagePullPolicy: Unsupported value: "Sometimes"']),
    "toleration-operater": (pod_template(tolerations=[{"operater": "Exists"}]),
                            ['unknown field "spec.worker.podTemplate.tolerations[0].operater"']),
    "toleration-effect": (pod_template(tolerations=[{"operator": "Exists", "effect": "NoSchedul"}]),
                          ['spec.worker.podTemplate.tolerations[0].effect: Unsupported value: "NoSchedul"']),
    "affinity-typo": (pod_template(affinity={"nodeAfinity": {}}),
                      ['unknown field "spec.worker.podTemplate.affinity.nodeAfinity"']),
    "affinity-deep-typo": (
        pod_template(affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "podAffinityTerm": {"topologyKey": "zone", "labelSelecter": {}}}]}}),
        ['unknown field "spec.worker.podTemplate.affinity.podAntiAffinity.'
         'preferredDuringSchedulingIgnoredDuringExecution[0].podAffinityTerm.labelSelecter"']),
    "spread-without-key": (pod_template(topologySpreadConstraints=[{"maxSkew": 1,
                                                                    "whenUnsatisfiable": "DoNotSchedule"}]),
                           ["spec.worker.podTemplate.topologySpreadConstraints[0].topologyKey: Required value"]),
    "pull-secret-without-name": (pod_template(imagePullSecrets=[{}]),
                                 ["spec.worker.podTemplate.imagePullSecrets[0].name: Required value"]),
    "priority-class-list": (pod_template(priorityClassName=["high"]),
                            ["spec.worker.podTemplate.priorityClassName", "must be of type string"]),
}


@pytest.mark.kube
@pytest.mark.parametrize("case", sorted(TYPOS))
def test_a_typo_in_a_core_typed_field_is_refused_at_apply(kube_control_plane, effectmq_crds, kube_namespace, case):
    worker, expected = TYPOS[case]
    result = kube_control_plane.kubectl("apply", "-n", kube_namespace, "-f", "-",
                                        input=queue_with_worker("q", **worker), check=False)
    assert result.returncode != 0, f"{case} was accepted:\n{result.stdout}"
    for fragment in expected:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr}"


EVERY_CORE_FIELD = {
    "imagePullPolicy": "IfNotPresent",
    "env": [{"name": "A", "value": "1"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "api", "key": "token", "optional": True}}},
            {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}}],
    "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "APP_"}, {"secretRef": {"name": "api"}}],
    "resources": {"requests": {"cpu": "250m", "memory": "64Mi"}, "limits": {"cpu": 2, "memory": "1Gi"}},
    "podTemplate": {
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "queues", "effect": "NoSchedule"},
                        {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}],
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}},
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 50, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "q"}}}}]},
        },
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway", "matchLabelKeys": ["pod-template-hash"],
                                       "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "q"}}}],
        "priorityClassName": "high",
        "serviceAccountName": "workers",
        "imagePullSecrets": [{"name": "registry"}],
    },
}


@pytest.mark.kube
def test_every_core_typed_field_is_kept_as_written(kube_control_plane, effectmq_crds, kube_namespace):
    kube, ns = kube_control_plane, kube_namespace
    kube.kubectl("apply", "-n", ns, "-f", "-", input=queue_with_worker("q", **EVERY_CORE_FIELD))
    worker = kube.kubectl_json("get", "queue", "q", "-n", ns)["spec"]["worker"]
    assert {k: worker[k] for k in EVERY_CORE_FIELD} == EVERY_CORE_FIELD


@pytest.mark.kube
def test_kubectl_explain_describes_core_typed_fields_as_core_does(kube_control_plane, effectmq_crds):
    out = explain(kube_control_plane, "queue.spec.worker.podTemplate.tolerations")
    assert "Operator represents a key's relationship to the value." in out, out
    out = explain(kube_control_plane, "queue.spec.worker.resources.limits")
    assert "Limits describes the maximum amount of compute resources allowed." in out, out


# ---------------------------------------------------------------- Schedule: cron, time zone, defaults


def schedule_field(name: str) -> dict:
    return version_schema("crds/schedule.yaml")["properties"]["spec"]["properties"][name]


def test_the_schedule_description_shows_every_form_the_parser_takes():
    """It said "5 fields" while six (seconds first) work too: its examples are parsed here."""
    from effectmq.scheduler.cron import MACROS, parse_cron

    text = schedule_field("schedule")["description"]
    examples = re.findall(r'"([^"]+)"', text)
    assert examples, text
    for example in examples:
        parse_cron(example)
    fields = {len(e.split()) for e in examples if not e.startswith("@")}
    assert fields == {5, 6}, examples
    assert all(macro in text for macro in MACROS), text


def test_the_schedule_defaults_and_bounds_are_the_schedulers():
    from effectmq.scheduler.model import MAX_MISSED_AFTER, ScheduleSpec
    from effectmq.scheduler.policy import MAX_BACKFILL
    from effectmq.client.queue import MAX_PRIORITY
    from effectmq.protocol.protocol import MAX_DELAY

    defaults = {f.name: f.default for f in dataclasses.fields(ScheduleSpec)}
    spec = version_schema("crds/schedule.yaml")["properties"]["spec"]["properties"]
    assert spec["missedTicks"]["default"].lower() == defaults["missed"]
    assert [m.lower() for m in spec["missedTicks"]["enum"]] == ["skip", "coalesce", "backfill"]
    assert spec["maxBackfill"]["default"] == defaults["max_backfill"]
    assert (spec["maxBackfill"]["minimum"], spec["maxBackfill"]["maximum"]) == (1, MAX_BACKFILL)
    assert spec["missedAfterSeconds"]["default"] == defaults["missed_after"]
    assert spec["missedAfterSeconds"]["maximum"] == MAX_MISSED_AFTER
    assert spec["suspend"]["default"] is defaults["suspend"]
    assert spec["timeZone"]["default"] == defaults["timezone"]
    # the scheduler refuses a deadline under a second (ScheduleSpec: "at least 1 second")
    assert spec["startingDeadlineSeconds"]["minimum"] == 1
    task = spec["task"]["properties"]
    assert task["priority"]["default"] == defaults["priority"]
    assert (task["priority"]["minimum"], task["priority"]["maximum"]) == (-MAX_PRIORITY, MAX_PRIORITY)
    assert task["delaySeconds"]["maximum"] == MAX_DELAY
    for name in ("priority", "maxRetries", "delaySeconds"):
        assert "default" not in task[name] or name == "priority", name


def described_defaults(schema: dict, path: str) -> list[str]:
    """Fields whose schema default their description does not state (explain shows no default)."""
    wrong = []
    for name, sub in (schema.get("properties") or {}).items():
        where = f"{path}.{name}"
        if "default" in sub and sub["default"] != {}:
            shown = str(sub["default"]).lower() if isinstance(sub["default"], bool) else str(sub["default"])
            if f"Default: {shown}." not in " ".join(str(sub.get("description", "")).split()):
                wrong.append(where)
        wrong += described_defaults(sub, where)
    return wrong


@pytest.mark.parametrize("path", CRD_FILES)
def test_every_description_states_its_fields_default(path):
    assert described_defaults(version_schema(path)["properties"]["spec"], "spec") == []


def schedule(name: str, **spec) -> str:
    body = copy.deepcopy(SCHEDULE)
    body["metadata"]["name"] = name
    body["spec"].update(spec)
    return json.dumps(body)


CRON_MESSAGE = "spec.schedule: Invalid value: \"string\": schedule must be five fields"
ZONE_MESSAGE = "spec.timeZone: Invalid value: \"string\": timeZone must be an IANA time zone name"
SHAPES_REFUSED = {  # refused by the CEL rule at apply, before the operator sees them
    "four-fields": ({"schedule": "0 2 * *"}, CRON_MESSAGE),
    "seven-fields": ({"schedule": "0 0 2 * * * 2030"}, CRON_MESSAGE),
    "unknown-macro": ({"schedule": "@fortnightly"}, CRON_MESSAGE),
    "sentence": ({"schedule": "every day at 2"}, CRON_MESSAGE),
    "odd-character": ({"schedule": "0 2 * * MON;FRI"}, CRON_MESSAGE),
    "zone-with-space": ({"timeZone": "Europe/Berlin Time"}, ZONE_MESSAGE),
    "zone-offset": ({"timeZone": "UTC+02:00"}, ZONE_MESSAGE),
}
SHAPES_TAKEN = {  # what the parser accepts, the rule must take too
    "five": "0 2 * * *", "six": "*/30 * * * * *", "macro": "@hourly", "macro-upper": "@Daily",
    "names": "0 9 * JAN-MAR MON-FRI", "last-day": "0 0 L * *", "nth-weekday": "0 0 * * MON#2",
    "question": "0 0 ? * *", "spaces": "  0  2 * *\t* ",
}


@pytest.mark.kube
@pytest.mark.parametrize("case", sorted(SHAPES_REFUSED))
def test_a_cron_or_time_zone_of_the_wrong_shape_is_refused_at_apply(kube_control_plane, effectmq_crds,
                                                                    kube_namespace, case):
    spec, message = SHAPES_REFUSED[case]
    result = kube_control_plane.kubectl("apply", "-n", kube_namespace, "-f", "-", input=schedule("s", **spec),
                                        check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


@pytest.mark.kube
def test_every_cron_form_the_parser_takes_is_applied(kube_control_plane, effectmq_crds, kube_namespace):
    from effectmq.scheduler.cron import parse_cron

    for name, cron in SHAPES_TAKEN.items():
        parse_cron(cron)
        result = kube_control_plane.kubectl("apply", "-n", kube_namespace, "-f", "-",
                                            input=schedule(name, schedule=cron), check=False)
        assert result.returncode == 0, f"{cron!r}: {result.stderr}"
    # The rule checks the shape only: values out of range and unknown zones are the
    # parser's to tell, in the ScheduleValid condition (tests/operator/test_operator_schedules.py).
    for name, spec in {"minute-61": {"schedule": "61 * * * *"}, "mars": {"timeZone": "Mars/Olympus_Mons"}}.items():
        kube_control_plane.kubectl("apply", "-n", kube_namespace, "-f", "-", input=schedule(name, **spec))


def test_a_local_run_checks_the_cron_and_zone_shape_as_the_api_server_does():
    """`effectmq local` checks manifests against the same CRD (its CEL rules run in celpy)."""
    from effectmq_operator.local.manifests import ManifestError, parse

    for case, (spec, message) in SHAPES_REFUSED.items():
        with pytest.raises(ManifestError, match=message.split(": ")[-1]):
            parse([json.loads(schedule("s", **spec))], case)
    for name, cron in SHAPES_TAKEN.items():
        parse([json.loads(schedule(name, schedule=cron))], name)


def test_the_generator_inlines_references_structurally():
    core_schemas = load_tool("core_schemas")
    schemas = {
        "io.k8s.api.core.v1.Ref": {"type": "object", "description": "the type's", "properties": {
            "name": {"type": "string", "default": ""},
            "amount": {"$ref": "#/components/schemas/" + core_schemas.QUANTITY}}},
        "io.k8s.api.core.v1.Loop": {"type": "object", "properties": {
            "self": {"allOf": [{"$ref": "#/components/schemas/io.k8s.api.core.v1.Loop"}]}}},
    }
    field = {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
             "x-kubernetes-patch-strategy": "merge",
             "items": {"default": {}, "allOf": [{"$ref": "#/components/schemas/io.k8s.api.core.v1.Ref"}]}}
    out = core_schemas.structural(field, schemas)
    item = out["items"]
    assert "x-kubernetes-patch-strategy" not in out and "default" not in item["properties"]["name"]
    assert item["required"] == ["name"]  # a list-map key without its default must be required in a CRD
    assert item["description"] == "the type's"
    assert item["properties"]["amount"]["x-kubernetes-int-or-string"] is True
    with pytest.raises(core_schemas.SchemaError, match="recursive"):
        core_schemas.structural({"$ref": "#/components/schemas/io.k8s.api.core.v1.Loop"}, schemas)
    with pytest.raises(core_schemas.SchemaError, match="cannot inline"):
        core_schemas.structural({"type": "string", "not": {}}, schemas)


@pytest.mark.parametrize("path", CRD_FILES)
def test_a_crd_stays_small_enough_for_a_client_side_apply(path):
    """The inlined core schemas (affinity is deep) grow the Queue CRD: a client-side
    `kubectl apply` keeps the whole object in an annotation, at most 256 KiB."""
    body = yaml.safe_load((REPO_ROOT / path).read_text())
    assert len(json.dumps(body, separators=(",", ":"))) < 256 * 1024 * 0.75
