"""Seeded chaos on the one-node cluster: the chart, its bundled Redis (AOF on its volume),
a Queue scaling worker pods on backlog, a Schedule ticking every few seconds and a
producer outside the cluster, while faults chosen from the seed overlap: worker pods
deleted (graceful and forced), a worker container OOM-killed, the operator pod deleted,
kubelet and containerd restarted, the node's pods cut from Redis (iptables in the node's
namespace) and healed, the Redis pod deleted. Then the checks of bench/_chaos_checks.py
run on the recorded history; a JSON and a text report are written.

    python bench/chaos_cluster.py --seed 7 --minutes 10 [--out DIR] [--plant drop-done] [--faults KINDS]

brings a cluster up (tooling/testbed/cluster.py; needs root, the node binaries and the
images, as tests/fixtures/node.py says), runs, and tears it down; exit 1 when a check
failed. :func:`run_chaos` runs it on a cluster that is already up (tests/cluster/test_chaos.py).

Handlers (bench/_chaos_handlers.py) are added to the example worker image as one layer and
record every attempt in a side store no fault touches: a redis-server on the host end of
the node's veth, which pods reach as they reach the API server. The producer reaches the
bundled Redis at its Service address, through a host route via the node.

Two more faults act on the control plane (off in the short variant of the tests; on by
default here, --faults picks the kinds): kube-apiserver stopped for 20-60 s and started
again with the same flags (apiserver_stop), and, with two operator replicas, the Lease
holder's pod cut from the API server for 20-60 s (leader_cut: iptables in the node's
namespace, matching the pod's IP); the other replica must take over through the Lease and
the cut one must stop acting. The run records the Lease's holder, the operator's Events and
each replica's leadership log lines for the checks.

Not covered here (later work): Sentinel and Redis Cluster failover (bench/chaos_failover.py
runs them under local workers).
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

import effectmq
from bench import _chaos_checks as checks
from bench._chaos_checks import Fault
from bench._chaos_handlers import token_hash
from effectmq.client.models import parse_task
from effectmq.protocol.keys import INDEXES, QueueKeys
from tooling.testbed import REPO_ROOT, cache_dir
from tooling.testbed.cluster import IMAGES_BUILD_COMMAND, OneNodeCluster, image_archives, locate_node_bin
from tooling.testbed.controlplane import locate_bin_dir
from tooling.testbed.oci import write_derived_image

NS = "chaos"
RELEASE = "effectmq"
QUEUE = "jobs"
SCHEDULE = "ticker"
TICK_SECONDS = 5
LOCK_SECONDS = 6
MAX_REPLICAS = 4
WORKER_IMAGE = "localhost/effectmq-chaos-worker:1"
HANDLERS_FILE = Path(__file__).with_name("_chaos_handlers.py")
HANDLERS_MODULE = "emq_chaos_handlers"
STALL_CAP = 100  # expired leases a task may take: forced faults stall tasks many times
SETTLE_SECONDS = 300.0
# (kind, weight): how often each fault is drawn
FAULT_KINDS = (("pod_delete", 4), ("pod_force", 4), ("oom", 2), ("operator_delete", 2), ("redis_delete", 2),
               ("net_cut", 2), ("kubelet_restart", 2), ("containerd_restart", 1))
# Faults of the control plane, held 20-60 s: the API server stopped, the leading operator
# replica cut from it (with a second replica, which must take over)
CONTROL_PLANE_KINDS = (("apiserver_stop", 1), ("leader_cut", 2))
ALL_KINDS = FAULT_KINDS + CONTROL_PLANE_KINDS
LONG_HOLD = (20.0, 60.0)  # seconds a control-plane fault is held


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Run:
    """One chaos run on a cluster that is up; :meth:`execute` returns the history."""

    cluster: OneNodeCluster
    seed: int
    seconds: float
    work_dir: Path
    plant: str | None = None
    kinds: tuple[tuple[str, int], ...] = FAULT_KINDS
    faults: list[Fault] = field(default_factory=list)
    offers: dict[str, dict] = field(default_factory=dict)
    replicas: list[list] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    leases: list[list] = field(default_factory=list)  # [t, holderIdentity] sampled each second
    operator_logs: dict[str, str] = field(default_factory=dict)  # pod (and container run) -> its log

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}/faults")
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.deleted_by_us: set[str] = set()
        self.kind_locks = {kind: threading.Lock() for kind, _ in self.kinds}
        self.operator_replicas = 2 if any(kind == "leader_cut" for kind, _ in self.kinds) else 1
        # the Lease, Events and leadership logs are recorded only with the control plane's faults
        self.control_plane = any(kind in dict(CONTROL_PLANE_KINDS) for kind, _ in self.kinds)
        self.current: dict[str, Fault] = {}  # the fault of each kind in progress

    # ---- helpers

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.cluster.kubectl(*args, check=check, timeout=timeout)

    def get(self, *args: str) -> dict:
        return self.cluster.kubectl_json("get", *args, "-n", NS, timeout=30)

    def pods(self, selector: str) -> list[dict]:
        return self.get("pods", "-l", selector)["items"]

    def ready(self, pod: dict) -> bool:
        return pod["metadata"].get("deletionTimestamp") is None and any(
            c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))

    def wait(self, what: str, predicate: Callable[[], Any], timeout: float, interval: float = 1.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                value = predicate()
            except Exception:  # the API server or Redis is part of the chaos
                value = None
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")

    # ---- setup

    def start_side_store(self) -> str:
        host = self.cluster.network.host_ip
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        store_dir = self.work_dir / "side-store"
        store_dir.mkdir(parents=True, exist_ok=True)
        self.store_proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--bind", host, "--port", str(port),
             "--protected-mode", "no", "--save", "", "--appendonly", "no", "--dir", str(store_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.store = redis.Redis(host=host, port=port, decode_responses=True)
        self.wait("the side store", self.store.ping, 10, 0.1)
        return f"redis://{host}:{port}/0"

    def manifests(self, store_url: str) -> list[dict]:
        env = [{"name": "EFFECTMQ_CHAOS_STORE", "value": store_url}]
        if self.plant:
            env.append({"name": "EFFECTMQ_CHAOS_PLANT", "value": self.plant})
        queue = {"apiVersion": "effectmq.io/v1alpha1", "kind": "Queue", "metadata": {"name": QUEUE, "namespace": NS},
                 "spec": {
                     "redis": {"urlFrom": {"secretKeyRef": {"name": f"{RELEASE}-redis", "key": "url"}}},
                     "lockTimeoutSeconds": LOCK_SECONDS, "lockRefreshSeconds": 2, "maxStalledCount": STALL_CAP,
                     "worker": {"image": WORKER_IMAGE, "imagePullPolicy": "Never",
                                "handlers": f"{HANDLERS_MODULE}:app", "concurrency": 2,
                                "terminationGracePeriodSeconds": 8, "env": env,
                                "resources": {"requests": {"cpu": "20m", "memory": "64Mi"},
                                              "limits": {"memory": "200Mi"}}},
                     "scaling": {"minReplicas": 1, "maxReplicas": MAX_REPLICAS, "targetTasksPerReplica": 10,
                                 "pollIntervalSeconds": 2, "scaleDownStabilizationSeconds": 10,
                                 "cooldownSeconds": 5}}}
        schedule = {"apiVersion": "effectmq.io/v1alpha1", "kind": "Schedule",
                    "metadata": {"name": SCHEDULE, "namespace": NS},
                    "spec": {"queueRef": {"name": QUEUE}, "schedule": f"*/{TICK_SECONDS} * * * * *",
                             "task": {"name": "tick"}, "missedTicks": "Skip"}}
        return [queue, schedule]

    def setup(self) -> None:
        store_url = self.start_side_store()
        install(self.cluster, self.work_dir, self.operator_replicas)
        c = self.cluster
        if self.get("deployment", RELEASE)["spec"].get("replicas") != self.operator_replicas:  # a shared install
            c.kubectl("scale", "deployment", RELEASE, "-n", NS, f"--replicas={self.operator_replicas}")
        c.kubectl("rollout", "status", "deployment", RELEASE, "-n", NS, "--timeout=180s", timeout=190)
        env = self.get("deployment", RELEASE)["spec"]["template"]["spec"]["containers"][0]["env"]
        self.lease_name = next(e["value"] for e in env if e["name"] == "EFFECTMQ_OPERATOR_LEASE")
        c.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                         "items": self.manifests(store_url)}))
        c.kubectl("wait", "-n", NS, "--for=condition=Ready", f"queue/{QUEUE}", "--timeout=180s", timeout=190)
        self.redis_url, self.redis_ip = redis_on_host(c)
        self.keys = QueueKeys("emq", f"{NS}/{QUEUE}")
        self.queue = effectmq.SyncTaskQueue(f"{NS}/{QUEUE}", url=self.redis_url, socket_timeout=5)
        self.wait("worker pods", lambda: [p for p in self.pods(f"app.kubernetes.io/instance={QUEUE}")
                                          if self.ready(p)], 180)

    # ---- the producer and the sampler

    def offer(self, task_id: str, payload: dict, kind: str, deadline: float) -> None:
        """Offered until Redis confirms it (a re-offer of the same id after an error)."""
        while time.monotonic() < deadline:
            try:
                self.queue.offer("work", payload, task_id=task_id, max_stalled_count=STALL_CAP)
            except (effectmq.EffectMQError, redis.RedisError, OSError, TimeoutError):  # Redis is down or cut
                time.sleep(0.5)
                continue
            with self.lock:
                self.offers[task_id] = {"kind": kind}
            return
        self.errors.append(f"{task_id}: never confirmed")

    def produce(self) -> None:
        rng = random.Random(f"{self.seed}/tasks")
        n = 0
        while not self.stop.is_set():
            burst = rng.choice((1, 1, 1, 2, 3, 40 if rng.random() < 0.1 else 1))
            for _ in range(burst):
                n += 1
                self.offer(f"w{n:06d}", {"sleep": round(rng.uniform(0.2, 2.5), 2)}, "work", time.monotonic() + 120)
            if n > 5 and rng.random() < 0.1:  # a re-offer of a confirmed id: must not run it again
                self.offer(f"w{rng.randint(1, n - 1):06d}", {"sleep": 0.1}, "work", time.monotonic() + 120)
            self.stop.wait(rng.uniform(0.3, 1.2))

    def sample(self) -> None:
        scaling_in: dict[str, Fault] = {}
        while not self.stop.is_set():
            try:
                d = self.get("deployment", f"{QUEUE}-worker")
                self.replicas.append([time.time(), d["spec"].get("replicas"), d.get("status", {}).get("replicas")])
                pods = {p["metadata"]["name"]: p for p in self.pods(f"app.kubernetes.io/instance={QUEUE}")}
                for name, pod in pods.items():  # scale-in by the operator: a drain, recorded as a window
                    if (pod["metadata"].get("deletionTimestamp") and name not in self.deleted_by_us
                            and name not in scaling_in):
                        scaling_in[name] = Fault("scale_in", name, time.time())
                        self.faults.append(scaling_in[name])
                for name, fault in list(scaling_in.items()):
                    if name not in pods:
                        fault.end = time.time()
                        del scaling_in[name]
            except Exception:  # the API server under a restarted node: a missed sample
                pass
            self.stop.wait(2)
        for fault in scaling_in.values():
            fault.end = time.time()

    def lease_holder(self) -> str | None:
        return (self.get("lease", self.lease_name).get("spec") or {}).get("holderIdentity")

    def watch_lease(self) -> None:
        """The Lease's holder each second (a missed sample while the API server is down)."""
        while not self.stop.is_set():
            try:
                self.leases.append([time.time(), self.lease_holder()])
            except Exception:
                pass
            self.stop.wait(1)

    def save_operator_logs(self, pod: str) -> None:
        """The pod's operator log lines about the Lease, with timestamps, of its container and
        the previous one (restarted by a node fault, or by its liveness probe when its leader
        election was stuck or refused, not for an API server outage): read before the pod is
        deleted, after each control-plane fault and at the end. Kept per container run."""
        try:
            (status,) = self.get("pod", pod)["status"]["containerStatuses"]
        except Exception:
            return
        restarts = status.get("restartCount", 0)
        for run in ((restarts - 1, ["--previous"]), (restarts, [])) if restarts else ((0, []),):
            out = self.kubectl("logs", pod, "-n", NS, "--timestamps", *run[1], check=False).stdout
            lines = "\n".join(line for line in out.splitlines() if "Lease" in line)
            if lines:
                self.operator_logs[f"{pod}#{run[0]}"] = lines

    def save_all_operator_logs(self) -> None:
        for pod in self.operator_pods():
            self.save_operator_logs(pod["metadata"]["name"])

    # ---- faults

    def worker_pod(self) -> str | None:
        """A worker pod not being deleted, Ready ones first (right after a node restart none may be)."""
        deadline = time.monotonic() + 30
        while True:
            pods = [p for p in self.pods(f"app.kubernetes.io/instance={QUEUE}")
                    if not p["metadata"].get("deletionTimestamp")]
            names = sorted(p["metadata"]["name"] for p in pods if self.ready(p))
            if names or time.monotonic() > deadline:
                names = names or sorted(p["metadata"]["name"] for p in pods)
                return self.rng.choice(names) if names else None
            time.sleep(1)

    def oom_victim(self, task_id: str) -> tuple[str, str]:
        """The pod whose container ran the task's first attempt, and how that container last ended."""
        runs = [json.loads(line) for line in self.store.lrange("runs", 0, -1)]
        pods = [r["pod"] for r in runs if r["task"] == task_id and r["attempt"] == 1]
        if not pods:
            return "*", "its first attempt never started"
        try:
            (status,) = self.get("pod", pods[0])["status"]["containerStatuses"]
        except Exception:
            return pods[0], "pod gone"
        ended = (status.get("lastState") or {}).get("terminated") or {}
        return pods[0], f"{ended.get('reason')} (exit {ended.get('exitCode')}), {status['restartCount']} restarts"

    def restart_node_process(self, name: str) -> None:
        plane = self.cluster.plane
        proc = next(p for p in plane.procs if p.name == name)
        os.kill(proc.popen.pid, signal.SIGTERM)  # the process only: containerd's shims keep the containers
        try:
            proc.popen.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(10)
        plane.procs.remove(proc)
        plane._spawn(name, list(proc.popen.args))  # type: ignore[arg-type]

    def begin(self, fault: Fault) -> Fault:
        """Recorded as it starts: a fault whose recovery failed still explains what it did."""
        with self.lock:
            self.faults.append(fault)
            self.current[fault.kind] = fault
        return fault

    def inject(self, kind: str, hold: float) -> Fault | None:
        c = self.cluster
        now = time.time
        if kind in ("pod_delete", "pod_force"):
            pod = self.worker_pod()
            if pod is None:
                return None
            self.deleted_by_us.add(pod)
            fault = self.begin(Fault(kind, pod, now()))
            force = ["--force", "--grace-period=0"] if kind == "pod_force" else []
            self.kubectl("delete", "pod", pod, "-n", NS, "--wait=false", *force, check=False)
            self.wait(f"{pod} gone", lambda: pod not in {p["metadata"]["name"] for p in
                                                      self.pods(f"app.kubernetes.io/instance={QUEUE}")}, 90)
            fault.end = now() + (LOCK_SECONDS if force else 0)  # a forced pod's leases run out after it
            return fault
        if kind == "oom":
            task_id = f"oom{len(self.faults):04d}"
            fault = self.begin(Fault(kind, "*", now(), note=task_id))
            self.offer(task_id, {"oom": True, "sleep": 0.2}, "oom", time.monotonic() + 60)
            self.wait(f"{task_id} done", lambda: self.queue.get(task_id).state == "completed", 120)
            fault.end = now()
            fault.target, how = self.oom_victim(task_id)  # only that pod's container was killed
            fault.note += f" {how}"
            return fault
        if kind == "operator_delete":
            old = self.leader_pod() or sorted(p["metadata"]["name"] for p in self.operator_pods())[0]
            fault = self.begin(Fault(kind, "operator", now(), note=old))
            self.save_operator_logs(old)
            self.kubectl("delete", "pod", old, "-n", NS, "--wait=false")
            self.wait("the operator pods Ready again", lambda: len(
                [p for p in self.operator_pods() if self.ready(p) and p["metadata"]["name"] != old]
            ) >= self.operator_replicas, 180)
            fault.end = now()
            return fault
        if kind == "redis_delete":
            pod = f"{RELEASE}-redis-0"
            uid = self.get("pod", pod)["metadata"]["uid"]
            fault = self.begin(Fault(kind, "*", now()))
            self.kubectl("delete", "pod", pod, "-n", NS, "--wait=false")
            self.wait("Redis back", lambda: (lambda p: p["metadata"]["uid"] != uid and self.ready(p))(
                self.get("pod", pod)), 180)
            fault.end = now()
            fault.note = f"pod {uid[:8]} replaced"
            return fault
        if kind == "net_cut":
            pod_ip = self.get("pod", f"{RELEASE}-redis-0")["status"]["podIP"]
            rules = [["-s", c.network.pod_cidr, "-d", pod_ip, "-j", "DROP"],
                     ["-s", pod_ip, "-d", c.network.pod_cidr, "-j", "DROP"]]
            fault = self.begin(Fault(kind, "*", now(), note=f"{hold:.0f}s"))
            for rule in rules:
                c.on_node(["iptables", "-I", "FORWARD", *rule], check=True)
            try:
                time.sleep(hold)
            finally:
                for rule in rules:
                    c.on_node(["iptables", "-D", "FORWARD", *rule])
            fault.end = now()
            return fault
        if kind == "apiserver_stop":
            fault = self.begin(Fault(kind, "apiserver", now(), note=f"{hold:.0f}s"))
            argv = c.plane.stop_process("kube-apiserver")
            try:
                time.sleep(hold)
            finally:
                c.plane.start_process("kube-apiserver", argv)
            fault.end = now()
            self.wait("the operator pods Ready", lambda: len(
                [p for p in self.operator_pods() if self.ready(p)]) >= self.operator_replicas, 180)
            self.save_all_operator_logs()
            self.wait("the node Ready", lambda: self.cluster.kubectl(
                "get", "node", "-o", "jsonpath={.items[0].status.conditions[?(@.type=='Ready')].status}",
                check=False).stdout.strip() == "True", 120)
            return fault
        if kind == "leader_cut":
            return self.cut_leader(hold)
        if kind in ("kubelet_restart", "containerd_restart"):
            fault = self.begin(Fault(kind, "*", now()))
            self.restart_node_process(kind.split("_")[0])
            self.wait("the node Ready", lambda: self.cluster.kubectl(
                "get", "node", "-o", "jsonpath={.items[0].status.conditions[?(@.type=='Ready')].status}",
                check=False).stdout.strip() == "True", 120)
            fault.end = now() + 5
            return fault
        raise ValueError(kind)

    def leader_pod(self) -> str | None:
        """The operator pod whose identity (its hostname and pid) holds the Lease."""
        holder = self.lease_holder() or ""
        return next((p["metadata"]["name"] for p in self.operator_pods()
                     if holder.startswith(p["metadata"]["name"] + "-")), None)

    def cut_leader(self, hold: float) -> Fault | None:
        """The leading replica's pod cut from the API server (both directions, in the node's
        FORWARD chain, after kube-proxy's DNAT of the `kubernetes` Service) for `hold` s."""
        c = self.cluster
        pod = self.leader_pod()
        if pod is None or len([p for p in self.operator_pods() if self.ready(p)]) < 2:
            return None  # no leader, or no second replica to take over
        pod_ip = self.get("pod", pod)["status"]["podIP"]
        api_port = c.plane.server.rsplit(":", 1)[1]
        host = c.network.host_ip
        rules = [["-s", pod_ip, "-d", host, "-p", "tcp", "--dport", api_port, "-j", "DROP"],
                 ["-s", host, "-d", pod_ip, "-p", "tcp", "--sport", api_port, "-j", "DROP"]]
        before = self.lease_holder()
        fault = self.begin(Fault("leader_cut", "operator", time.time(), note=f"{pod} {hold:.0f}s"))
        for rule in rules:
            c.on_node(["iptables", "-I", "FORWARD", *rule], check=True)
        try:
            started = time.monotonic()
            try:
                holder = self.wait("another replica holding the Lease",
                                   lambda: (lambda h: h if h and h != before else None)(self.lease_holder()),
                                   hold, 0.5)
                fault.note += f", taken over by {holder} after {time.monotonic() - started:.1f}s"
            except TimeoutError:
                fault.note += ", not taken over while cut"
                self.errors.append(f"leader_cut: {pod} cut {hold:.0f}s, the Lease stayed with {before}")
            time.sleep(max(0.0, started + hold - time.monotonic()))
        finally:
            for rule in rules:
                c.on_node(["iptables", "-D", "FORWARD", *rule])
        fault.end = time.time()
        self.save_all_operator_logs()
        return fault

    def operator_pods(self) -> list[dict]:
        deployment = self.get("deployment", RELEASE)
        selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
        return self.pods(selector)

    def fault_thread(self, kind: str, hold: float) -> None:
        with self.kind_locks[kind]:  # one fault of a kind at a time; kinds overlap freely
            if self.stop.is_set():
                return
            self.current.pop(kind, None)
            try:
                if kind != "apiserver_stop":  # the others act through the API: drawn while it is down, they wait
                    self.wait("the API server", lambda: self.kubectl("get", "--raw", "/readyz", check=False,
                                                                     timeout=10).returncode == 0, 120)
                fault = self.inject(kind, hold)
            except Exception as exc:
                self.errors.append(f"{kind}: {exc}")
                log(f"fault {kind} failed: {exc}")
                started = self.current.get(kind)
                if started is not None and started.end is None:
                    started.end = time.time() + LOCK_SECONDS
                return
            if fault is None:
                self.errors.append(f"{kind}: skipped, nothing to fault")
                return
            fault.end = fault.end or time.time()
            log(f"fault {kind} on {fault.target} {fault.note}: {fault.end - fault.start:.1f}s")

    def schedule(self) -> list[tuple[float, str, float]]:
        """(seconds from the start, kind, hold) for every fault, from the seed."""
        kinds = [k for k, w in self.kinds for _ in range(w)]
        count = max(len(self.kinds), int(self.seconds / 12))
        first = [k for k, _ in self.kinds]  # every kind at least once
        drawn = first + [self.rng.choice(kinds) for _ in range(count - len(first))]
        self.rng.shuffle(drawn)
        plan = sorted((self.rng.uniform(5, max(6, self.seconds - 20)), k, self.rng.uniform(5, 15)) for k in drawn)
        low, high = LONG_HOLD  # the same draw, stretched to 20-60 s for the control plane's faults
        return [(at, k, low + (hold - 5) / 10 * (high - low) if k in dict(CONTROL_PLANE_KINDS) else hold)
                for at, k, hold in plan]

    # ---- the run

    def execute(self) -> dict:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.setup()
        plan = self.schedule()
        log(f"seed {self.seed}: {len(plan)} faults over {self.seconds:.0f}s: "
            + ", ".join(f"+{at:.0f}s {kind}" for at, kind, _ in plan))
        self.t0 = time.time()
        threads = [threading.Thread(target=self.produce, daemon=True),
                   threading.Thread(target=self.sample, daemon=True)]
        if self.control_plane:
            threads.append(threading.Thread(target=self.watch_lease, daemon=True))
        for t in threads:
            t.start()
        faults = []
        try:
            for at, kind, hold in plan:
                delay = self.t0 + at - time.time()
                if delay > 0:
                    time.sleep(delay)
                t = threading.Thread(target=self.fault_thread, args=(kind, hold), daemon=True)
                t.start()
                faults.append(t)
            time.sleep(max(0.0, self.t0 + self.seconds - time.time()))
        finally:
            self.stop.set()
            for t in faults:
                t.join(300)
            for t in threads:
                t.join(150)
            for fault in self.faults:
                fault.end = fault.end or time.time()
        log(f"faults over: {len(self.faults)} windows, {len(self.offers)} offers confirmed; settling")
        return self.collect()

    def settle(self) -> None:
        ids = sorted(self.offers)
        deadline = time.monotonic() + SETTLE_SECONDS
        client = redis.Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=10)
        while time.monotonic() < deadline:
            try:
                pipe = client.pipeline(transaction=False)
                for tid in ids:
                    pipe.hget(self.keys.task(tid), "state")
                left = [tid for tid, state in zip(ids, pipe.execute()) if state not in ("completed", "failed",
                                                                                       "canceled")]
            except redis.RedisError:
                left = ids
            if not left:
                return
            time.sleep(2)
        log(f"{len(left)} tasks not terminal after {SETTLE_SECONDS:.0f}s")

    def collect(self) -> dict:
        self.settle()
        started = time.monotonic()
        ready = self.cluster.kubectl("wait", "-n", NS, "--for=condition=Ready", f"queue/{QUEUE}", "--timeout=180s",
                                     check=False, timeout=190)
        conditions = self.get("queue", QUEUE).get("status", {}).get("conditions")
        if self.control_plane:
            self.save_all_operator_logs()
        events = [{"instance": e.get("reportingInstance"), "reason": e.get("reason"), "count": e.get("count"),
                   "first": e.get("firstTimestamp"), "last": e.get("lastTimestamp"),
                   "object": f"{e['involvedObject'].get('kind')}/{e['involvedObject'].get('name')}"}
                  for e in self.get("events")["items"] if e.get("reportingComponent") == "effectmq-operator"
                  ] if self.control_plane else []
        client = redis.Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=10)
        ticks = [k[len(self.keys.task("")):] for k in client.scan_iter(self.keys.task(f"{NS}/{SCHEDULE}/*"),
                                                                          count=1000)]
        indexes = {name: set(client.zrange(self.keys.key(name), 0, -1)) for name in INDEXES}
        tasks = {}
        for tid in [*self.offers, *ticks]:
            h = client.hgetall(self.keys.task(tid))
            if not h:
                continue
            info = parse_task(tid, h)
            tasks[tid] = {"state": info.state, "attempt": info.attempt, "result": info.result,
                          "last_token": token_hash(h["last_token"]) if h.get("last_token") else None,
                          "indexes": [name for name in INDEXES if tid in indexes[name]]}
        known = set(self.offers) | set(ticks)
        history = {
            "seed": self.seed, "seconds": self.seconds, "t0": self.t0, "plant": self.plant,
            "lock_seconds": LOCK_SECONDS, "tick_seconds": TICK_SECONDS, "max_replicas": MAX_REPLICAS,
            "tick_prefix": f"{NS}/{SCHEDULE}/",
            "offers": self.offers, "tasks": tasks,
            "unknown_in_indexes": sorted(set().union(*indexes.values()) - known),
            "runs": [json.loads(line) for line in self.store.lrange("runs", 0, -1)],
            "faults": [vars(f) for f in self.faults], "replicas": self.replicas,
            "leases": self.leases, "operator_events": events,
            "leadership": leadership(self.operator_logs),
            "ready_after": {"ready": ready.returncode == 0, "waited": round(time.monotonic() - started, 1),
                            "conditions": conditions},
            "harness_errors": self.errors,
        }
        client.close()
        return history

    def close(self) -> None:
        queue = getattr(self, "queue", None)
        if queue is not None:
            queue.close()
        if getattr(self, "redis_ip", None):
            forget_redis_route(self.redis_ip)
        proc = getattr(self, "store_proc", None)
        if proc is not None:
            proc.terminate()
            proc.wait(10)


