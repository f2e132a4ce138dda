"""The chart and the examples on a one-node cluster whose pods really run, driven the
way a user does it: `helm install` with the built operator image and the bundled
Redis, `kubectl apply -f examples/k8s/`, `kubectl wait`, `kubectl port-forward` to
offer tasks. Tests run in file order and share the release (module fixture).

One test adds an OpenTelemetry Collector (tooling/otelcol) as a Deployment and
follows a trace from a producer outside the cluster into a worker pod.

The example Queue gets test-sized settings through `kubectl patch` (short leases,
one task per pod, a grace period of 8 s, scaling that reacts within seconds),
and the every-10-s `digest` Schedule is suspended until its own test, so idle
really means idle."""

from __future__ import annotations

import base64
import calendar
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis as redis_client
import yaml

import effectmq
from bench.rate_limit import most_in_a_window
from effectmq.protocol.keys import QueueKeys
from tooling.testbed import Unavailable, otelcol
from tooling.testbed.cluster import normalized_reference
from tests.fixtures.kube import unavailable
from tests.fixtures.redis import free_port
from tests.support.operator import wait_for
from tests.support.processes import ROOT
from tests.support.tracing import exporting_over_otlp

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

NS = "effectmq"
RELEASE = "effectmq"  # examples/k8s/queue.yaml names the bundled Redis's Secret, effectmq-redis
CHART = ROOT / "charts" / "effectmq"
EXAMPLES = ROOT / "examples" / "k8s"
QUEUE = f"{NS}/emails"
WORKERS = "app.kubernetes.io/name=effectmq-worker"
TEST_SETTINGS = {"spec": {
    "lockTimeoutSeconds": 6, "lockRefreshSeconds": 2,
    "worker": {"concurrency": 1, "terminationGracePeriodSeconds": 8},
    "scaling": {"minReplicas": 0, "maxReplicas": 4, "targetTasksPerReplica": 50, "pollIntervalSeconds": 2,
                "scaleDownStabilizationSeconds": 5, "cooldownSeconds": 10},
}}


def patch(cluster, kind: str, name: str, body: dict) -> None:
    cluster.kubectl("patch", kind, name, "-n", NS, "--type=merge", "-p", json.dumps(body))


def scale(cluster, **scaling: int) -> None:
    patch(cluster, "queue", "emails", {"spec": {"scaling": scaling}})


def operator_pods(cluster) -> list[dict]:
    """The pods of the chart's operator Deployment (by its own selector)."""
    deployment = cluster.kubectl_json("get", "deployment", RELEASE, "-n", NS)
    selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
    return cluster.kubectl_json("get", "pods", "-n", NS, "-l", selector)["items"]


def worker_pods(cluster) -> list[dict]:
    return cluster.kubectl_json("get", "pods", "-n", NS, "-l", WORKERS)["items"]


def ready(pod: dict) -> bool:
    return pod["metadata"].get("deletionTimestamp") is None and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def ready_worker_names(cluster) -> set[str]:
    return {p["metadata"]["name"] for p in worker_pods(cluster) if ready(p)}


def deployment_replicas(cluster) -> int:
    return cluster.kubectl_json("get", "deployment", "emails-worker", "-n", NS)["spec"]["replicas"]


def wait_workers(cluster, count: int, timeout: float = 120) -> set[str]:
    def settled():
        pods = worker_pods(cluster)
        names = {p["metadata"]["name"] for p in pods if ready(p)}
        return names if len(names) == count and len(pods) == count else None
    return wait_for(settled, timeout=timeout, interval=0.5, what=f"{count} ready worker pods and no others")


def holder(q, task_id: str) -> str | None:
    """The pod running a send_report attempt (the handler reports it as progress)."""
    info = q.get(task_id)
    if info is None or info.state != "active" or not isinstance(info.progress, dict):
        return None
    return info.progress.get("handled_by")


def on_two_pods(q, tasks: list[str]) -> dict[str, str] | None:
    """The pod running each of two tasks, once they run on two different pods."""
    pods = {t: pod for t in tasks if (pod := holder(q, t)) is not None}
    return pods if len(pods) == 2 and len(set(pods.values())) == 2 else None


class Sampler:
    """The worker Deployment's replica count and the worker pods seen, sampled in the background."""

    def __init__(self, cluster):
        self.cluster, self.replicas, self.pods = cluster, [], set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.replicas.append(deployment_replicas(self.cluster))
                self.pods |= {p["metadata"]["name"] for p in worker_pods(self.cluster)}
            except Exception:  # a missed sample is fine
                pass
            self._stop.wait(0.5)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def release(kube_cluster):
    """The chart installed with the bundled Redis, and the examples applied."""
    c = kube_cluster
    c.helm("install", RELEASE, str(CHART), "--namespace", NS, "--create-namespace",
           "--set", "redis.enabled=true", "--wait", "--timeout", "180s")
    c.kubectl("apply", "-n", NS, "-f", str(EXAMPLES))
    c.kubectl("wait", "-n", NS, "--for=condition=Ready", "queue/emails", "--timeout=60s")
    patch(c, "schedule", "digest", {"spec": {"suspend": True}})
    patch(c, "queue", "emails", TEST_SETTINGS)
    yield c
    c.helm("uninstall", RELEASE, "--namespace", NS, "--wait", check=False)


def redis_password(cluster) -> str:
    secret = cluster.kubectl_json("get", "secret", f"{RELEASE}-redis", "-n", NS)
    return base64.b64decode(secret["data"]["password"]).decode()


