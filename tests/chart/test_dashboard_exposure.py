"""The dashboard's exposure, the chart's part: it allowed a LoadBalancer or NodePort Service
for the dashboard, whose reads need no token, so anyone who reached a node or the load
balancer read every queue. Now such a Service needs a read token; the dashboard answers
to its Service's names (and those allowed) only; and the rendered command line is the
one the dashboard starts with (run here as the chart runs it, on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.chart.support import RELEASE, helm_template, render
from tests.fixtures.redis import free_port
from tests.support.processes import ROOT, stop_process

pytestmark = pytest.mark.kube

NAMESPACE = "obs"
SERVICE = f"{RELEASE}-effectmq-dashboard"
ON = ["--set", "dashboard.enabled=true", "--set", "redis.enabled=true"]
READ_TOKEN = ["--set", "dashboard.readToken.existingSecret=dash-read"]
ACTIONS = ["--set", "dashboard.actions.enabled=true", "--set", "dashboard.actions.existingSecret=dash-token"]


def dashboard(plane, *args: str) -> tuple[dict, dict, dict]:
    objects = render(plane, NAMESPACE, *ON, *args)
    component = [o for o in objects
                 if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "dashboard"]
    deployment = next(o for o in component if o["kind"] == "Deployment")
    service = next(o for o in component if o["kind"] == "Service")
    return deployment, deployment["spec"]["template"]["spec"]["containers"][0], service


def values_of(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


@pytest.mark.parametrize("kind", ["LoadBalancer", "NodePort"])
def test_an_exposed_service_needs_a_read_token(kube_control_plane, kind):
    for extra in ([], ACTIONS):  # the action token does not guard reads
        result = helm_template(kube_control_plane, NAMESPACE, *ON, *extra, "--set", f"dashboard.service.type={kind}",
                               check=False)
        assert result.returncode != 0, result.stdout[-500:]
        assert f"dashboard.service.type={kind}" in result.stderr and "dashboard.readToken.existingSecret" in \
            result.stderr, result.stderr
    deployment, container, service = dashboard(kube_control_plane, *READ_TOKEN, "--set",
                                               f"dashboard.service.type={kind}")
    assert service["spec"]["type"] == kind
    args = container["args"]
    assert "--unauthenticated-reads" not in args
    (path,) = values_of(args, "--read-token-file")
    mount = {m["name"]: m for m in container["volumeMounts"]}["read-token"]
    assert mount["readOnly"] is True and path == f"{mount['mountPath']}/token"
    volume = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}["read-token"]
    assert volume["secret"] == {"secretName": "dash-read", "items": [{"key": "token", "path": "token"}]}
    assert not {e["name"] for e in container["env"]} & {"EFFECTMQ_DASHBOARD_READ_TOKEN", "EFFECTMQ_DASHBOARD_TOKEN"}


def test_a_cluster_ip_dashboard_says_its_reads_are_open(kube_control_plane):
    _, container, service = dashboard(kube_control_plane)
    assert service["spec"]["type"] == "ClusterIP"
    assert "--unauthenticated-reads" in container["args"] and "--read-token-file" not in container["args"]
    _, container, _ = dashboard(kube_control_plane, *READ_TOKEN)
    assert "--unauthenticated-reads" not in container["args"]


def test_the_dashboard_answers_to_its_service_names_and_those_allowed(kube_control_plane):
    _, container, _ = dashboard(kube_control_plane)
    names = [SERVICE, f"{SERVICE}.{NAMESPACE}", f"{SERVICE}.{NAMESPACE}.svc",
             f"{SERVICE}.{NAMESPACE}.svc.cluster.local"]
    assert values_of(container["args"], "--allowed-host") == names
    assert "--behind-tls" not in container["args"]
    _, container, _ = dashboard(kube_control_plane, "--set", "dashboard.allowedHosts={queues.example.com}",
                                "--set", "dashboard.behindTLS=true")
    assert values_of(container["args"], "--allowed-host") == names + ["queues.example.com"]
    assert "--behind-tls" in container["args"]



def test_the_dashboard_trusts_the_proxies_it_is_given(kube_control_plane):
    _, container, _ = dashboard(kube_control_plane)
    assert "--trusted-proxy" not in container["args"]
    _, container, _ = dashboard(kube_control_plane, "--set", "dashboard.trustedProxies={10.244.0.0/16,192.0.2.7}")
    assert values_of(container["args"], "--trusted-proxy") == ["10.244.0.0/16", "192.0.2.7"]


def get(url: str, host: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("values", ["default", "read-token"])
def test_the_rendered_dashboard_starts_with_its_arguments(kube_control_plane, redis_url, tmp_path, values):
    """Was a risk of this change: the chart binds 0.0.0.0, which the dashboard now refuses
    without a read token unless told --unauthenticated-reads."""
    deployment, container, _ = dashboard(kube_control_plane, *(READ_TOKEN if values == "read-token" else []))
    argv = container["command"] + container["args"]
    assert argv[:2] == ["effectmq", "dashboard"]
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    for flag in ("--read-token-file", "--token-file"):
        if flag in argv:  # the Secret's file, as the kubelet mounts it
            (tmp_path / flag).write_text("read-token-0123456789abcdef\n")
            argv[argv.index(flag) + 1] = str(tmp_path / flag)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTMQ_")}
    env.update(EFFECTMQ_REDIS_URL=redis_url, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    log = tmp_path / "dashboard.log"
    proc = subprocess.Popen([sys.executable, "-m", "effectmq", *argv[1:]], env=env, cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if get(base + "/healthz", host="10.1.2.3:8080") == 200:  # a probe names the pod's IP
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        expected = 401 if values == "read-token" else 200
        assert get(base + "/api/queues", host=f"{SERVICE}.{NAMESPACE}.svc:8080") == expected
        assert get(base + "/api/queues", host="evil.example") == 421
    finally:
        assert stop_process(proc) == 0, log.read_text()
