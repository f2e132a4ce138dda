#!/usr/bin/env python3
"""Write the core/v1 schemas of the Queue fields that are core types (worker.env,
worker.resources, podTemplate.tolerations, podTemplate.affinity, ...) into the Queue
CRD (crds/queue.yaml and the chart's copy), so `kubectl apply` refuses a typo in them
as it would in a Pod, and `kubectl explain` describes them as it describes a Pod's.

The schemas come from the OpenAPI v3 document of the API server's core group
(`/openapi/v3/api/v1`), inlined: a CRD can use no `$ref`. Made structural on the way:
quantities become int-or-string with the quantity pattern, and what a CRD schema may
not hold (defaults of core's Go zero values, patch strategies, oneOf) is left out.

    python tooling/core_schemas.py                        # start the test control plane, write
    python tooling/core_schemas.py --kubeconfig K         # another API server's schemas
    python tooling/core_schemas.py --openapi v1.json      # a saved /openapi/v3/api/v1
    python tooling/core_schemas.py --check [...]          # exit 1 if a CRD differs

The test control plane is the pinned Kubernetes release (tooling/controlplane), so the
CRD follows that release; `tests/k8s/test_crd_fields.py` fails when they differ.
Writing keeps the rest of the CRD's layout (ruamel.yaml round trip).
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tooling.generated, and the test control plane's fixture
CRDS = (ROOT / "crds/queue.yaml", ROOT / "charts/effectmq/crds/queue.yaml")
OPENAPI_PATH = "/openapi/v3/api/v1"
SCHEMAS = "#/components/schemas/"
CORE = "io.k8s.api.core.v1."
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
# The pattern Kubernetes' own CRD generator (controller-gen) gives a resource.Quantity.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
                    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
# What a structural CRD schema takes of an OpenAPI schema, in the order it is written.
KEPT = ("type", "format", "description", "enum", "pattern", "anyOf", "x-kubernetes-int-or-string", "required",
        "x-kubernetes-map-type", "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "items",
        "additionalProperties", "properties")
# Left out on purpose: defaults (core's Go zero values, "" and {}: a Pod gets them from the
# API server's Go defaulting, a CRD would write them into every Queue), patch strategies
# (strategic merge patch does not apply to custom resources) and oneOf (only Quantity has
# it, replaced as a whole).
DROPPED = ("default", "x-kubernetes-patch-strategy", "x-kubernetes-patch-merge-key", "oneOf")


@dataclass(frozen=True)
class Field:
    """A Queue field that is a core type: `path` under the Queue's spec, the core type and
    property it is, and its description in a Queue (what the operator does with it)."""

    path: str
    source: str  # "<core type>.<property>", e.g. "Container.env"
    description: str
    after: str = ""  # a field added to the CRD goes after this sibling (default: last)


FIELDS = (
    Field("worker.imagePullPolicy", "Container.imagePullPolicy",
          "When the kubelet pulls the worker image (core/v1 Container.imagePullPolicy): Always, IfNotPresent or "
          "Never. Unset: Always for a :latest tag or no tag, IfNotPresent otherwise.", after="image"),
    Field("worker.env", "Container.env",
          "Environment variables of the worker container (core/v1 EnvVar, as a container's env), after the "
          "operator's EFFECTMQ_* variables: one with the same name replaces the operator's (EFFECTMQ_REDIS_URL or "
          "EFFECTMQ_REDIS_URL_FILE replaces both). Names are unique. Changing them rolls the worker pods."),
    Field("worker.envFrom", "Container.envFrom",
          "Sources of environment variables of the worker container: every key of a ConfigMap or Secret of the "
          "Queue's namespace (core/v1 EnvFromSource, as a container's envFrom). A variable of env wins over one "
          "of the same name from here; among these, the last source wins.", after="env"),
    Field("worker.resources", "Container.resources",
          "CPU, memory and other resources of the worker container (core/v1 ResourceRequirements): requests "
          "are what scheduling reserves, limits what the container may use. Unset: none (the namespace's "
          "LimitRange defaults apply)."),
    Field("worker.podTemplate.nodeSelector", "PodSpec.nodeSelector",
          "Node labels the worker pods' node must have, as a Pod's nodeSelector."),
    Field("worker.podTemplate.tolerations", "PodSpec.tolerations",
          "Taints the worker pods tolerate (core/v1 Toleration, as a Pod's tolerations)."),
    Field("worker.podTemplate.affinity", "PodSpec.affinity",
          "Node affinity and pod (anti-)affinity of the worker pods (core/v1 Affinity, as a Pod's affinity). The "
          "worker pods of this Queue carry the labels app.kubernetes.io/name=effectmq-worker and "
          "app.kubernetes.io/instance=<the Queue's name> for a labelSelector."),
    Field("worker.podTemplate.topologySpreadConstraints", "PodSpec.topologySpreadConstraints",
          "How the worker pods spread over zones, nodes or other topology domains (core/v1 "
          "TopologySpreadConstraint, as a Pod's topologySpreadConstraints). Select this Queue's pods with "
          "labelSelector.matchLabels app.kubernetes.io/instance: <the Queue's name> (and matchLabelKeys: "
          "[pod-template-hash] to count only the pods of the current rollout).", after="affinity"),
    Field("worker.podTemplate.priorityClassName", "PodSpec.priorityClassName",
          "The PriorityClass of the worker pods, as a Pod's priorityClassName: their priority when scheduling "
          "and under preemption. Unset: the cluster's default priority (or 0).",
          after="topologySpreadConstraints"),
    Field("worker.podTemplate.serviceAccountName", "PodSpec.serviceAccountName",
          "The ServiceAccount the worker pods run as. Unset: the namespace's default ServiceAccount, with no API "
          "token mounted (automountServiceAccountToken: false; the worker never calls the API server). The "
          "chart's queue-author admission policy may restrict which ServiceAccounts a Queue can name."),
    Field("worker.podTemplate.imagePullSecrets", "PodSpec.imagePullSecrets",
          "Secrets of the Queue's namespace holding registry credentials for pulling the worker image (core/v1 "
          "LocalObjectReference, as a Pod's imagePullSecrets)."),
)


class SchemaError(ValueError):
    """The OpenAPI document lacks what a field needs (another Kubernetes release?)."""


def _ref_name(ref: str) -> str:
    if not ref.startswith(SCHEMAS):
        raise SchemaError(f"unexpected $ref {ref!r}")
    return ref[len(SCHEMAS):]


def quantity(description: str | None = None) -> dict[str, Any]:
    node: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN,
                            "x-kubernetes-int-or-string": True}
    if description:
        node["description"] = description
    return node


def structural(node: dict[str, Any], schemas: dict[str, Any], trail: tuple[str, ...] = ()) -> dict[str, Any]:
    """`node` with every $ref inlined, made a structural CRD schema."""
    node = dict(node)
    ref = node.pop("$ref", None)
    if ref is None and len(node.get("allOf") or ()) == 1 and "$ref" in node["allOf"][0]:
        ref = node.pop("allOf")[0]["$ref"]  # {allOf: [{$ref}]}: the OpenAPI v3 way to describe a reference
    if ref is not None:
        name = _ref_name(ref)
        if name in trail:
            raise SchemaError(f"{' -> '.join((*trail, name))}: a recursive type cannot be inlined")
        description = node.get("description")
        if name == QUANTITY:
            return quantity(description)
        if name == INT_OR_STRING:
            out = {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}
            return {**out, "description": description} if description else out
        if name not in schemas:
            raise SchemaError(f"{name} is not in the OpenAPI document")
        # the field's own description says more than its type's
        return structural({**schemas[name], **node}, schemas, (*trail, name))
    unknown = set(node) - set(KEPT) - set(DROPPED) - {"allOf"}
    if unknown or "allOf" in node:
        raise SchemaError(f"{' -> '.join(trail) or 'a field'}: cannot inline {sorted(unknown) or ['allOf']}")
    out: dict[str, Any] = {}
    for key in KEPT:
        if key not in node:
            continue
        value = node[key]
        if key == "properties":
            value = {name: structural(sub, schemas, trail) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = structural(value, schemas, trail)
        out[key] = copy.deepcopy(value)
    if out.get("x-kubernetes-list-type") == "map":
        # A CRD's list-map keys must be required or defaulted; the defaults were left out.
        item = out["items"]
        missing = [k for k in out["x-kubernetes-list-map-keys"] if k not in item.get("required", [])]
        if missing:
            required = [*item.get("required", []), *missing]
            out["items"] = {key: required if key == "required" else item.get(key) for key in KEPT
                            if key in item or key == "required"}
    if "type" not in out and not out.get("x-kubernetes-int-or-string"):
        raise SchemaError(f"{' -> '.join(trail) or 'a field'}: no type")
    return out


def field_schema(field: Field, schemas: dict[str, Any]) -> dict[str, Any]:
    """The CRD schema of one Queue field, from the OpenAPI document's component schemas."""
    type_name, prop = field.source.split(".")
    try:
        source = schemas[CORE + type_name]["properties"][prop]
    except KeyError:
        raise SchemaError(f"{field.source} is not in the OpenAPI document") from None
    node = structural(source, schemas)
    node["description"] = field.description
    return {key: node[key] for key in KEPT if key in node}  # description in its place