@contextlib.contextmanager
def port_forward(cluster, namespace: str, service: str, remote_port: int, log: Path) -> Iterator[int]:
    """`kubectl port-forward svc/<service>` on a free local port, as a user reaches a
    Service from outside the cluster; yields the local port."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(cluster.plane.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "-n", namespace,
             "port-forward", f"svc/{service}", f"{port}:{remote_port}"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "Forwarding from" in log.read_text() or proc.poll() is not None, timeout=30,
                 what="kubectl port-forward")
        assert proc.poll() is None, log.read_text()
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def redis_port(release, tmp_path_factory):
    """`kubectl port-forward` to the bundled Redis, as a user reaches it."""
    log = tmp_path_factory.mktemp("port-forward") / "port-forward.log"
    with port_forward(release, NS, f"{RELEASE}-redis", 6379, log) as port:
        yield port


@pytest.fixture(scope="module")
def redis_url(release, redis_port):
    """The bundled Redis through the port-forward, with the password from the chart's Secret."""
    return f"redis://:{redis_password(release)}@127.0.0.1:{redis_port}/0"


@pytest.fixture
def q(redis_url):
    queue = effectmq.SyncTaskQueue(QUEUE, url=redis_url)
    yield queue
    queue.close()


def test_operator_runs_from_its_image_restricted_and_reconciles(release):
    c = release
    (pod,) = operator_pods(c)
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    assert spec["serviceAccountName"] == RELEASE
    assert c.kubectl("get", "serviceaccount", RELEASE, "-n", NS).returncode == 0
    assert container["image"] == "effectmq-operator:0.1.0"
    (status,) = pod["status"]["containerStatuses"]
    assert status["imageID"] and status["image"] == normalized_reference(container["image"])
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["runAsNonRoot"] is True
    assert security["capabilities"]["drop"] == ["ALL"] and security["allowPrivilegeEscalation"] is False
    # the probes are there and passing: Ready, never restarted
    assert container["livenessProbe"]["httpGet"] and container["readinessProbe"]["httpGet"]
    assert ready(pod) and status["restartCount"] == 0
    # in the running container: the non-root uid, a root filesystem that refuses writes
    probe = ("import os\ntry:\n    open('/probe', 'w')\nexcept OSError as e:\n    print(os.getuid(), e.strerror)")
    out = c.kubectl("exec", "-n", NS, pod["metadata"]["name"], "--", "python3", "-c", probe).stdout.split(None, 1)
    assert out == ["10001", "Read-only file system\n"]
    # reconciled: the example Queue got its worker Deployment, owned by the Queue
    queue = c.kubectl_json("get", "queue", "emails", "-n", NS)
    workers = c.kubectl_json("get", "deployment", "emails-worker", "-n", NS)
    assert [o["uid"] for o in workers["metadata"]["ownerReferences"]] == [queue["metadata"]["uid"]]
    assert workers["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/shop-workers:1.4.2"


def test_the_bundled_redis_refuses_a_client_without_its_password(release, redis_port, redis_url):
    """In the running pod: a PING without the password gets NOAUTH,
    the Secret's password works (the readiness probe's did: `helm install --wait`), and
    `helm test` checks the same from a pod of the release."""
    c = release
    with socket.create_connection(("127.0.0.1", redis_port), timeout=10) as conn:
        conn.sendall(b"PING\r\n")
        assert conn.recv(200).startswith(b"-NOAUTH"), "the bundled Redis answered without a password"
    client = redis_client.Redis.from_url(redis_url, socket_timeout=10, decode_responses=True)
    assert client.ping() and client.config_get("protected-mode") == {"protected-mode": "yes"}
    client.close()
    # the test pod checks it with EFFECTMQ_TEST_REDIS_AUTH=required (and is deleted once it succeeds)
    out = c.helm("test", RELEASE, "--namespace", NS, "--timeout", "180s").stdout
    assert "Phase:          Succeeded" in out, out


def test_2000_tasks_run_in_worker_pods_that_scale_up_and_back_down(release, q):
    c = release
    wait_for(lambda: deployment_replicas(c) == 0, timeout=60, what="no workers while idle")
    with Sampler(c) as sampler:
        offered = q.offer_many(("send_email", {"to": f"user{i}@example.com"}) for i in range(2000))
        results = [q.wait(o.task_id, timeout=300) for o in offered]
        wait_for(lambda: deployment_replicas(c) == 0 and not worker_pods(c), timeout=120, interval=0.5,
                 what="scaled back to zero")
    assert [r["delivered_to"] for r in results] == [f"user{i}@example.com" for i in range(2000)]
    ran_in = {r["handled_by"] for r in results}
    assert ran_in <= sampler.pods, ran_in - sampler.pods  # every task ran in one of the worker pods
    assert len(ran_in) >= 2, ran_in
    peak = max(sampler.replicas)
    assert peak == 4, sampler.replicas  # 2000 waiting / 50 per replica, capped at maxReplicas
    assert sampler.replicas[-1] == 0
    assert all(q.get(o.task_id).stalled_attempt_count == 0 for o in offered[::50])


def test_scale_in_removes_idle_pods_first_and_a_removed_busy_pod_releases(release, q):
    c = release
    scale(c, minReplicas=3, maxReplicas=3)
    before = wait_workers(c, 3)
    tasks = [q.offer("send_report", {"report": f"long-{i}", "seconds": 12}).task_id for i in range(2)]
    # two pods running one each (a pod that learned short handlers earlier holds a second
    # lease ahead, and hands it back after 2 s: that task's attempt 1 ends "released")
    running = wait_for(lambda: on_two_pods(q, tasks), timeout=60, what="both long tasks running on two pods")
    busy = set(running.values())
    assert busy <= before, (running, before)
    idle = before - busy
    time.sleep(3)  # a scaling poll (every 2 s) sets pod-deletion-cost on the busy pods
    # (12 s tasks: the removed busy pod drains for 3 s, EFFECTMQ_DRAIN_TIMEOUT of an 8 s grace,
    # and must still be running when that ends, so it releases instead of finishing)
    started = time.monotonic()
    scale(c, minReplicas=1, maxReplicas=1)
    (survivor,) = wait_workers(c, 1, timeout=60)
    removed_in = time.monotonic() - started
    assert survivor in busy, (survivor, busy, idle)  # the idle pod went first
    (removed_busy,) = busy - {survivor}
    assert removed_in < 8 + 5, removed_in  # within the grace period (8 s), with room for the poll
    results = {t: q.wait(t, timeout=90) for t in tasks}
    for t in tasks:
        info = q.get(t)
        assert info.state == "completed" and info.stalled_attempt_count == 0, info
    # the removed pod handed its attempt back; the survivor ran it again as the next attempt
    (handed_back,) = [t for t, pod in running.items() if pod == removed_busy]
    info = q.get(handed_back)
    assert info.attempts and info.attempts[-1].outcome == "released", info
    assert info.attempt == info.attempts[-1].attempt + 1, info
    assert results[handed_back]["handled_by"] == survivor, (results, removed_busy)
    scale(c, minReplicas=0, maxReplicas=4)


def test_force_deleted_pod_mid_task_stalls_once_and_the_task_completes_elsewhere(release, q):
    c = release
    scale(c, minReplicas=2, maxReplicas=2)
    pods = wait_workers(c, 2)
    task = q.offer("send_report", {"report": "forced", "seconds": 6}).task_id
    victim = wait_for(lambda: holder(q, task), timeout=60, what="the task running")
    assert victim in pods
    c.kubectl("delete", "pod", victim, "-n", NS, "--force", "--grace-period=0")
    result = q.wait(task, timeout=120)
    info = q.get(task)
    assert info.stalled_attempt_count == 1 and info.state == "completed", info
    assert result["handled_by"] != victim and result["handled_by"].startswith("emails-worker-"), result
    scale(c, minReplicas=0, maxReplicas=4)


def worker_env(pid: int) -> dict[str, str]:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)


