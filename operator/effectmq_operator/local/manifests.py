"""Load Queue and Schedule manifests and check them as the API server would:
the CRDs' structural schemas (types, enums, minimums, defaults) and their CEL
rules, so a file that works here applies on Kubernetes and the other way round.
Errors name the file, the resource and the field."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Iterable

import yaml

KINDS = {"Queue": "queues", "Schedule": "schedules"}
API_VERSION = "effectmq.io/v1alpha1"


class ManifestError(ValueError):
    """A manifest that cannot run; the message names file, resource and field."""


@dataclass(frozen=True)
class Resource:
    kind: str
    namespace: str
    name: str
    spec: dict
    source: str

    @property
    def body(self) -> dict:
        return {"apiVersion": API_VERSION, "kind": self.kind,
                "metadata": {"name": self.name, "namespace": self.namespace}, "spec": self.spec}


def crds_dir() -> Path:
    configured = os.environ.get("EFFECTMQ_CRDS_DIR")
    candidates = [Path(configured)] if configured else []
    candidates.append(Path(__file__).resolve().parents[3] / "crds")  # a checkout of the repository
    for path in candidates:
        if (path / "queue.yaml").exists():
            return path
    raise ManifestError("cannot find the CRDs (crds/queue.yaml); set EFFECTMQ_CRDS_DIR")


@cache
def schema(kind: str) -> dict:
    crd = yaml.safe_load((crds_dir() / f"{kind.lower()}.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _type_ok(value: Any, expected: str | None) -> bool:
    if expected is None:
        return True
    return {
        "object": isinstance(value, dict), "array": isinstance(value, list), "string": isinstance(value, str),
        "boolean": isinstance(value, bool), "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
    }.get(expected, True)


def _cel(rule: str):
    import celpy  # only needed to check manifests locally

    env = celpy.Environment()
    return env.program(env.compile(rule)), celpy


def check(node: dict, value: Any, path: str) -> list[str]:
    """Validate `value` against a structural schema node, filling defaults in place.
    Returns readable problems ("spec.scaling.maxReplicas: must be >= 0")."""
    problems: list[str] = []
    if not _type_ok(value, node.get("type")):
        return [f"{path}: expected {node.get('type')}, got {type(value).__name__} {value!r}"]
    if "enum" in node and value not in node["enum"]:
        problems.append(f"{path}: {value!r} is not one of {', '.join(map(str, node['enum']))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in node and value < node["minimum"]:
            problems.append(f"{path}: must be >= {node['minimum']}, got {value}")
        if "maximum" in node and value > node["maximum"]:
            problems.append(f"{path}: must be <= {node['maximum']}, got {value}")
    if isinstance(value, str):
        if "minLength" in node and len(value) < node["minLength"]:
            problems.append(f"{path}: must not be empty")
        if "maxLength" in node and len(value) > node["maxLength"]:
            problems.append(f"{path}: longer than {node['maxLength']} characters")
    if isinstance(value, dict) and "properties" in node:
        props = node["properties"]
        for field in node.get("required", []):
            if field not in value:
                problems.append(f"{path}.{field}: required")
        for key, child in props.items():
            if key not in value and "default" in child:
                value[key] = copy.deepcopy(child["default"])
        for key in value:
            if key in props:
                problems += check(props[key], value[key], f"{path}.{key}")
            elif not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
                problems.append(f"{path}.{key}: unknown field (known: {', '.join(sorted(props))})")
    if isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            problems += check(node["items"], item, f"{path}[{i}]")
    if not problems:
        for rule in node.get("x-kubernetes-validations", []):
            if "oldSelf" in rule["rule"]:
                continue  # transition rules need the previous object
            program, celpy = _cel(rule["rule"])
            if not program.evaluate({"self": celpy.json_to_cel(value)}):
                where = path + rule.get("fieldPath", "")
                problems.append(f"{where}: {rule.get('message') or 'violates ' + rule['rule']}")
    return problems


def parse(documents: Iterable[Any], source: str, default_namespace: str = "default") -> list[Resource]:
    out = []
    for index, doc in enumerate(documents):
        if doc is None:
            continue
        where = f"{source} (document {index + 1})"
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: expected a Kubernetes object, got {type(doc).__name__}")
        kind = doc.get("kind")
        if kind not in KINDS:
            continue  # other objects (Secrets, ...) are Kubernetes' business
        if doc.get("apiVersion") != API_VERSION:
            raise ManifestError(f"{where}: {kind} needs apiVersion {API_VERSION}, got {doc.get('apiVersion')!r}")
        meta = doc.get("metadata") or {}
        name = meta.get("name")
        if not name:
            raise ManifestError(f"{where}: {kind} metadata.name is required")
        spec = copy.deepcopy(doc.get("spec"))
        if not isinstance(spec, dict):
            raise ManifestError(f"{source}: {kind} {name}: spec is required")
        problems = check(schema(kind), spec, "spec")
        if problems:
            raise ManifestError(f"{source}: {kind} {name}: " + "; ".join(problems))
        out.append(Resource(kind, meta.get("namespace") or default_namespace, name, spec, source))
    return out


def load(paths: Iterable[str | Path], default_namespace: str = "default") -> list[Resource]:
    """All Queues and Schedules in the given files and directories (*.yaml, *.yml)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.suffix in (".yaml", ".yml"))
        elif p.exists():
            files.append(p)
        else:
            raise ManifestError(f"{p}: no such file or directory")
    resources: list[Resource] = []
    for f in files:
        try:
            documents = list(yaml.safe_load_all(f.read_text()))
        except yaml.YAMLError as exc:
            raise ManifestError(f"{f}: not valid YAML: {exc}") from None
        resources += parse(documents, str(f), default_namespace)
    seen: set[tuple[str, str, str]] = set()
    for r in resources:
        key = (r.kind, r.namespace, r.name)
        if key in seen:
            raise ManifestError(f"{r.source}: {r.kind} {r.namespace}/{r.name} is defined twice")
        seen.add(key)
    queues = {(r.namespace, r.name) for r in resources if r.kind == "Queue"}
    for r in resources:
        ref = (r.spec.get("queueRef") or {}).get("name")
        if r.kind == "Schedule" and (r.namespace, ref) not in queues:
            raise ManifestError(f"{r.source}: Schedule {r.name}: spec.queueRef.name: no Queue {ref!r} "
                                f"in namespace {r.namespace} among the given manifests")
    if not queues:
        raise ManifestError("no Queue found in " + ", ".join(map(str, paths)))
    return resources
