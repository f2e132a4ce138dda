"""Run the operator as a real process against the test control plane, and run
worker processes exactly as the operator's Deployment describes them."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import kubernetes

from effectmq_operator.redis_pool import Connections
from effectmq_operator.queue_controller import QueueController
from effectmq_operator.runtime.kube import Kube
from effectmq_operator.schedule_controller import ScheduleController
from tests.fixtures.redis import free_port
from tests.support.processes import ROOT, stop_process


def wait_for(check: Callable[[], Any], timeout: float = 30.0, interval: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not met within {timeout}s (last: {last!r})")


async def wait_for_async(check: Callable[[], Any], timeout: float = 30.0, interval: float = 0.2,
                         what: str = "condition") -> Any:
    """wait_for, for a test whose event loop runs what it waits on."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"{what} not met within {timeout}s (last: {last!r})")


@contextlib.contextmanager
def default_kubeconfig(path: Path) -> Iterator[None]:
    """The kubernetes client's default configuration from `path`, restored afterwards."""
    previous = kubernetes.client.Configuration.get_default_copy()
    kubernetes.config.load_kube_config(config_file=str(path))
    try:
        yield
    finally:
        kubernetes.client.Configuration.set_default(previous)


@contextlib.asynccontextmanager
async def controllers_fed_by_lists(plane, namespace: str) -> AsyncIterator[tuple[QueueController, ScheduleController]]:
    """The operator's Queue and Schedule controllers, in this process and leading, with
    no watch event reaching them: only their own lists tell them what exists."""
    with default_kubeconfig(plane.kubeconfig):
        kube = Kube()
        connections = Connections(kube)
        queues = QueueController(kube, connections, namespaces=[namespace])
        schedules = ScheduleController(kube, connections, queues, namespaces=[namespace])
        running = [asyncio.create_task(queues.run(lambda: True)), asyncio.create_task(schedules.run(lambda: True))]
        try:
            yield queues, schedules
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await connections.close()


class OperatorProcess:
    def __init__(self, plane, namespace: str, log_dir: Path, *, name: str = "operator",
                 kubeconfig: Path | None = None, lease: str | None = None, extra_env: dict | None = None):
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_dir / f"{name}.log"
        env = plane.env({
            "POD_NAMESPACE": namespace,
            "EFFECTMQ_OPERATOR_LEASE": lease or f"effectmq-operator-{namespace}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
            **({"KUBECONFIG": str(kubeconfig)} if kubeconfig else {}),
            **(extra_env or {}),
        })
        argv = [sys.executable, "-m", "effectmq_operator", "--namespace", namespace,
                "--liveness", f"http://127.0.0.1:{self.port}/healthz", "--metrics-port", str(self.metrics_port)]
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT)
        wait_for(self.alive, timeout=60, what=f"operator liveness on port {self.port}\n{self.log()}")

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def tcp_connections(self) -> set[tuple[int, int]]:
        """(local port, remote port) of each of the process' TCP sockets (from /proc: to tell
        its connections in a server's client list from anyone else's)."""
        inodes = set()
        for fd in os.listdir(f"/proc/{self.proc.pid}/fd"):
            try:
                link = os.readlink(f"/proc/{self.proc.pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        pairs = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[9] in inodes:
                        pairs.add((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)))
        return pairs

    def redis_clients(self, server) -> list[dict]:
        """The connections a redis-server (tests/fixtures/redis.py) holds from this process."""
        ours = self.tcp_connections()
        client = server.client()
        try:
            return [c for c in client.client_list() if (int(c["addr"].rsplit(":", 1)[1]), server.port) in ours]
        finally:
            client.close()

    def stop(self) -> None:
        stop_process(self.proc, 20)


def deployment_worker_command(plane, namespace: str, deployment: dict, pod_name: str,
                              volumes_dir: Path | None = None) -> tuple[list[str], dict]:
    """The worker container's command and environment, resolved as the kubelet would
    (Secret references read from the API server, the pod name from the field ref).
    With `volumes_dir`, the Secret volumes the container mounts are written there (a
    private folder, each file with the volume's defaultMode) and a variable naming a
    path inside a mount names the same file there."""
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    mounted = mount_secret_volumes(plane, namespace, pod, volumes_dir) if volumes_dir is not None else {}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            value = var["value"]
            for mount_path, root in mounted.items():
                if value.startswith(mount_path + "/"):
                    value = str(root) + value[len(mount_path):]
            env[var["name"]] = value
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = plane.kubectl_json("get", "secret", ref["name"], "-n", namespace)
            env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = pod_name
    command = list(container["command"]) + list(container.get("args", []))
    assert command[0] == "effectmq", command
    executable = shutil.which("effectmq")
    argv = ([executable] if executable else [sys.executable, "-m", "effectmq"]) + command[1:]
    return argv, env


def mount_secret_volumes(plane, namespace: str, pod: dict, volumes_dir: Path) -> dict[str, Path]:
    """The kubelet's part for the worker container's Secret volumes: {mount path: the
    folder under `volumes_dir` that holds the Secret's items}."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounted: dict[str, Path] = {}
    for mount in pod["containers"][0].get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if not secret:
            continue
        data = plane.kubectl_json("get", "secret", secret["secretName"], "-n", namespace)["data"]
        volumes_dir.mkdir(mode=0o700, exist_ok=True)
        root = volumes_dir / mount["name"]
        root.mkdir(mode=0o700, exist_ok=True)
        for item in secret["items"]:
            path = root / item["path"]
            path.write_bytes(base64.b64decode(data[item["key"]]))
            path.chmod(secret.get("defaultMode", 0o644))
        mounted[mount["mountPath"]] = root
    return mounted


class DeploymentWorker:
    """A local process standing in for one pod of the worker Deployment."""

    def __init__(self, plane, namespace: str, deployment: dict, pod_name: str, log_dir: Path,
                 overrides: dict | None = None):
        argv, env = deployment_worker_command(plane, namespace, deployment, pod_name,
                                              volumes_dir=log_dir / f"{pod_name}-volumes")
        env.update(overrides or {})
        env["EFFECTMQ_METRICS_PORT"] = str(free_port())  # several "pods" share this host
        full_env = {**os.environ, **env,
                    "PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(ROOT),
                                                   os.environ.get("PYTHONPATH", "")])}
        self.log_path = log_dir / f"{pod_name}.log"
        self.proc = subprocess.Popen(argv, env=full_env, cwd=ROOT, stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT)
        self.env = env

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def environ(self) -> str:
        """The process' environment as the kernel shows it (/proc/<pid>/environ)."""
        return Path(f"/proc/{self.proc.pid}/environ").read_bytes().decode(errors="replace").replace("\0", "\n")

    def stop(self, sig=None) -> None:
        stop_process(self.proc, 30, sig)