def started_at(pid: int) -> float:
    """When a process started, in seconds of CLOCK_BOOTTIME (/proc/<pid>/stat, field 22)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")


def new_processes(known: set[int]) -> list[int]:
    """Processes of this machine (the node's pods are some) not in `known`; one that has
    run for 2 s joins `known` (a container's first process starts as `runc init` and
    gets the container's environment when it execs, within milliseconds)."""
    fresh = []
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in known]:
        try:
            if time.clock_gettime(time.CLOCK_BOOTTIME) - started_at(pid) > 2:
                known.add(pid)
            fresh.append(pid)
        except OSError:
            known.add(pid)  # gone
    return fresh


def delete_in_its_sandbox(c, known: set[int], timeout: float) -> str:
    """Delete the next worker pod the moment its sandbox (its `pause` process) runs: the
    kubelet, which is starting the pod, starts its container and then stops it within
    its first second, as first seen by hand. The pod's name."""
    deadline = time.monotonic() + timeout
    missed: list[str] = []
    look_at_pods = time.monotonic() + 5
    while time.monotonic() < deadline:
        # A pod whose container is already up was missed (its sandbox started before `known`
        # was taken, or a scan of a loaded machine lost it): it cannot show the first second,
        # so it goes, and its replacement is the next chance. Every 5 s: kubectl is slow
        # beside the 10 ms scans of /proc.
        for pod in worker_pods(c) if time.monotonic() >= look_at_pods else []:
            statuses = pod.get("status", {}).get("containerStatuses") or []
            name = pod["metadata"]["name"]
            if name not in missed and not pod["metadata"].get("deletionTimestamp") \
                    and any("running" in (s.get("state") or {}) for s in statuses):
                missed.append(name)
                c.kubectl("delete", "pod", name, "-n", NS, "--wait=false")
        if time.monotonic() >= look_at_pods:
            look_at_pods = time.monotonic() + 5
        # Every process not known, whatever its age: on a loaded machine a scan may come
        # after the sandbox's first 2 s (new_processes would take it for an old one).
        for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in known]:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() != "pause":
                    continue  # (not marked known: a container's first process execs later)
                cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            except OSError:
                continue
            known.add(pid)
            for pod in worker_pods(c):
                uid = pod["metadata"]["uid"]
                if pod["metadata"]["name"] in missed:
                    continue  # its sandbox, seen late: not a first second
                if uid in cgroup or uid.replace("-", "_") in cgroup:
                    c.kubectl("delete", "pod", pod["metadata"]["name"], "-n", NS, "--wait=false")
                    return pod["metadata"]["name"]
        time.sleep(0.01)
    seen = [(p["metadata"]["name"], p.get("status", {}).get("phase")) for p in worker_pods(c)]
    raise AssertionError(f"no worker pod sandbox started within {timeout}s (worker pods now: {seen}; "
                         f"missed with their container up: {missed}; replicas: {deployment_replicas(c)})")


