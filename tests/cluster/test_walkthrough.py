"""The door to Kubernetes, on the one-node cluster: docs/kubernetes-walkthrough.md run
as written, and a release pushed to an OCI registry on loopback and installed from it.
(One module: the cluster starts once for both; tests/fixtures/node.py.)

The walk-through: the page's shell blocks run verbatim, in order, in one bash process (as a reader
runs them in one terminal), from the repository's root. The test sets only the
environment a reader has after the page's setup: KUBECONFIG, and PATH with the
cluster's kubectl and helm and this checkout's environment (effectmq, python).
Blocks marked ``<!-- not-run: why -->`` are listed by ``test_page_lists_its_blocks``
and skipped; everything else must succeed (``bash -e``).

The release: `tooling/release.sh` builds and pushes the chart and the images to the
CNCF distribution registry on 127.0.0.1, `helm install oci://127.0.0.1:<port>/...`
installs the chart, and the node's containerd pulls the operator, Redis and worker
images from the registry (none of them is imported into the node under these
names). tests/cluster/registry.py says how the node, in its own network namespace,
reaches the host's loopback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.registry import LoopbackRegistry, NamespaceForwarder, build_registry, trust_plain_http
from tests.fixtures.kube import unavailable
from tests.support.operator import wait_for
from tests.support.processes import ROOT

PAGE = ROOT / "docs" / "kubernetes-walkthrough.md"
CRDS = ROOT / "charts" / "effectmq" / "crds"
NS = "shop"  # the page's namespace
RELEASE_LABEL = "app.kubernetes.io/instance=effectmq"
SHELL_LANGUAGES = ("sh", "bash", "shell")
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<why>\S.*?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
REPORTS_DONE = re.compile(r"^(?P<count>\d+) reports done in \d+ s by (?P<pods>\d+) pods:$", re.M)


@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the reason, for a block the test does not run


def shell_blocks(text: str) -> list[Block]:
    """The page's fenced shell blocks, each with the not-run reason on the line above it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if fence["lang"] in SHELL_LANGUAGES:
            above = lines[start - 1].strip() if start > 0 else ""
            marker = NOT_RUN.match(above)
            blocks.append(Block(start + 1, "\n".join(body) + "\n", marker["why"] if marker else None))
    return blocks


def test_page_lists_its_blocks():
    """Which blocks the cluster test runs and which it cannot, each with its reason."""
    text = PAGE.read_text()
    blocks = shell_blocks(text)
    assert sum(b.not_run is None for b in blocks) >= 8, "the walk-through lost its runnable steps"
    # a not-run note must sit right above a shell block, or it marks nothing
    assert text.count("<!-- not-run:") == sum(b.not_run is not None for b in blocks)
    # the kind steps cannot run here: at least their tags are the ones the chart runs
    app_version = re.search(r'^appVersion:\s*"?([^"\s]+)', (ROOT / "charts/effectmq/Chart.yaml").read_text(), re.M)[1]
    tags = set(re.findall(r"\beffectmq-(?:operator|redis|worker):(\S+)", text))
    assert tags == {app_version}, f"the page tags images {tags}, the chart runs {app_version}"
    print(f"\n{PAGE.relative_to(ROOT)}:")
    for b in blocks:
        first = b.code.splitlines()[0]
        print(f"  line {b.line}: {'not run: ' + b.not_run if b.not_run else 'runs'}  ({first})")


def walkthrough_script(blocks: list[Block]) -> str:
    parts = []
    for n, b in enumerate(blocks, 1):
        if b.not_run:
            continue
        parts.append(f"echo '### block {n} (line {b.line})'\n{b.code}")
    return "\n".join(parts)