def expected(openapi: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every generated field's schema, by path under the Queue's spec."""
    schemas = openapi["components"]["schemas"]
    return {field.path: field_schema(field, schemas) for field in FIELDS}


def spec_schema(crd: Any) -> Any:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def parent_and_name(spec: Any, path: str) -> tuple[Any, str]:
    *parents, name = path.split(".")
    node = spec
    for part in parents:
        node = node["properties"][part]
    return node["properties"], name


def differences(crd: Any, want: dict[str, dict[str, Any]]) -> list[str]:
    """The generated fields where a loaded CRD differs (empty: in sync)."""
    spec = spec_schema(crd)
    sources = {f.path: f.source for f in FIELDS}
    out = []
    for path, schema in want.items():
        properties, name = parent_and_name(spec, path)
        if properties.get(name) != schema:
            out.append(f"spec.{path} is not the schema of core/v1 {sources[path]}")
    return out


# -- reading the OpenAPI document -------------------------------------------------------


def from_kubeconfig(kubeconfig: str | None) -> dict[str, Any]:
    """`kubectl get --raw /openapi/v3/api/v1` against a running API server."""
    argv = ["kubectl", *([f"--kubeconfig={kubeconfig}"] if kubeconfig else []), "get", "--raw", OPENAPI_PATH]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        sys.exit(f"cannot read {OPENAPI_PATH}: {result.stderr.strip()}")
    return json.loads(result.stdout)


def from_test_control_plane() -> dict[str, Any]:
    """Start the test control plane (the pinned release, from the build cache) to read it."""
    from tooling.testbed import Unavailable
    from tooling.testbed.controlplane import KubeControlPlane, locate_bin_dir

    try:
        bin_dir = locate_bin_dir()
    except Unavailable as exc:
        sys.exit(str(exc))
    with tempfile.TemporaryDirectory(prefix="emq-core-schemas-") as work:
        logs = Path(work) / "logs"
        logs.mkdir()
        plane = KubeControlPlane(bin_dir=bin_dir, work_dir=Path(work), log_dir=logs)
        try:
            plane.start()
            return json.loads(plane.kubectl("get", "--raw", OPENAPI_PATH).stdout)
        finally:
            plane.stop()


# -- writing --------------------------------------------------------------------------


def _styled(value: Any) -> Any:
    """Long descriptions as block scalars, the way the rest of the CRD is written."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    if isinstance(value, dict):
        out = CommentedMap()
        for key, sub in value.items():
            out[key] = _styled(sub) if key != "description" else _description(sub)
        return out
    if isinstance(value, list):
        seq = CommentedSeq(_styled(v) for v in value)
        if all(isinstance(v, str) for v in value) and len(value) <= 4:
            seq.fa.set_flow_style()
        return seq
    return value


def _description(text: str) -> Any:
    from ruamel.yaml.scalarstring import LiteralScalarString

    from tooling.generated import folded

    if "\n" in text:
        return LiteralScalarString(text)
    return folded(text)


def write(openapi: dict[str, Any]) -> None:
    from tooling.generated import round_trip_yaml

    want = expected(openapi)
    yaml = round_trip_yaml()
    for path in CRDS:
        docs = list(yaml.load_all(path.read_text()))
        spec = spec_schema(docs[0])
        for field in FIELDS:
            properties, name = parent_and_name(spec, field.path)
            if properties.get(name) == want[field.path]:
                continue  # unchanged: keeps its layout
            if name not in properties:
                at = list(properties).index(field.after) + 1 if field.after else len(properties)
                properties.insert(at, name, None)
            properties[name] = _styled(want[field.path])
            properties.yaml_add_eol_comment(f"core/v1 {field.source}: written by tooling/core_schemas.py", name)
        out = io.StringIO()
        yaml.dump_all(docs, out)
        # ruamel puts one space before the comment of a key whose value is a mapping; the CRD has two
        path.write_text(re.sub(r":( )(# core/v1 )", r":  \2", out.getvalue()))


def check(openapi: dict[str, Any]) -> list[str]:
    import yaml

    want = expected(openapi)
    problems = []
    for path in CRDS:
        problems += [f"{path.relative_to(ROOT)}: {d}" for d in differences(yaml.safe_load(path.read_text()), want)]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report differences (exit 1 if any)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--kubeconfig", help="read the schemas from this API server (default: start the test "
                                             "control plane from the build cache)")
    source.add_argument("--openapi", type=Path, help=f"read them from a saved {OPENAPI_PATH} (JSON)")
    args = parser.parse_args()
    if args.openapi:
        openapi = json.loads(args.openapi.read_text())
    elif args.kubeconfig:
        openapi = from_kubeconfig(args.kubeconfig)
    else:
        openapi = from_test_control_plane()
    from tooling.generated import check_or_write

    return check_or_write(args.check, lambda: check(openapi), lambda: write(openapi), "python tooling/core_schemas.py")


if __name__ == "__main__":
    sys.exit(main())