def worker_container_of(pod: str, known: set[int], timeout: float) -> int | None:
    """The first process (PID 1) of the worker container of `pod`, seen within ~10 ms of
    its exec; None when the kubelet did not start it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in new_processes(known):
            if worker_env(pid).get("EFFECTMQ_WORKER_NAME") == pod:
                while True:  # tini's child: its parent is the container's first process
                    try:
                        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                    except OSError:
                        break
                    if worker_env(parent).get("EFFECTMQ_WORKER_NAME") != pod:
                        break
                    pid = parent
                return pid
        time.sleep(0.01)
    return None


def test_a_worker_pod_deleted_in_its_first_second_stops_at_once_and_strands_nothing(release, q):
    """Before, `effectmq worker` was the container's PID 1 and installed its SIGTERM handler
    only once serving: the kernel drops a signal PID 1 has no handler for, so a pod deleted
    as it started went on taking tasks while Terminating and was SIGKILLed at the end of
    its grace period (8 s here), mid-task: a stall. (With the images before tini this test
    failed: "pod ..., deleted as it started, ran on for 8.3s".) tini is PID 1 now and
    forwards the signal; the worker stops whenever it comes."""
    c = release
    scale(c, minReplicas=0, maxReplicas=1)
    try:
        _delete_a_worker_in_its_first_second(c, q)
    finally:  # the next tests scale as the release does
        scale(c, minReplicas=0, maxReplicas=4)


def _delete_a_worker_in_its_first_second(c, q) -> None:
    wait_for(lambda: deployment_replicas(c) == 0 and not worker_pods(c), timeout=120, interval=0.5,
             what="no worker pods")
    known = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    task = q.offer("send_report", {"report": "first-second", "seconds": 10}).task_id  # longer than the grace
    for _ in range(3):  # the operator scales from zero; a deleted pod's replacement is the next try
        pod = delete_in_its_sandbox(c, known, timeout=120)
        deleted_at = time.clock_gettime(time.CLOCK_BOOTTIME)
        pid = worker_container_of(pod, known, timeout=20)
        if pid is not None:
            break  # else the kubelet gave up starting it: nothing to show with this one
    else:
        raise AssertionError("three pods deleted in their sandbox, and the kubelet started none of their containers")
    started = started_at(pid)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), timeout=30, interval=0.05, what="the container ended")
    ran = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    # the grace period is 8 s: a clean stop (draining at most EFFECTMQ_DRAIN_TIMEOUT, 3 s), not the SIGKILL
    assert ran < 7, f"pod {pod}, deleted as it started, ran on for {ran:.1f}s"
    result = q.wait(task, timeout=120)
    info = q.get(task)
    assert info.state == "completed" and info.stalled_attempt_count == 0, info
    assert result["handled_by"] != pod, (result, pod)
    print(f"pod {pod} deleted; its container started {started - deleted_at:+.2f}s after that and ran {ran:.1f}s")


def test_deleted_operator_pod_comes_back_and_scaling_goes_on(release, q):
    c = release
    (old,) = [p["metadata"]["name"] for p in operator_pods(c)]
    wait_for(lambda: deployment_replicas(c) == 0, timeout=90, what="idle before the test")
    c.kubectl("delete", "pod", old, "-n", NS, "--wait=false")
    c.kubectl("rollout", "status", f"deployment/{RELEASE}", "-n", NS, "--timeout=120s")
    new = wait_for(lambda: [p["metadata"]["name"] for p in operator_pods(c)
                            if ready(p) and p["metadata"]["name"] != old],
                   timeout=120, what="a new operator pod Ready")
    assert new and old not in new
    with Sampler(c) as sampler:
        offered = q.offer_many(("send_email", {"to": f"again{i}@example.com"}) for i in range(300))
        for o in offered:
            q.wait(o.task_id, timeout=180)
    assert max(sampler.replicas) >= 2, sampler.replicas  # the new leader scaled on the backlog


def test_schedule_ticks_run_as_tasks_in_worker_pods_one_task_per_tick(release, q):
    c = release
    patch(c, "schedule", "digest", {"spec": {"suspend": False}})
    seen: list[str] = []

    def two_new_ticks():
        last = c.kubectl_json("get", "schedule", "digest", "-n", NS).get("status", {}).get("lastTaskID")
        if last and (not seen or seen[-1] != last):
            seen.append(last)
        return len(seen) >= 3  # the first may predate the resume

    wait_for(two_new_ticks, timeout=90, interval=0.5, what="two new digest ticks")
    patch(c, "schedule", "digest", {"spec": {"suspend": True}})
    first, last = seen[1], seen[-1]

    def stamp(task_id: str) -> int:
        return calendar.timegm(time.strptime(task_id.rsplit("/", 1)[1], "%Y-%m-%dT%H:%M:%SZ"))

    # every tick between the first and the last new one is a task (deterministic ids: one per tick)
    ids = [f"{NS}/digest/" + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
           for t in range(stamp(first), stamp(last) + 1, 10)]
    assert len(ids) >= 2 and ids[0] == first and ids[-1] == last, (ids, seen)
    for task_id in ids:
        result = q.wait(task_id, timeout=60)
        info = q.get(task_id)
        assert info.attempt == 1 and result["report"] == "digest", info
        assert result["handled_by"].startswith("emails-worker-"), result


WRONG_HANDLERS = "shop.taskz:app"  # examples/shop has shop.tasks, not shop.taskz
STALL_BOUND = 150.0  # seconds from the offer (or the edit) to Stalled=True and kstatus Failed; see below


def side_queue(name: str, handlers: str, min_replicas: int) -> dict:
    """A Queue next to the example's, on the example image and the bundled Redis."""
    queue = yaml.safe_load((EXAMPLES / "queue.yaml").read_text())
    queue["metadata"] = {"name": name, "namespace": NS}
    spec = queue["spec"]
    spec.update(lockTimeoutSeconds=6, lockRefreshSeconds=2)
    spec["worker"].update(handlers=handlers, concurrency=1, terminationGracePeriodSeconds=8,
                          resources={"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}})
    spec["scaling"] = {"minReplicas": min_replicas, "maxReplicas": 1, "targetTasksPerReplica": 50,
                       "pollIntervalSeconds": 2, "scaleDownStabilizationSeconds": 5, "cooldownSeconds": 10}
    return queue


class Verdicts:
    """What the status of one Queue and kstatus said over time, from `start` on."""

    def __init__(self, c, kstatus, name: str, start: float, generation: int | None = None):
        self.c, self.kstatus, self.name, self.start, self.generation = c, kstatus, name, start, generation
        self.seen: list[tuple[float, str, str, str]] = []  # (s since start, kstatus, Ready reason, Ready message)
        self.stalled_at: float | None = None
        self.failed_at: float | None = None
        self.queue: dict = {}

    def poll(self) -> None:
        queue = self.c.kubectl_json("get", "queue", self.name, "-n", NS)
        at = time.monotonic() - self.start
        generation = queue["metadata"]["generation"]
        conds = {c["type"]: c for c in queue.get("status", {}).get("conditions") or []}
        if self.generation is not None and (conds.get("Ready") or {}).get("observedGeneration") != generation:
            return  # the operator has not judged the edited spec yet
        judged = self.kstatus(queue)
        ready = conds.get("Ready") or {}
        self.seen.append((at, judged.status, ready.get("reason", ""), ready.get("message", "")))
        self.queue = queue
        stalled = conds.get("Stalled") or {}
        if self.stalled_at is None and stalled.get("status") == "True":
            self.stalled_at = at
        if self.failed_at is None and judged.status == "Failed":
            self.failed_at = at

    @property
    def done(self) -> bool:
        return self.stalled_at is not None and self.failed_at is not None

    def condition(self, kind: str) -> dict:
        return next(c for c in self.queue["status"]["conditions"] if c["type"] == kind)

    def story(self) -> str:
        """The distinct verdicts, in order, for a failure message and the log."""
        lines, last = [], None
        for at, judged, reason, message in self.seen:
            if (judged, reason, message) != last:
                lines.append(f"  {at:6.1f}s kstatus {judged}, Ready=False {reason}: {message}")
                last = (judged, reason, message)
        return "\n".join(lines)


def waiting_for_ready(c, name: str, timeout: float) -> subprocess.Popen:
    """`kubectl wait --for=condition=Ready` as a user runs it, in the background."""
    return subprocess.Popen(
        [str(c.plane.bin_dir / "kubectl"), f"--kubeconfig={c.kubeconfig}", "-n", NS, "wait",
         "--for=condition=Ready", f"queue/{name}", f"--timeout={timeout:g}s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def queue_ready(c, name: str) -> str | None:
    queue = c.kubectl_json("get", "queue", name, "-n", NS)
    return next((x["status"] for x in queue.get("status", {}).get("conditions") or [] if x["type"] == "Ready"), None)


def crash_record(c, name: str) -> str:
    """The worker pods of a Queue: restarts, and when the worker container first started."""
    pods = c.kubectl_json("get", "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={name}")["items"]
    out = []
    for pod in pods:
        for s in pod["status"].get("containerStatuses") or []:
            state = {**(s.get("lastState") or {}), **(s.get("state") or {})}
            out.append(f"{pod['metadata']['name']} (created {pod['metadata']['creationTimestamp']}): "
                       f"{s.get('restartCount')} restarts, ready={s.get('ready')}, state {sorted(state)}")
    return "; ".join(out) or "no pods"


def test_a_wrong_handler_module_is_stalled_and_failed_within_the_bound_from_zero_and_over_running_pods(
        release, redis_url, kstatus):
    """On the real kubelet. Two Queues on the example image,
    side by side so the bound is waited out once: `broken` has handlers shop.taskz:app (no such
    module) and minReplicas 0, and gets 5 tasks (a scale-up from zero, which the Deployment
    controller never judges); `renamed` runs shop.tasks:app with one Ready pod, then its
    handlers are edited to shop.taskz:app (a rollout over a running, serving pod).

    For each, `kubectl wait --for=condition=Ready --timeout=150s`, started at the offer or the
    edit, times out, and before those 150 s the status says Stalled=True WorkersCrashLooping
    quoting the import error and kstatus says Failed. The bound: the operator stalls a crash
    loop at 3 restarts (not ready for 30 s); at the kubelet's back-off (at most 10, 20, 40 s)
    the third restart comes at most about 75 s after the first start, plus the pod's start
    (a scale-up poll every 2 s), the operator's pod check (at least every 10 s) and this
    machine's load: 150 s. Measured on this node (2 shared cores): restarts seen at 7, 26 and
    48 s after the offer, Stalled and Failed at 48.5 s from zero and 58.3 s after the edit.
    And no verdict on the edited spec calls the old pod available. (Before 97234d0, from zero
    read RollingOut / kstatus InProgress for ever, and the edit "1 of 1 replicas updated,
    1 available".)"""
    c = release
    names, waits = ("broken", "renamed"), {}
    c.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        side_queue("broken", WRONG_HANDLERS, 0), side_queue("renamed", "shop.tasks:app", 1)]}))
    try:
        # at zero the broken Queue is truthfully Ready (no worker runs it yet); the other serves
        c.kubectl("wait", "-n", NS, "--for=condition=Ready", "queue/broken", "queue/renamed", "--timeout=120s",
                  timeout=130)
        wait_for(lambda: c.kubectl_json("get", "deployment", "renamed-worker", "-n", NS)["status"]
                 .get("availableReplicas") == 1, timeout=30, what="renamed's worker available")
        q = effectmq.SyncTaskQueue(f"{NS}/broken", url=redis_url)
        try:
            q.offer_many(("send_email", {"to": f"nobody{i}@example.com"}) for i in range(5))
        finally:
            q.close()
        offered = time.monotonic()
        # Ready until the operator's next poll (2 s) reads the backlog and scales up; a wait
        # begun before that would see the Ready it had at zero
        wait_for(lambda: queue_ready(c, "broken") != "True", timeout=30, interval=0.25,
                 what="broken no longer Ready once it has tasks")
        print(f"\nbroken left Ready {time.monotonic() - offered:.1f}s after the offer")
        waits["broken"] = waiting_for_ready(c, "broken", STALL_BOUND)
        patch(c, "queue", "renamed", {"spec": {"worker": {"handlers": WRONG_HANDLERS}}})
        edited = time.monotonic()
        waits["renamed"] = waiting_for_ready(c, "renamed", STALL_BOUND)
        generation = c.kubectl_json("get", "queue", "renamed", "-n", NS)["metadata"]["generation"]
        verdicts = {"broken": Verdicts(c, kstatus, "broken", offered),
                    "renamed": Verdicts(c, kstatus, "renamed", edited, generation)}
        while not all(v.done for v in verdicts.values()) and time.monotonic() - offered < STALL_BOUND + 5:
            for v in verdicts.values():
                if not v.done:
                    v.poll()
            time.sleep(1)
        records = {name: crash_record(c, name) for name in names}
        outputs = {name: w.communicate(timeout=STALL_BOUND + 30)[0] for name, w in waits.items()}
        waited = time.monotonic() - offered
        for name in names:
            v = verdicts[name]
            print(f"\n{name}: Stalled after {v.stalled_at}s, kstatus Failed after {v.failed_at}s "
                  f"(bound {STALL_BOUND:g}s); pods: {records[name]}\n{v.story()}\n"
                  f"kubectl wait (rc {waits[name].returncode}): {outputs[name].strip()}")
        print(f"both kubectl waits ended {waited:.0f}s after the offer")
        for name in names:
            v, story = verdicts[name], f"{name}:\n{verdicts[name].story()}\npods: {records[name]}"
            assert waits[name].returncode != 0 and "timed out" in outputs[name], (name, outputs[name], story)
            assert v.stalled_at is not None and v.stalled_at <= STALL_BOUND, story
            assert v.failed_at is not None and v.failed_at <= STALL_BOUND, story
            stalled, ready = v.condition("Stalled"), v.condition("Ready")
            assert stalled["reason"] == ready["reason"] == "WorkersCrashLooping", story
            assert "No module named 'shop.taskz'" in stalled["message"], story  # the worker's last log line
            warnings = c.kubectl_json("get", "events", "-n", NS, "--field-selector",
                                      f"involvedObject.kind=Queue,involvedObject.name={name},type=Warning")["items"]
            assert "WorkersCrashLooping" in {e["reason"] for e in warnings}, [e["reason"] for e in warnings]
        # over running pods: the old pod keeps serving (maxUnavailable 0) and is never the new template's
        renamed = verdicts["renamed"]
        assert "of the previous template still serve" in renamed.condition("Stalled")["message"], renamed.story()
        claims = [s for s in renamed.seen if s[2] in ("Ready", "Available") or s[1] == "Current"
                  or any(f in s[3] for f in ("1 available", "at least 1", "1 of 1 replicas of the current"))]
        assert not claims, renamed.story()
    finally:
        for w in waits.values():
            if w.poll() is None:
                w.kill()
                w.wait()
        c.kubectl("delete", "queue", *names, "-n", NS, "--wait=true", "--timeout=60s", check=False)
        wait_for(lambda: not c.kubectl_json("get", "pods", "-n", NS, "-l",
                                            "app.kubernetes.io/instance in (broken,renamed)")["items"],
                 timeout=90, interval=1, what="the side Queues' worker pods gone")