class ReplicaSampler:
    """The worker Deployment's replica count, sampled while the page runs."""

    def __init__(self, cluster):
        self.cluster, self.seen = cluster, [0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            result = self.cluster.kubectl("get", "deployment", "emails-worker", "-n", NS,
                                          "-o", "jsonpath={.status.readyReplicas}", check=False)
            if result.returncode == 0 and result.stdout.strip():
                self.seen.append(int(result.stdout))
            self._stop.wait(1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def reader_environment(cluster) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTMQ_")}
    env["KUBECONFIG"] = str(cluster.kubeconfig)
    env["PATH"] = os.pathsep.join([str(cluster.plane.bin_dir), str(Path(sys.executable).parent), env["PATH"]])
    return env


def leftovers(cluster) -> list[str]:
    """What of the walk-through is still in the cluster."""
    found = []
    if cluster.kubectl("get", "namespace", NS, check=False).returncode == 0:
        found.append(f"namespace {NS}")
    for crd in ("queues.effectmq.io", "schedules.effectmq.io"):
        if cluster.kubectl("get", "crd", crd, check=False).returncode == 0:
            found.append(f"crd {crd}")
    kinds = "clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings"
    names = cluster.kubectl("get", kinds, "-l", RELEASE_LABEL, "-o", "name").stdout.split()
    return found + names


def clean_up_after_a_failed_page(cluster) -> None:
    """Best effort, so that later tests start from an empty cluster again."""
    cluster.kubectl("delete", "queues,schedules", "--all", "-n", NS, "--wait", "--timeout=60s", check=False)
    cluster.helm("uninstall", "effectmq", "-n", NS, "--wait", check=False)
    cluster.kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait", "--timeout=120s", check=False)


@pytest.mark.cluster
@pytest.mark.timeout(1800)  # with a wait for another module's cluster (tests/fixtures/node.py)
def test_walkthrough_runs_verbatim(kube_cluster, tmp_path):
    c = kube_cluster
    # From an empty cluster: an earlier module's release leaves its CRDs (helm keeps them).
    c.kubectl("delete", "-f", str(CRDS), "--ignore-not-found", "--wait")
    assert leftovers(c) == [], "the cluster is not empty before the walk-through"

    script = walkthrough_script(shell_blocks(PAGE.read_text()))
    log = tmp_path / "walkthrough.log"
    started = time.monotonic()
    with ReplicaSampler(c) as sampler, log.open("w") as sink:
        # output to a file: a background process the page left running cannot hold up the test
        page = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=reader_environment(c),
                                stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            page.wait(timeout=900)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:  # the page's own clean-up stops its port-forward; anything still running is a leak
                os.killpg(page.pid, 0)
                stray = True
                os.killpg(page.pid, signal.SIGKILL)
            except ProcessLookupError:
                stray = False
            page.wait()
    output = log.read_text()
    if page.returncode != 0:
        clean_up_after_a_failed_page(c)
    took = time.monotonic() - started
    print(f"\nwalk-through ran in {took:.0f} s; worker pods ready, sampled: max {max(sampler.seen)}\n{output}")

    assert page.returncode == 0, f"a block of the walk-through failed (or took over 900 s):\n{output[-6000:]}"
    assert not stray, "the walk-through left processes running (its port-forward?)"
    assert "queue.effectmq.io/emails condition met" in output  # kubectl wait: the Queue became Ready
    done = REPORTS_DONE.search(output)
    assert done, f"the producer did not report its results:\n{output[-3000:]}"
    assert int(done["count"]) == 240  # every task offered completed (wait() returned each result)
    assert int(done["pods"]) >= 2, "all reports ran in one pod: the workers did not scale up"
    assert max(sampler.seen) >= 2, f"never more than one ready worker pod: {sampler.seen}"
    assert leftovers(c) == [], "the walk-through's clean-up left something behind"


# ---- the release, through an OCI registry on loopback

REGISTRY_NS = "registry-demo"
REGISTRY_RELEASE = "effectmq"  # so the example Queue's Secret name, effectmq-redis, fits unchanged
EXAMPLE_QUEUE = ROOT / "examples" / "k8s" / "queue.yaml"
WORKER_PODS = "app.kubernetes.io/name=effectmq-worker"
OPERATOR_PODS = "app.kubernetes.io/component=operator"


@pytest.fixture(scope="module")
def registry(kube_cluster, tmp_path_factory):
    if not Path("/usr/local/go/bin/go").exists() and not any(
            (Path(p) / "go").exists() for p in os.environ["PATH"].split(os.pathsep)):
        unavailable("the registry is built from Go modules: go is missing")
    reg = LoopbackRegistry(build_registry(), tmp_path_factory.mktemp("registry"))
    forwarder = NamespaceForwarder(Path("/run/netns") / kube_cluster.network.namespace, reg.port)
    trust_plain_http(kube_cluster.registry_hosts_dir, reg.address)
    reg.forwarder = forwarder
    yield reg
    forwarder.close()
    reg.stop()


def tool_environment(cluster, out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTMQ_")}
    env["PATH"] = os.pathsep.join([str(cluster.plane.bin_dir), str(Path(sys.executable).parent), env["PATH"]])
    env["KUBECONFIG"] = str(cluster.kubeconfig)
    env["EFFECTMQ_RELEASE_OUT"] = str(out)
    return env


def pushed(out: Path) -> dict[str, tuple[str, str]]:
    """pushed.txt: repository -> (reference, digest)."""
    found = {}
    for line in (out / "pushed.txt").read_text().splitlines():
        _kind, ref = line.split(" ", 1)
        name, digest = ref.rsplit("@", 1)
        repository = name.removeprefix("oci://").rsplit(":", 1)[0]
        found[repository] = (name, digest)
    return found


def image_id_digest(pod: dict, container: str) -> str:
    status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
    return status["imageID"].rsplit("@", 1)[-1]


@pytest.mark.cluster
@pytest.mark.timeout(1800)
def test_release_pushed_to_loopback_registry_installs_and_runs_from_it(kube_cluster, registry, tmp_path):
    c = kube_cluster
    out = tmp_path / "release"
    env = tool_environment(c, out)
    started = time.monotonic()
    release = subprocess.run(["bash", "tooling/release.sh", registry.address, "--plain-http"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=1200)
    release_took = time.monotonic() - started
    assert release.returncode == 0, f"tooling/release.sh failed:\n{release.stderr[-4000:]}"
    artifacts = pushed(out)
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert sorted((out / "dist").iterdir()) == [out / "dist" / f"effectmq-{version}-py3-none-any.whl",
                                                  out / "dist" / f"effectmq-{version}.tar.gz"]
    assert set(artifacts) == {f"{registry.address}/{name}" for name in
                              ("charts/effectmq", "effectmq-operator", "effectmq-worker", "effectmq-redis")}
    assert all(ref.endswith(f":{version}") for ref, _ in artifacts.values())

    # The example's handlers image is no release artifact: pushed here beside them.
    # (the archive the cluster fixture built: images.sh rebuilds the example only beside the worker)
    example_archive, = [a for a in c.image_archives if a.parent.name == "example"]
    example = f"{registry.address}/shop-workers:1.4.2"
    example_digest = tmp_path / "example.digest"
    copy = subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--digestfile", str(example_digest),
                           f"oci-archive:{example_archive}", f"docker://{example}"], capture_output=True, text=True)
    assert copy.returncode == 0, f"skopeo could not push {example}:\n{copy.stderr}"

    try:
        started = time.monotonic()
        install = c.helm("install", REGISTRY_RELEASE, f"oci://{registry.address}/charts/effectmq", "--version", version,
                         "--plain-http", "-n", REGISTRY_NS, "--create-namespace",
                         "--set", f"image.repository={registry.address}/effectmq-operator",
                         "--set", "redis.enabled=true",
                         "--set", f"redis.image.repository={registry.address}/effectmq-redis",
                         "--wait", "--timeout", "300s")
        install_took = time.monotonic() - started
        queue = EXAMPLE_QUEUE.read_text().replace("registry.example/shop-workers:1.4.2", example)
        assert example in queue
        c.kubectl("apply", "-n", REGISTRY_NS, "-f", "-", input=queue)
        c.kubectl("patch", "queue", "emails", "-n", REGISTRY_NS, "--type=merge",
                  "-p", json.dumps({"spec": {"scaling": {"minReplicas": 1}}}))
        c.kubectl("wait", "-n", REGISTRY_NS, "--for=condition=Ready", "queue/emails", "--timeout=120s")

        def ready_worker():
            pods = c.kubectl_json("get", "pods", "-n", REGISTRY_NS, "-l", WORKER_PODS)["items"]
            return next((p for p in pods if any(s.get("ready") for s in p["status"].get("containerStatuses", []))),
                        None)
        worker = wait_for(ready_worker, timeout=240, interval=2, what="a ready worker pod")

        # Every pod runs the image the registry served, by the digest release.sh pushed.
        operator = c.kubectl_json("get", "pods", "-n", REGISTRY_NS, "-l", OPERATOR_PODS)["items"][0]
        redis = c.kubectl_json("get", "pod", f"{REGISTRY_RELEASE}-redis-0", "-n", REGISTRY_NS)
        assert image_id_digest(operator, "operator") == artifacts[f"{registry.address}/effectmq-operator"][1]
        assert image_id_digest(redis, "redis") == artifacts[f"{registry.address}/effectmq-redis"][1]
        assert worker["status"]["containerStatuses"][0]["image"] == example
        assert image_id_digest(worker, "worker") == example_digest.read_text().strip()
        assert registry.forwarder and registry.forwarder.connections > 0  # the node's pulls came through its loopback

        # ... and the worker runs tasks.
        name = worker["metadata"]["name"]
        offered = c.kubectl("exec", "-n", REGISTRY_NS, name, "--", "effectmq", "offer", "send_email",
                            '{"to": "bob@example.com"}', "--json")
        task_id = json.loads(offered.stdout)["task_id"]

        def completed():
            shown = c.kubectl("exec", "-n", REGISTRY_NS, name, "--", "effectmq", "task", task_id, "--json")
            return json.loads(shown.stdout).get("state") == "completed"
        wait_for(completed, timeout=60, interval=1, what=f"task {task_id} completed")
    finally:
        c.kubectl("delete", "queue", "emails", "-n", REGISTRY_NS, "--ignore-not-found", "--wait", check=False)
        c.helm("uninstall", REGISTRY_RELEASE, "-n", REGISTRY_NS, "--wait", check=False)
        c.kubectl("delete", "namespace", REGISTRY_NS, "--wait", check=False)
    print(f"\nrelease.sh: {release_took:.0f} s; helm install oci://{registry.address}/charts/effectmq "
          f"--version {version}: {install_took:.0f} s\n{install.stdout}\n{(out / 'pushed.txt').read_text()}")
