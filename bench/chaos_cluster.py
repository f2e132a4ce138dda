"""Seeded chaos on the one-node cluster: the chart, its bundled Redis (AOF on its volume),
a Queue scaling worker pods on backlog, a Schedule ticking every few seconds and a
producer outside the cluster, while faults chosen from the seed overlap: worker pods
deleted (graceful and forced), a worker container OOM-killed, the operator pod deleted,
kubelet and containerd restarted, the node's pods cut from Redis (iptables in the node's
namespace) and healed, the Redis pod deleted. Then the checks of bench/_chaos_checks.py
run on the recorded history; a JSON and a text report are written.

    python bench/chaos_cluster.py --seed 7 --minutes 10 [--redis sentinel] [--out DIR] [--plant drop-done]
                                  [--faults KINDS]

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

--redis sentinel runs the same with Redis Sentinel in pods instead of the bundled Redis
(bench/_chaos_sentinel.py: a StatefulSet of a primary and its replica, one of three
Sentinels, quorum 2, down-after 3 s; their startup scripts make a recreated pod rejoin as a
replica of the master the Sentinels name). The Queue, and so the operator and the workers,
use redis+sentinel:// with the Sentinels' pod names; the producer reaches the Sentinels and
the master by their pod IPs, through a host route to the pod network via the node. The
faults on the bundled Redis (redis_delete, net_cut by its Service) are left out; instead
redis_primary_kill force-deletes the current primary's pod (--grace-period=0), only while
its replica reports master_link_status:up and the Sentinels know it, at most once a
minute; its window lasts until the Sentinels name the promoted replica and the recreated
pod is its synced replica (then Sentinels that still list the dead primary's address are
SENTINEL RESET, one at a time). The producer's offers are durable (replicas_to_confirm=1: WAIT counted the
replica before offer() returned; NotReplicated is offered again), so an accepted offer
survives the kill: any one missing fails the run. What asynchronous replication can still
lose by design are the workers' writes the dying primary acknowledged and its replica did
not have yet: a lease (the attempt is minted again under another token), a renewal or an
acknowledgement of a completion (the lease runs out on the promoted replica and the task
runs again). Those are the duplicates a kill's window explains (history "rollback_kinds",
as bench/chaos_failover.py records them); no stale acknowledgement may be accepted. The
operator's ticks are plain offers: one the dying primary confirmed alone may be lost, a
missed tick inside the kill's window. The report names the masters in turn.

Every run also samples the operator pods' container restartCount: a restart must fall in a
node fault's window (the kubelet or containerd restarted). The API server stopped or the
leader cut from it must not restart a replica: its liveness probe passes while Lease calls
fail or time out.
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
import redis.sentinel

import effectmq
from bench import _chaos_checks as checks
from bench import _chaos_sentinel as sentinel
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
MIN_REPLICAS = 1  # the worker Deployment never goes below it: a scale to zero with work in flight is a defect
WORKER_IMAGE = "localhost/effectmq-chaos-worker:1"
HANDLERS_FILE = Path(__file__).with_name("_chaos_handlers.py")
HANDLERS_MODULE = "emq_chaos_handlers"
STALL_CAP = 100  # expired leases a task may take: forced faults stall tasks many times
SETTLE_SECONDS = 300.0
# (kind, weight): how often each fault is drawn
FAULT_KINDS = (("pod_delete", 4), ("pod_force", 4), ("oom", 2), ("operator_delete", 2), ("redis_delete", 2),
               ("net_cut", 2), ("kubelet_restart", 2), ("containerd_restart", 1))
# Faults of the bundled Redis (its pod, its Service address): not in the Sentinel topology
BUNDLED_REDIS_KINDS = ("redis_delete", "net_cut")
SENTINEL_KINDS = tuple((k, w) for k, w in FAULT_KINDS if k not in BUNDLED_REDIS_KINDS) + (("redis_primary_kill", 3),)
# Faults of the control plane, held 20-60 s: the API server stopped, the leading operator
# replica cut from it (with a second replica, which must take over)
CONTROL_PLANE_KINDS = (("apiserver_stop", 1), ("leader_cut", 2))
ALL_KINDS = FAULT_KINDS + (("redis_primary_kill", 3),) + CONTROL_PLANE_KINDS
TOPOLOGIES = ("bundled", "sentinel")
PRIMARY_KILL_INTERVAL = 60.0  # seconds from one primary kill to the next, at least
# Faults whose primary may take writes it acknowledged with it (bench/_chaos_checks.py rollback_kinds)
ROLLBACK_KINDS = ("redis_primary_kill",)
CONFIRM_TIMEOUT = 2.0  # the producer's durable offers (Sentinel): WAIT for the replica this long


def kinds_for(redis_topology: str, control_plane: bool = False) -> tuple[tuple[str, int], ...]:
    """The fault kinds drawn by default for a topology (bundled or sentinel)."""
    kinds = SENTINEL_KINDS if redis_topology == "sentinel" else FAULT_KINDS
    return kinds + (CONTROL_PLANE_KINDS if control_plane else ())


def unfit_kinds(redis_topology: str, kinds: tuple[tuple[str, int], ...]) -> list[str]:
    """The kinds that act on a Redis the topology does not have."""
    absent = BUNDLED_REDIS_KINDS if redis_topology == "sentinel" else ("redis_primary_kill",)
    return sorted(k for k, _ in kinds if k in absent)
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
    topology: str = "bundled"  # where Redis is: the chart's, or "sentinel" (bench/_chaos_sentinel.py)
    faults: list[Fault] = field(default_factory=list)
    offers: dict[str, dict] = field(default_factory=dict)
    replicas: list[list] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    leases: list[list] = field(default_factory=list)  # [t, holderIdentity, renewTime] sampled each second
    operator_logs: dict[str, str] = field(default_factory=dict)  # pod (and container run) -> its log
    operator_restarts: list[dict] = field(default_factory=list)  # a container's restartCount seen going up
    masters: list[list] = field(default_factory=list)  # [t, IP, pod] each time the Sentinels name another master
    skipped: list[str] = field(default_factory=list)  # faults drawn but not injected, and why

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
        self.skip_reasons: dict[str, str] = {}  # why inject() returned None, by kind
        self.sent: set[str] = set()  # ids offered, confirmed or not (a refused durable offer is stored all the same)
        self.restarts_seen: dict[str, int] = {}  # "<pod>/<container>" -> restartCount last sampled
        self.restarts_sampled = time.time()
        self.last_primary_kill: float | None = None
        self.counters = {"offer retries": 0, "NotReplicated (offered again)": 0}
        self.durable = self.topology == "sentinel"
        unfit = unfit_kinds(self.topology, self.kinds)
        if self.topology not in TOPOLOGIES or unfit:
            raise ValueError(f"topology {self.topology!r} (one of {TOPOLOGIES}) has no place for the faults {unfit}")

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
        redis_spec = ({"url": sentinel.cluster_url(NS)} if self.topology == "sentinel" else
                      {"urlFrom": {"secretKeyRef": {"name": f"{RELEASE}-redis", "key": "url"}}})
        queue = {"apiVersion": "effectmq.io/v1alpha1", "kind": "Queue", "metadata": {"name": QUEUE, "namespace": NS},
                 "spec": {
                     "redis": redis_spec,
                     "lockTimeoutSeconds": LOCK_SECONDS, "lockRefreshSeconds": 2, "maxStalledCount": STALL_CAP,
                     "worker": {"image": WORKER_IMAGE, "imagePullPolicy": "Never",
                                "handlers": f"{HANDLERS_MODULE}:app", "concurrency": 2,
                                "terminationGracePeriodSeconds": 8, "env": env,
                                "resources": {"requests": {"cpu": "20m", "memory": "64Mi"},
                                              "limits": {"memory": "200Mi"}}},
                     "scaling": {"minReplicas": MIN_REPLICAS, "maxReplicas": MAX_REPLICAS, "targetTasksPerReplica": 10,
                                 "pollIntervalSeconds": 2, "scaleDownStabilizationSeconds": 10,
                                 "cooldownSeconds": 5}}}
        schedule = {"apiVersion": "effectmq.io/v1alpha1", "kind": "Schedule",
                    "metadata": {"name": SCHEDULE, "namespace": NS},
                    "spec": {"queueRef": {"name": QUEUE}, "schedule": f"*/{TICK_SECONDS} * * * * *",
                             "task": {"name": "tick"}, "missedTicks": "Skip"}}
        return [queue, schedule]

    def setup(self) -> None:
        store_url = self.start_side_store()
        install(self.cluster, self.work_dir, self.operator_replicas, bundled_redis=self.topology == "bundled")
        c = self.cluster
        deployment = self.get("deployment", RELEASE)
        if deployment["spec"].get("replicas") != self.operator_replicas:  # a shared install
            c.kubectl("scale", "deployment", RELEASE, "-n", NS, f"--replicas={self.operator_replicas}")
        c.kubectl("rollout", "status", "deployment", RELEASE, "-n", NS, "--timeout=180s", timeout=190)
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        self.lease_name = next(e["value"] for e in env if e["name"] == "EFFECTMQ_OPERATOR_LEASE")
        self.operator_selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
        if self.topology == "sentinel":
            self.start_sentinel_topology()
        c.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                         "items": self.manifests(store_url)}))
        c.kubectl("wait", "-n", NS, "--for=condition=Ready", f"queue/{QUEUE}", "--timeout=180s", timeout=190)
        if self.topology == "bundled":
            self.redis_url, self.redis_ip = redis_on_host(c)
        self.keys = QueueKeys("emq", f"{NS}/{QUEUE}")
        durable = {"replicas_to_confirm": 1, "confirm_timeout": CONFIRM_TIMEOUT} if self.durable else {}
        self.queue = effectmq.SyncTaskQueue(f"{NS}/{QUEUE}", url=self.redis_url, socket_timeout=5, **durable)
        self.wait("worker pods", lambda: [p for p in self.pods(f"app.kubernetes.io/instance={QUEUE}")
                                          if self.ready(p)], 180)
        self.sample_operator_restarts(baseline=True)

    # ---- the Sentinel topology (bench/_chaos_sentinel.py)

    def start_sentinel_topology(self) -> None:
        c = self.cluster
        c.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                   "items": sentinel.manifests()}))
        self.pod_route_added = sentinel.route_pods(c.network.pod_cidr, c.network.node_ip)
        state = self.wait("a primary, its synced replica and three Sentinels that know them",
                          lambda: self.sentinel_topology()[0], 240)
        self.sentinel_ips = self.pod_ips(sentinel.SENTINELS)
        self.redis_url = sentinel.host_url(list(self.sentinel_ips.values()))
        self.masters.append([time.time(), state["master_ip"], state["master"]])
        log(f"Sentinel topology up: {state['master']} primary, {state['replica']} its replica")

    def pod_ips(self, name: str) -> dict[str, str]:
        """Pod name -> IP of a StatefulSet's pods that have an IP and are not being deleted."""
        return {p["metadata"]["name"]: p["status"]["podIP"] for p in self.pods(f"app.kubernetes.io/name={name}")
                if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")}

    def sentinel_topology(self) -> tuple[dict | None, str]:
        """({master, master_ip, replica, replica_ip}, "") when the Sentinels agree on a master that
        answers as one, the other data pod is its replica with its link up, and each Sentinel
        knows it and its two peers, ready to fail over; else (None, why not)."""
        sentinel_ips = list(self.pod_ips(sentinel.SENTINELS).values())
        data = self.pod_ips(sentinel.DATA)
        if len(sentinel_ips) < sentinel.SENTINEL_PODS or len(data) < sentinel.DATA_PODS:
            return None, f"pods with an IP: {sorted(data)} and {len(sentinel_ips)} Sentinels"
        master_ip = sentinel.agreed_master(sentinel_ips)
        by_ip = {ip: name for name, ip in data.items()}
        if master_ip not in by_ip:
            return None, f"the Sentinels name {[sentinel.named_master(ip) for ip in sentinel_ips]}, pods {data}"
        if sentinel.replication(master_ip).get("role") != "master":
            return None, f"{by_ip[master_ip]} ({master_ip}) does not answer as a master"
        (replica_ip,) = [ip for ip in by_ip if ip != master_ip]
        link = sentinel.replication(replica_ip)
        if not sentinel.in_sync_replica(replica_ip, master_ip):
            return None, (f"{by_ip[replica_ip]} is no synced replica: role {link.get('role')}, master "
                          f"{link.get('master_host')}, link {link.get('master_link_status')}")
        why = sentinel.sentinels_settled(sentinel_ips, master_ip, replica_ip)
        if why:
            return None, why
        return {"master": by_ip[master_ip], "master_ip": master_ip, "replica": by_ip[replica_ip],
                "replica_ip": replica_ip}, ""

    def kill_primary(self) -> Fault | None:
        """The primary's pod force-deleted while its replica is in sync and the Sentinels know
        it; the window ends once the Sentinels name the promoted replica and the recreated pod
        is its synced replica. Then the Sentinels that list the dead primary's address are
        SENTINEL RESET (the next kill waits for that: one fault of a kind at a time)."""
        kind = "redis_primary_kill"
        if self.last_primary_kill is not None and time.time() - self.last_primary_kill < PRIMARY_KILL_INTERVAL:
            self.skip_reasons[kind] = f"the last kill was {time.time() - self.last_primary_kill:.0f}s ago"
            return None
        state, why = self.sentinel_topology()
        if state is None:
            self.skip_reasons[kind] = f"not ready to fail over: {why}"
            return None
        old, old_ip = state["master"], state["master_ip"]
        uid = self.get("pod", old)["metadata"]["uid"]
        self.last_primary_kill = time.time()
        fault = self.begin(Fault(kind, "*", time.time(), note=f"{old} ({old_ip})"))
        self.kubectl("delete", "pod", old, "-n", NS, "--force", "--grace-period=0", "--wait=false", check=False)
        sentinel_ips = list(self.sentinel_ips.values())

        def promoted() -> str | None:
            ip = sentinel.agreed_master(sentinel_ips)
            return ip if ip and ip != old_ip and sentinel.replication(ip).get("role") == "master" else None
        new_ip = self.wait("the Sentinels naming a new master that answers", promoted, 120, 0.5)
        fault.note += f"; {state['replica'] if new_ip == state['replica_ip'] else new_ip} promoted after " \
                      f"{time.time() - fault.start:.1f}s"

        def rejoined() -> str | None:
            pod = self.get("pod", old)
            ip = pod["status"].get("podIP")
            return ip if pod["metadata"]["uid"] != uid and ip and sentinel.in_sync_replica(ip, new_ip) else None
        try:
            back_ip = self.wait(f"{old} recreated as a synced replica of {new_ip}", rejoined, 180, 0.5)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; its log: {sentinel.pod_log_tail(self.kubectl, NS, old, 5)}") from None
        fault.end = time.time()
        fault.note += f"; {old} back at {back_ip} as its replica after {fault.end - fault.start:.1f}s"
        # the dead primary's address, still listed as a replica: dropped (no client sees it)
        unsettled = sentinel.reset_sentinels(sentinel_ips, new_ip, back_ip)
        if unsettled:
            self.errors.append(f"{kind}: Sentinels not settled after SENTINEL RESET: {unsettled}")
        fault.note += f"; Sentinels reset {time.time() - fault.end:.0f}s"
        return fault

    def sample_master(self) -> None:
        ip = sentinel.agreed_master(list(self.sentinel_ips.values()))
        if ip and (not self.masters or self.masters[-1][1] != ip):
            pods = {v: k for k, v in self.pod_ips(sentinel.DATA).items()}
            self.masters.append([time.time(), ip, pods.get(ip)])

    def sample_operator_restarts(self, baseline: bool = False) -> None:
        """Each operator container whose restartCount went up since the last sample: when its
        last run ended (lastState), and the interval the restart lies in."""
        now = time.time()
        for pod in self.pods(self.operator_selector):
            name = pod["metadata"]["name"]
            for status in pod["status"].get("containerStatuses") or []:
                key = f"{name}/{status['name']}"
                count = status.get("restartCount", 0)
                if count > self.restarts_seen.get(key, 0) and not baseline:
                    ended = (status.get("lastState") or {}).get("terminated") or {}
                    self.operator_restarts.append({
                        "pod": name, "container": status["name"], "restarts": count, "since": self.restarts_sampled,
                        "seen": now, "died": ended.get("finishedAt"), "reason": ended.get("reason"),
                        "exit_code": ended.get("exitCode")})
                    previous = self.kubectl("logs", name, "-n", NS, "-c", status["name"], "--previous", "--tail=15",
                                            check=False, timeout=30).stdout.strip()
                    self.operator_restarts[-1]["log_tail"] = previous.splitlines()
                    log(f"operator container {key} restarted ({ended.get('reason')}, exit {ended.get('exitCode')}, "
                        f"ended {ended.get('finishedAt')}); its last lines:\n{previous}")
                self.restarts_seen[key] = count
        self.restarts_sampled = now

    # ---- the producer and the sampler

    def offer(self, task_id: str, payload: dict, kind: str, deadline: float) -> None:
        """Offered until Redis confirms it (and, durable, WAIT counted the replica): the same id
        again after an error or NotReplicated."""
        with self.lock:
            self.sent.add(task_id)
        while time.monotonic() < deadline:
            try:
                self.queue.offer("work", payload, task_id=task_id, max_stalled_count=STALL_CAP)
            except effectmq.NotReplicated:  # stored on the primary, not yet on a replica: not accepted
                self.count("NotReplicated (offered again)")
                time.sleep(0.2)
                continue
            except (effectmq.EffectMQError, redis.RedisError, OSError, TimeoutError):  # Redis is down or cut
                self.count("offer retries")
                time.sleep(0.5)
                continue
            with self.lock:
                offer = self.offers.setdefault(task_id, {"kind": kind, "durable": self.durable, "confirmed": []})
                offer["confirmed"].append(round(time.time(), 4))
            return
        self.errors.append(f"{task_id}: never confirmed")

    def count(self, counter: str) -> None:
        with self.lock:
            self.counters[counter] += 1

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
            try:
                self.sample_operator_restarts()
                if self.topology == "sentinel":
                    self.sample_master()
            except Exception:
                pass
            self.stop.wait(2)
        for fault in scaling_in.values():
            fault.end = time.time()

    def lease_spec(self) -> dict:
        return self.get("lease", self.lease_name).get("spec") or {}

    def lease_holder(self) -> str | None:
        return self.lease_spec().get("holderIdentity")

    def renewing_holder(self) -> str | None:
        """The Lease's holder while it renews it (its renewTime younger than the lease's
        duration); None for a record nobody renews (its holder stood down or is gone)."""
        spec = self.lease_spec()
        renewed = _log_instant(spec.get("renewTime") or "")
        if renewed is None or time.time() - renewed > spec.get("leaseDurationSeconds", 15):
            return None
        return spec.get("holderIdentity")

    def watch_lease(self) -> None:
        """The Lease's holder and renewTime each second (a missed sample while the API server is down)."""
        while not self.stop.is_set():
            try:
                spec = self.lease_spec()
                self.leases.append([time.time(), spec.get("holderIdentity"), spec.get("renewTime")])
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
        if kind == "redis_primary_kill":
            return self.kill_primary()
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
        try:  # right after the API server's restart the record may be one its holder no longer renews
            self.wait("a holder renewing the Lease", self.renewing_holder, 60, 0.5)
        except TimeoutError:
            self.skip_reasons["leader_cut"] = "no holder renewed the Lease for 60 s"
            return None
        pod = self.leader_pod()
        if pod is None or len([p for p in self.operator_pods() if self.ready(p)]) < 2:
            self.skip_reasons["leader_cut"] = "no leader pod, or no second Ready replica to take over"
            return None
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
                why = self.skip_reasons.pop(kind, "nothing to fault")
                self.skipped.append(f"{kind} at +{time.time() - self.t0:.0f}s: {why}")
                log(f"fault {kind} skipped: {why}")
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

    def redis_client(self) -> redis.Redis:
        """A client of the primary (the one the Sentinels name, followed across a failover)."""
        if self.topology == "sentinel":
            sentinels = redis.sentinel.Sentinel([(ip, sentinel.SENTINEL_PORT) for ip in self.sentinel_ips.values()],
                                                socket_timeout=10)
            return sentinels.master_for(sentinel.SERVICE, decode_responses=True, socket_timeout=10)
        return redis.Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=10)

    def settle(self) -> None:
        ids = sorted(self.offers)
        deadline = time.monotonic() + SETTLE_SECONDS
        client = self.redis_client()
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
        try:  # a restart the settling saw too
            self.sample_operator_restarts()
        except Exception as exc:
            self.errors.append(f"operator restarts not sampled after the faults: {exc}")
        if self.control_plane:
            self.save_all_operator_logs()
        events = [{"instance": e.get("reportingInstance"), "reason": e.get("reason"), "count": e.get("count"),
                   "first": e.get("firstTimestamp"), "last": e.get("lastTimestamp"),
                   "object": f"{e['involvedObject'].get('kind')}/{e['involvedObject'].get('name')}"}
                  for e in self.get("events")["items"] if e.get("reportingComponent") == "effectmq-operator"
                  ] if self.control_plane else []
        client = self.redis_client()
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
        known = self.sent | set(ticks)
        self.counters["offers never confirmed (not judged)"] = len(self.sent - set(self.offers))
        history = {
            "seed": self.seed, "seconds": self.seconds, "t0": self.t0, "plant": self.plant,
            "lock_seconds": LOCK_SECONDS, "tick_seconds": TICK_SECONDS, "max_replicas": MAX_REPLICAS,
            "min_replicas": MIN_REPLICAS,
            "tick_prefix": f"{NS}/{SCHEDULE}/",
            "offers": self.offers, "tasks": tasks,
            "unknown_in_indexes": sorted(set().union(*indexes.values()) - known),
            "runs": [json.loads(line) for line in self.store.lrange("runs", 0, -1)],
            "faults": [vars(f) for f in self.faults], "replicas": self.replicas,
            "leases": self.leases, "operator_events": events,
            "leadership": leadership(self.operator_logs),
            "operator_restarts": self.operator_restarts,
            "redis": self.topology, "masters": self.masters, "counters": self.counters, "skipped": self.skipped,
            **({"rollback_kinds": list(ROLLBACK_KINDS)} if self.topology == "sentinel" else {}),
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
        if getattr(self, "pod_route_added", False):
            sentinel.forget_pod_route(self.cluster.network.pod_cidr)
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


def install(cluster: OneNodeCluster, work_dir: Path, operator_replicas: int = 1, bundled_redis: bool = True) -> None:
    """The chaos worker image (the example image and bench/_chaos_handlers.py) and the chart
    with its bundled Redis (unless bundled_redis is False) in namespace NS, unless they are
    there: the tests of tests/cluster/test_chaos.py share one install with the run."""
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
                 "--set", f"redis.enabled={str(bundled_redis).lower()}", "--set", f"replicaCount={operator_replicas}",
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
    lines = [f"chaos run, seed {history['seed']}, {history['seconds']:.0f}s of faults, "
             f"{'Redis Sentinel in pods' if history.get('redis') == 'sentinel' else 'the bundled Redis'}"
             + (f", planted defect {history['plant']}" if history.get("plant") else ""),
             *(f"  {k}: {v}" for k, v in summary.items() if k != "checks"),
             *(f"  {k}: {v}" for k, v in (history.get("counters") or {}).items()), "checks (problems found):"]
    for name, found in problems.items():
        lines.append(f"  {'FAIL' if found else 'ok  '} {name}: {len(found)}")
        lines += [f"       {p}" for p in found[:10]]
    if history.get("skipped"):
        lines.append("faults skipped: " + "; ".join(history["skipped"][:10]))
    if history.get("harness_errors"):  # first lines only (a failed kubectl call's has its command)
        lines.append("harness errors: " + "; ".join(e.splitlines()[0] for e in history["harness_errors"][:10]))
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return {"summary": summary, "problems": problems}


def run_chaos(cluster: OneNodeCluster, seed: int, seconds: float, out: Path, plant: str | None = None,
              kinds: tuple[tuple[str, int], ...] | None = None, redis: str = "bundled") -> dict:
    """One run on a cluster that is up (the chart is installed into namespace chaos and removed
    after); redis="sentinel" runs it on Redis Sentinel in pods. `kinds` defaults to the
    topology's faults without the control plane's (kinds_for)."""
    run = Run(cluster, seed, seconds, out / "work", plant, kinds or kinds_for(redis), redis)
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
    parser.add_argument("--redis", choices=TOPOLOGIES, default="bundled",
                        help="the chart's bundled Redis, or Redis Sentinel in pods (a primary, a replica, "
                             "three Sentinels)")
    parser.add_argument("--faults", default=None,
                        help="the fault kinds drawn, comma-separated (default: every kind the topology has: "
                             f"bundled {','.join(k for k, _ in kinds_for('bundled', True))}; "
                             f"sentinel {','.join(k for k, _ in kinds_for('sentinel', True))})")
    args = parser.parse_args(argv)
    weights = dict(ALL_KINDS)
    names = args.faults.split(",") if args.faults else [k for k, _ in kinds_for(args.redis, True)]
    unknown = sorted(set(names) - set(weights))
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; known: {', '.join(weights)}")
    kinds = tuple((k, weights[k]) for k in names)
    if unfit_kinds(args.redis, kinds):
        parser.error(f"--redis {args.redis} has no place for the faults {unfit_kinds(args.redis, kinds)}")
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
            result = run_chaos(cluster, args.seed, args.minutes * 60, out, args.plant, kinds, args.redis)
        finally:
            cluster.stop()
            shutil.rmtree(work, ignore_errors=True)
    return 0 if result["summary"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