OBSERVABILITY = "observability"  # the collector's namespace, as a cluster's shared one would be
TRACE_SECRET = "payload-secret-5c1e"  # in the traced task's payload: no span may show it


@pytest.fixture
def collector(release, tmp_path):
    """The OpenTelemetry Collector (tooling/otelcol: OTLP receiver, file exporter) as a
    Deployment and Service in a namespace of its own, from a single-binary image imported
    into the node. It writes what it receives to a hostPath directory of this machine
    (the node's pods run on its filesystem); yields that file. Pods reach the collector at
    http://otel-collector.observability:4318."""
    c = release
    try:
        binary = otelcol.locate_binary()
    except Unavailable as exc:
        unavailable(str(exc))
    archive = tmp_path / "otelcol.tar"
    image = otelcol.write_image(binary, archive)
    c.import_image(archive)
    # not under pytest's basetemp (0700): the collector runs as uid 65535
    spans_dir = Path(tempfile.mkdtemp(prefix="emq-otelcol-"))
    spans_dir.chmod(0o777)
    c.kubectl("create", "namespace", OBSERVABILITY)
    try:
        objects = otelcol.kubernetes_objects(OBSERVABILITY, image, spans_dir)
        c.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        c.kubectl("rollout", "status", "deployment/otel-collector", "-n", OBSERVABILITY, "--timeout=120s", timeout=130)
        yield spans_dir / otelcol.SPANS_FILE
    finally:
        c.kubectl("delete", "namespace", OBSERVABILITY, "--wait=true", "--timeout=60s", check=False, timeout=70)
        shutil.rmtree(spans_dir, ignore_errors=True)