def _log_instant(stamp: str) -> float | None:
    """Epoch seconds of a `kubectl logs --timestamps` prefix (RFC 3339, nanoseconds)."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    try:
        return datetime.fromisoformat(whole + "+00:00").timestamp() + float(f"0.{fraction or 0}")
    except ValueError:
        return None


def leadership(logs: dict[str, str]) -> list[dict]:
    """Each replica's terms as leader from its log lines (kubectl logs --timestamps):
    {"identity", "start", "end"} in epoch seconds; "end" None when its log ends leading."""
    terms: list[dict] = []
    for text in logs.values():
        open_terms: dict[str, dict] = {}
        for line in text.splitlines():
            stamp, _, message = line.partition(" ")
            t = _log_instant(stamp)
            if t is None:
                continue
            for marker, event in ((" acquired leadership of Lease", "start"), (" stopped leading Lease", "end")):
                if marker not in message:
                    continue
                identity = message.split(marker)[0].rsplit(" ", 1)[-1]
                if event == "start":
                    open_terms[identity] = {"identity": identity, "start": t, "end": None}
                    terms.append(open_terms[identity])
                elif identity in open_terms:
                    open_terms.pop(identity)["end"] = t
    return terms


def install(cluster: OneNodeCluster, work_dir: Path, operator_replicas: int = 1) -> None:
    """The chaos worker image (the example image and bench/_chaos_handlers.py) and the chart
    with its bundled Redis in namespace NS, unless they are there: the tests of
    tests/cluster/test_chaos.py share one install with the run."""
    if cluster.helm("status", RELEASE, "--namespace", NS, check=False).returncode == 0:
        return
    # the example image the cluster imported: current/example.tar (main()) or the archive this
    # checkout built, images/example/<key>.tar (tests/fixtures/node.py)
    base = next(a for a in cluster.image_archives if "example" in (a.parent.name, a.stem))
    archive = work_dir / "chaos-worker.tar"
    work_dir.mkdir(parents=True, exist_ok=True)
    write_derived_image(base, {f"/app/{HANDLERS_MODULE}.py": HANDLERS_FILE.read_bytes()}, WORKER_IMAGE, archive)
    cluster.import_image(archive)
    cluster.helm("install", RELEASE, str(REPO_ROOT / "charts" / "effectmq"), "--namespace", NS, "--create-namespace",
                 "--set", "redis.enabled=true", "--set", f"replicaCount={operator_replicas}",
                 "--wait", "--timeout", "240s", timeout=300)


def redis_on_host(cluster: OneNodeCluster) -> tuple[str, str]:
    """The bundled Redis' URL as the host reaches it, and its Service address: a host route
    to it via the node, whose kube-proxy rules DNAT it (forget_redis_route removes it)."""
    def get(*args: str) -> dict:
        return cluster.kubectl_json("get", *args, "-n", NS, timeout=30)

    password = base64.b64decode(get("secret", f"{RELEASE}-redis")["data"]["password"]).decode()
    ip = get("service", f"{RELEASE}-redis")["spec"]["clusterIP"]
    subprocess.run(["ip", "route", "replace", f"{ip}/32", "via", cluster.network.node_ip], check=True)
    return f"redis://:{password}@{ip}:6379/0", ip


def forget_redis_route(ip: str) -> None:
    subprocess.run(["ip", "route", "del", f"{ip}/32"], capture_output=True)


def write_report(history: dict, out: Path) -> dict:
    """The checks on a history; writes history.json, report.json and report.txt under ``out``."""
    problems = checks.check(history)
    summary = checks.summary(history, problems)
    out.mkdir(parents=True, exist_ok=True)
    (out / "history.json").write_text(json.dumps(history))
    (out / "report.json").write_text(json.dumps({"summary": summary, "problems": problems}, indent=2))
    lines = [f"chaos run, seed {history['seed']}, {history['seconds']:.0f}s of faults"
             + (f", planted defect {history['plant']}" if history.get("plant") else ""),
             *(f"  {k}: {v}" for k, v in summary.items() if k != "checks"), "checks (problems found):"]
    for name, found in problems.items():
        lines.append(f"  {'FAIL' if found else 'ok  '} {name}: {len(found)}")
        lines += [f"       {p}" for p in found[:10]]
    if history.get("harness_errors"):
        lines.append("harness errors: " + "; ".join(history["harness_errors"][:10]))
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return {"summary": summary, "problems": problems}


def run_chaos(cluster: OneNodeCluster, seed: int, seconds: float, out: Path, plant: str | None = None,
              kinds: tuple[tuple[str, int], ...] = FAULT_KINDS) -> dict:
    """One run on a cluster that is up (the chart is installed into namespace chaos and removed after)."""
    run = Run(cluster, seed, seconds, out / "work", plant, kinds)
    try:
        history = run.execute()
    finally:
        run.close()
        cluster.helm("uninstall", RELEASE, "--namespace", NS, "--wait", "--timeout", "120s", check=False)
        cluster.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=120s", check=False, timeout=130)
    return write_report(history, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plant", choices=("drop-done",), default=None,
                        help="run with a planted defect the checks must catch")
    parser.add_argument("--faults", default=",".join(k for k, _ in ALL_KINDS),
                        help="the fault kinds drawn, comma-separated (default: all: %(default)s)")
    args = parser.parse_args(argv)
    weights = dict(ALL_KINDS)
    unknown = sorted(set(args.faults.split(",")) - set(weights))
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; known: {', '.join(weights)}")
    kinds = tuple((k, weights[k]) for k in args.faults.split(","))
    out = args.out or Path(tempfile.mkdtemp(prefix=f"emq-chaos-{args.seed}-"))
    built = subprocess.run(["bash", str(REPO_ROOT / "tooling" / "images.sh"), "all"], capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"`{IMAGES_BUILD_COMMAND}` failed:\n{built.stderr[-3000:]}")
    lock_path = cache_dir() / "cluster.lock"
    with lock_path.open("w") as lock:
        log("waiting for the machine's one cluster slot")
        fcntl.flock(lock, fcntl.LOCK_EX)
        work = Path(tempfile.mkdtemp(prefix="emq-node-"))
        logs = out / "cluster-logs"
        logs.mkdir(parents=True, exist_ok=True)
        cluster = OneNodeCluster(locate_bin_dir(), locate_node_bin(), work, logs, image_archives())
        try:
            cluster.start()
            log(f"cluster up; seed {args.seed}, {args.minutes:g} min; report in {out}")
            result = run_chaos(cluster, args.seed, args.minutes * 60, out, args.plant, kinds)
        finally:
            cluster.stop()
            shutil.rmtree(work, ignore_errors=True)
    return 0 if result["summary"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
