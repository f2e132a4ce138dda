"""The chart's files on their own: CRDs in step with crds/, values valid against
the schema, versions in step with the package, the kind config's Kubernetes
version in step with the tested control plane."""

from __future__ import annotations

import json
import re
import tomllib

import jsonschema
import yaml

from tests.chart.support import CHART
from tests.support.processes import ROOT

SYNC = "cp crds/*.yaml charts/effectmq/crds/"


def test_chart_crds_are_byte_identical_to_crds_dir():
    top = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert top, "crds/ is empty"
    assert sorted(chart) == sorted(top), f"charts/effectmq/crds/ holds other files than crds/; run `{SYNC}`"
    stale = [name for name in top if chart[name] != top[name]]
    assert not stale, f"charts/effectmq/crds/ differs from crds/ in {stale}; run `{SYNC}`"


def test_values_yaml_is_valid_against_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    # every key in values.yaml is described by the schema (nothing is only allowed by accident)
    def walk(value, node, path):
        if isinstance(value, dict) and node.get("additionalProperties") is False:
            for key, child in value.items():
                assert key in node["properties"], f"{path}.{key} is missing from values.schema.json"
                walk(child, node["properties"][key], f"{path}.{key}")
    walk(values, schema, "")


def test_redis_is_never_evicting():
    """noeviction is not a value: the bundled Redis cannot be configured to drop tasks."""
    template = (CHART / "templates" / "redis.yaml").read_text()
    assert re.search(r"^\s*maxmemory-policy noeviction$", template, re.M)
    assert re.search(r"^\s*appendonly yes$", template, re.M)
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert "no" not in schema["properties"]["redis"]["properties"]["appendfsync"]["enum"]


def test_versions_agree():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"], "Chart.yaml appVersion must be the package version"
    for dockerfile in ("worker_image/Dockerfile", "worker_image/example.Dockerfile", "operator/Dockerfile"):
        tags = re.findall(r"effectmq-(?:worker|operator):(\d+\.\d+\.\d+)", (ROOT / dockerfile).read_text())
        assert all(tag == project["version"] for tag in tags), (dockerfile, tags)


def test_kind_config_pins_the_tested_kubernetes_minor():
    config = yaml.safe_load((ROOT / "kind-config.yaml").read_text())
    assert (config["kind"], config["apiVersion"]) == ("Cluster", "kind.x-k8s.io/v1alpha4")
    roles = [n["role"] for n in config["nodes"]]
    assert roles.count("control-plane") == 1 and "worker" in roles
    gomod = (ROOT / "tooling/controlplane/kubernetes/go.mod").read_text()
    tested = re.search(r"k8s\.io/kubernetes v1\.(\d+)\.\d+", gomod).group(1)
    for node in config["nodes"]:
        m = re.fullmatch(r"kindest/node:v1\.(\d+)\.\d+(@sha256:[0-9a-f]{64})?", node["image"])
        assert m, f"node image must be a pinned kindest/node version: {node['image']}"
        assert m.group(1) == tested, f"kind runs 1.{m.group(1)}, the tests run 1.{tested}"


def test_readme_documents_crd_upgrades_and_kind():
    readme = (CHART / "README.md").read_text()
    assert "kubectl apply --server-side --force-conflicts -f charts/effectmq/crds/" in readme
    for step in ("helm install", "kubectl apply -n shop -f examples/k8s/queue.yaml", "docs/kubernetes-walkthrough.md"):
        assert step in readme, f"README misses the step {step!r}"
    # the kind steps live in the walk-through the chart's README links to
    walkthrough = (ROOT / "docs" / "kubernetes-walkthrough.md").read_text()
    for step in ("kind create cluster --config kind-config.yaml", "docker build -f operator/Dockerfile",
                 "docker build -f worker_image/Dockerfile", "kind load docker-image", "helm install"):
        assert step in walkthrough, f"the walk-through misses the step {step!r}"