def test_a_producer_outside_and_a_worker_pod_make_one_trace_in_a_real_collector(release, redis_url, collector,
                                                                               tmp_path):
    """A producer outside the cluster (this process, with the OpenTelemetry SDK) offers a
    task under a request span, exporting to the collector through `kubectl port-forward`;
    a worker pod of a Queue whose spec.worker.tracing points the SDK at the collector's Service
    runs it. The collector's file holds one trace: request -> `send <queue>` (PRODUCER, this
    process) -> `process <queue>` (CONSUMER, the worker pod), with the messaging attributes,
    and no span shows the payload or the attempt's lease token."""
    c = release
    name, queue_name = "traced", f"{NS}/traced"
    queue = side_queue(name, "shop.tasks:app", 1)
    queue["spec"]["worker"]["tracing"] = {"otlpEndpoint": f"http://otel-collector.{OBSERVABILITY}:4318"}
    queue["spec"]["worker"]["env"] += [
        {"name": "OTEL_BSP_SCHEDULE_DELAY", "value": "200"},  # export within 0.2 s of an attempt's end
    ]
    c.kubectl("apply", "-f", "-", input=json.dumps(queue))
    try:
        c.kubectl("wait", "-n", NS, "--for=condition=Ready", f"queue/{name}", "--timeout=120s", timeout=130)
        wait_for(lambda: c.kubectl_json("get", "deployment", f"{name}-worker", "-n", NS)["status"]
                 .get("availableReplicas") == 1, timeout=90, what="the traced Queue's worker available")
        (pod,) = c.kubectl_json("get", "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={name}")["items"]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector.{OBSERVABILITY}:4318", env
        logs = c.kubectl("logs", "-n", NS, pod["metadata"]["name"]).stdout
        assert "exporting traces (OTEL_* variables): otlp" in logs, logs  # the image has the otel extra

        with port_forward(c, OBSERVABILITY, "otel-collector", otelcol.OTLP_HTTP_PORT,
                          tmp_path / "port-forward.log") as port:
            with exporting_over_otlp(f"http://127.0.0.1:{port}", "shop-web") as tracer:
                q = effectmq.SyncTaskQueue(queue_name, url=redis_url)
                try:
                    with tracer.start_as_current_span("POST /signup") as request:
                        task_id = q.offer("send_email", {"to": "traced@example.com", "subject": TRACE_SECRET}).task_id
                    result = q.wait(task_id, timeout=120)
                finally:
                    q.close()
        assert result["delivered_to"] == "traced@example.com" and result["handled_by"] == pod["metadata"]["name"]
        client = redis_client.Redis.from_url(redis_url, socket_timeout=10, decode_responses=True)
        token = client.hget(QueueKeys("emq", queue_name).task(task_id), "last_token")
        client.close()
        assert token, "the attempt's lease token, to look for in the spans"

        trace_id = format(request.get_span_context().trace_id, "032x")

        def both_spans() -> dict[str, otelcol.Span] | None:
            spans = {s.name: s for s in otelcol.read_spans(collector) if s.trace_id == trace_id}
            return spans if {f"send {queue_name}", f"process {queue_name}"} <= spans.keys() else None

        spans = wait_for(both_spans, timeout=60, interval=0.5, what="the send and process spans in the collector")
        send, process, root = spans[f"send {queue_name}"], spans[f"process {queue_name}"], spans["POST /signup"]
        assert (send.kind, send.service) == ("PRODUCER", "shop-web"), send
        assert (process.kind, process.service) == ("CONSUMER", f"{name}-worker"), process
        # the kubelet expanded the pod's identity into the resource (spec.worker.tracing's variables)
        resource = process.resource
        assert (resource["k8s.pod.name"], resource["k8s.pod.uid"], resource["k8s.namespace.name"],
                resource["k8s.node.name"]) == (pod["metadata"]["name"], pod["metadata"]["uid"], NS,
                                               pod["spec"]["nodeName"]), resource
        # one trace: the request, the offer in it, the attempt in the worker pod under the offer
        assert root.parent_span_id == "" and send.parent_span_id == root.span_id, (root, send)
        assert process.parent_span_id == send.span_id, (send, process)
        for span in (send, process):
            assert span.attributes["messaging.system"] == "effectmq", span
            assert span.attributes["messaging.destination.name"] == queue_name, span
            assert span.attributes["messaging.message.id"] == task_id, span
        assert process.attributes["effectmq.attempt"] == 1 and process.attributes["effectmq.outcome"] == "completed"
        # nothing the collector received (any span, attribute or event) shows the payload or the token
        received = collector.read_text()
        assert TRACE_SECRET not in received and token not in received
    finally:
        c.kubectl("delete", "queue", name, "-n", NS, "--wait=true", "--timeout=60s", check=False)
        wait_for(lambda: not c.kubectl_json("get", "pods", "-n", NS, "-l",
                                            f"app.kubernetes.io/instance={name}")["items"],
                 timeout=90, interval=1, what="the traced Queue's worker pods gone")


def queue_condition(cluster, kind: str) -> dict | None:
    queue = cluster.kubectl_json("get", "queue", "emails", "-n", NS)
    return next((x for x in queue.get("status", {}).get("conditions") or [] if x["type"] == kind), None)


def test_a_rate_limited_queue_scales_only_to_what_its_limit_can_use_and_says_why_tasks_wait(release, q):
    # Without the limit these 300 tasks scale to 4 pods (300 / 50 per replica, capped at
    # maxReplicas), as the test above shows for 2000; at 10 starts a second, the tasks of
    # one pod (concurrency 1, a few ms each) are all the limit can use.
    c = release
    wait_for(lambda: deployment_replicas(c) == 0, timeout=60, what="no workers while idle")
    patch(c, "queue", "emails", {"spec": {"rateLimit": {"tasks": 10, "periodSeconds": 1}}})
    wait_for(lambda: (lambda queue: queue["status"].get("observedGeneration") == queue["metadata"]["generation"])(
        c.kubectl_json("get", "queue", "emails", "-n", NS)), timeout=30, what="the limit reconciled")
    seen: list[tuple[str, str]] = []
    try:
        with Sampler(c) as sampler:
            offered = q.offer_many(("send_email", {"to": f"limited{i}@example.com"}) for i in range(300))
            pending = {o.task_id for o in offered}
            deadline = time.monotonic() + 240
            while pending and time.monotonic() < deadline:
                limited = queue_condition(c, "RateLimited")
                if limited is not None:
                    seen.append((limited["status"], limited["reason"]))
                pending = {t for t in pending if q.get(t).state != "completed"}
                time.sleep(1)
            assert not pending, f"{len(pending)} tasks not completed"
        starts = sorted(q.get(o.task_id).started_at.timestamp() for o in offered)
        assert most_in_a_window(starts, 1.0) <= 10, starts
        assert starts[-1] - starts[0] >= 29  # 300 starts at 10 a second
        # The pod the limit uses, plus one; 3 when a poll found both pods mid-attempt (the rule
        # reads the attempts in flight at one instant: 2 of them fill 2 pods, plus one; seen
        # once in CI). Without the limit the same backlog takes maxReplicas, 4.
        assert max(sampler.replicas) <= 3, sampler.replicas
        assert ("True", "LimitReached") in seen, seen
        wait_for(lambda: (queue_condition(c, "RateLimited") or {}).get("status") == "False", timeout=30,
                 what="RateLimited=False once the backlog is done")
        assert (queue_condition(c, "Ready") or {}).get("status") == "True"
        scaled = c.kubectl_json("get", "events", "-n", NS, "--field-selector",
                                "involvedObject.name=emails,reason=Scaled")["items"]
        assert any("rate limit" in e["message"] for e in scaled), [e["message"] for e in scaled]
    finally:  # the tests after it find the Queue without a limit, whatever happened here
        patch(c, "queue", "emails", {"spec": {"rateLimit": None}})
        wait_for(lambda: queue_condition(c, "RateLimited") is None, timeout=30, what="no RateLimited without a limit")


def test_helm_upgrade_rolls_the_operator_and_uninstall_leaves_only_crds_and_redis_data(release):
    c = release
    before = {p["metadata"]["name"] for p in operator_pods(c)}
    c.helm("upgrade", RELEASE, str(CHART), "--namespace", NS, "--reuse-values", "--set", "verbose=true",
           "--wait", "--timeout", "180s")
    def rolled():
        pods = operator_pods(c)
        return pods if len(pods) == 1 and pods[0]["metadata"]["name"] not in before and ready(pods[0]) else None

    (pod,) = wait_for(rolled, timeout=90, what="the operator rolled: one new pod, the old one gone")
    assert "--verbose" in pod["spec"]["containers"][0]["args"]
    c.kubectl("wait", "-n", NS, "--for=condition=Ready", "queue/emails", "--timeout=60s")

    c.kubectl("delete", "-n", NS, "-f", str(EXAMPLES), "--wait=true", "--timeout=60s")
    wait_for(lambda: c.kubectl("get", "deployment", "emails-worker", "-n", NS, check=False).returncode != 0,
             timeout=60, what="the worker Deployment garbage-collected with its Queue")
    c.helm("uninstall", RELEASE, "--namespace", NS, "--wait", "--timeout", "120s")

    kinds = c.kubectl("api-resources", "--verbs=list", "--namespaced", "-o", "name").stdout.split()
    kinds = [k for k in kinds if k not in ("events", "events.events.k8s.io")]  # records, not objects
    left = wait_for(lambda: _left_behind(c, kinds), timeout=60, interval=1, what="only what is kept by design")
    assert left == {"persistentvolumeclaims/data-effectmq-redis-0"}, left
    cluster_left = c.kubectl("get", "clusterrole,clusterrolebinding", "-l", f"app.kubernetes.io/instance={RELEASE}",
                             "-o", "name").stdout.split()
    assert cluster_left == []
    crds = c.kubectl("get", "crd", "-o", "name").stdout.split()
    assert {"customresourcedefinition.apiextensions.k8s.io/queues.effectmq.io",
            "customresourcedefinition.apiextensions.k8s.io/schedules.effectmq.io"} <= set(crds)


def _left_behind(c, kinds: list[str]) -> set[str] | None:
    out = c.kubectl("get", ",".join(kinds), "-n", NS, "-o", "json").stdout
    names = set()
    for item in json.loads(out)["items"]:
        kind, name = item["kind"].lower() + "s", item["metadata"]["name"]
        if (kind, name) in {("configmaps", "kube-root-ca.crt"), ("serviceaccounts", "default")}:
            continue  # every namespace has these
        names.add(f"{kind}/{name}")
    return names if all(not n.startswith("pods/") for n in names) else None

