"""Seeded chaos with Redis failing over underneath: worker processes and a producer keep a
queue busy while the primary (Sentinel) or the queue's master (Redis Cluster) is killed,
paused or moved; then the checks of bench/_chaos_checks.py run on the recorded history.

    python bench/chaos_failover.py --topology sentinel --minutes 5 --seed 7 [--durable] [--report FILE]
    python bench/chaos_failover.py --topology cluster --minutes 5 --seed 7 [--durable] [--plant phantom-offer]

Topologies (local processes on loopback, the test fixtures'): sentinel is a primary, a
replica and three Sentinels (tests/fixtures/sentinel.py); cluster is 3 masters + 3
replicas (tests/fixtures/redis_cluster.py), the queue named so that its slot is 0.
WORKERS `effectmq worker` subprocesses run bench/_chaos_handlers.py, which records every
attempt in a side store (its own redis-server, which no fault touches).

Faults, one at a time, drawn from the seed (their kinds, order, gaps and holds; not their
timing, which the loaded machine decides), each once the topology is healthy again
(one primary per slot, every replica in sync):
  sentinel: primary_kill (SIGKILL of the current primary; a Sentinel promotes the replica;
            after the hold the old primary restarts on its AOF and rejoins as a replica:
            rejoin_as_replica), primary_pause (SIGSTOP for the hold, then SIGCONT: past
            down-after-milliseconds the replica is promoted while the old primary still
            believes it is one, a partition seen from the old side).
  cluster:  master_kill (SIGKILL of the queue's master; its replica takes over; it
            restarts after the hold and rejoins: rejoin_as_replica), reshard (the queue's
            slot moved to another master with `redis-cli --cluster reshard`, back and forth),
            replica_kill (SIGKILL of the queue's master's replica, restarted after the hold).

The producer offers with explicit ids, re-offers an id after any error until a reply
confirms it, and now and then re-offers a confirmed id. Plain offers (the default) are
confirmed by the primary's reply alone: replication is asynchronous, so one the primary
confirmed just before it died may be missing on the promoted replica. The report counts
those apart ("lost by asynchronous replication (by design)"): missing offers each of whose
confirmations fell within a primary-losing fault's window. --durable offers durably
(TaskQueue(replicas_to_confirm=1, confirm_timeout=2.0)): offer() returns only once WAIT, on
the connection that carried the offer, counted a replica holding it, and raises
NotReplicated otherwise; the producer then offers the same id again. Durable offers are
exempt from nothing: any one missing fails the run.

--plant phantom-offer: the producer also records, without sending them, offers it claims
Redis accepted (every 25th id), so "accepted tasks lost" must fail; --plant drop-done: the
handlers' store loses the end of every third task's attempts (bench/_chaos_handlers.py), so
"stale acknowledgements accepted" must fail. Exit 1 when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from itertools import islice
from typing import Any, Callable, Iterator

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

import effectmq
from bench import _chaos_checks as checks
from bench._chaos_checks import Fault
from bench._chaos_handlers import token_hash
from effectmq.client.models import parse_task
from effectmq.protocol.keys import INDEXES, QueueKeys
from tests.fixtures.redis_cluster import ClusterNode, RedisClusterDeployment, start_redis_cluster
from tests.fixtures.sentinel import Node, SentinelDeployment, start_sentinel_deployment

REPO = Path(__file__).resolve().parents[1]
PREFIX = "emq"
QUEUE = "reshard/2739"  # {emq:reshard/2739} hashes to slot 0, the lowest of its master: redis-cli moves it
SLOT = 0
LOCK_SECONDS = 6.0
STALL_CAP = 100  # expired leases a task may take: every failover stalls the attempts it cut
WORKERS = 3
CONCURRENCY = 4
SETTLE_SECONDS = 180.0
HEALTHY_TIMEOUT = 90.0
STABLE = 3.0  # seconds healthy in a row: longer than a Sentinel takes from down-after to starting a failover
FAULT_KINDS = {  # (kind, weight)
    "sentinel": (("primary_kill", 1), ("primary_pause", 1)),
    "cluster": (("master_kill", 2), ("reshard", 3), ("replica_kill", 1)),
}
# Faults whose node may take writes it confirmed with it (dead, or demoted on waking up).
ROLLBACK_KINDS = ("primary_kill", "primary_pause", "master_kill")
# Checks of things a failover run has none of: a Schedule, a Deployment, an operator.
NOT_APPLICABLE = ("ticks missed beyond the policy", "ticks run twice as different tasks", "replicas above maxReplicas",
                  "replicas below minReplicas",
                  "two operator leaders at once", "operator Events not from the Lease's holder",
                  "leader cuts not taken over", "operator restarts not explained by a fault")
PLANTS = ("phantom-offer", "drop-done")


def log(message: str) -> None:
    print(f"[failover {time.strftime('%H:%M:%S')}] {message}", flush=True)


def wait_for(what: str, predicate: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (redis.RedisError, OSError, AssertionError):
            value = None
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def wait_stable(what: str, predicate: Callable[[], Any], timeout: float) -> None:
    """Until `predicate` holds for STABLE seconds in a row: a Sentinel failover may still be
    starting just after the primary woke up."""
    deadline = time.monotonic() + timeout
    while True:
        wait_for(what, predicate, max(1.0, deadline - time.monotonic()))
        held = time.monotonic() + STABLE
        try:
            while time.monotonic() < held and predicate():
                time.sleep(0.2)
        except (redis.RedisError, OSError, AssertionError):
            continue
        if time.monotonic() >= held:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what} to hold {STABLE:g}s")


# ---- topologies: where the queue's slot lives, health, and the faults


class SentinelTopology:
    name = "sentinel"

    def __init__(self, work: Path):
        self.d: SentinelDeployment = start_sentinel_deployment(work)
        self.url = self.d.url()

    def data_nodes(self) -> list[Node]:
        return [self.d.primary, self.d.replica]

    def master(self) -> Node:
        port = self.d.master_port()
        assert port is not None, "the Sentinels do not agree on a primary"
        return next(n for n in self.data_nodes() if n.port == port)

    def master_client(self) -> redis.Redis:
        return self.master().client(socket_timeout=3)

    def healthy(self) -> bool:
        master = self.master()
        (other,) = [n for n in self.data_nodes() if n is not master]
        if not (master.alive() and other.alive()):
            return False
        if master.client().info("replication").get("role") != "master":
            return False
        info = other.client().info("replication")
        if info.get("role") != "slave" or info.get("master_port") != master.port or \
                info.get("master_link_status") != "up":
            return False
        for sentinel in self.d.sentinels:  # no failover under way; each knows the replica up
            if sentinel.client().sentinel_master(self.d.service)["flags"] != "master":
                return False
            replicas = sentinel.client().sentinel_slaves(self.d.service)
            if not any(int(r["port"]) == other.port and not r.get("is_sdown") and not r.get("is_disconnected")
                       for r in replicas):
                return False
        return True

    def inject(self, kind: str, hold: float, begin: Callable[[Fault], Fault]) -> list[Fault]:
        master = self.master()
        (other,) = [n for n in self.data_nodes() if n is not master]
        if kind == "primary_kill":
            fault = begin(Fault(kind, "*", time.time(), note=f"{master.name}:{master.port}"))
            master.stop("kill")
            waited = self.d.wait_for_master(other.port, 60)
            fault.end = time.time()
            fault.note += f", promoted {other.name} in {waited:.1f}s"
            time.sleep(hold)
            rejoin = begin(Fault("rejoin_as_replica", "*", time.time(), note=master.name))
            master.start(self.d.binary)
            wait_for(f"{master.name} a replica in sync", self.healthy, HEALTHY_TIMEOUT)
            rejoin.end = time.time()
            return [fault, rejoin]
        if kind == "primary_pause":
            assert master.proc is not None
            fault = begin(Fault(kind, "*", time.time(), note=f"{master.name} {hold:.1f}s"))
            os.kill(master.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(hold)
            finally:
                os.kill(master.proc.pid, signal.SIGCONT)
            wait_stable("one primary and its replica in sync", self.healthy, HEALTHY_TIMEOUT)
            fault.end = time.time()  # the woken primary confirmed writes until it was made a replica
            promoted = self.master() is not master
            fault.note += ", replica promoted, old primary demoted" if promoted else ", no failover"
            return [fault]
        raise ValueError(kind)

    def stop(self) -> None:
        self.d.stop()


class ClusterTopology:
    name = "cluster"

    def __init__(self, work: Path):
        self.d: RedisClusterDeployment = start_redis_cluster(work)
        self.url = self.d.url()
        self.rng = random.Random()  # reseeded by the run: the reshard's target

    def master(self) -> ClusterNode:
        return self.d.master_of_slot(SLOT)

    def master_client(self) -> redis.Redis:
        return self.master().client(socket_timeout=3)

    def healthy(self) -> bool:
        if not all(n.alive() for n in self.d.nodes):
            return False
        for node in self.d.nodes:  # a restarted node answers only once it has loaded and rejoined
            info = node.client().info("replication")
            if info["role"] != "master" and info.get("master_link_status") != "up":
                return False
        return self.d._not_ok() is None and bool(self.master())

    def replica_of(self, master: ClusterNode) -> ClusterNode:
        return next(n for n in self.d.live() if n is not master
                    and n.client().info("replication").get("master_port") == master.port)

    def inject(self, kind: str, hold: float, begin: Callable[[Fault], Fault]) -> list[Fault]:
        master = self.master()
        if kind == "master_kill":
            fault = begin(Fault(kind, "*", time.time(), note=master.name))
            replica = self.d.kill_master(master)
            waited = self.d.wait_for_failover(replica, 60)
            fault.end = time.time()
            fault.note += f", {replica.name} took over in {waited:.1f}s"
            time.sleep(hold)
            rejoin = begin(Fault("rejoin_as_replica", "*", time.time(), note=master.name))
            master.start(self.d.binary)
            wait_for(f"{master.name} back as a replica", self.healthy, HEALTHY_TIMEOUT)
            rejoin.end = time.time()
            return [fault, rejoin]
        if kind == "reshard":
            target = self.rng.choice(sorted((n for n in self.d.masters() if n is not master), key=lambda n: n.port))
            fault = begin(Fault(kind, "*", time.time(), note=f"{master.name} -> {target.name}"))
            moved = self.d.reshard(SLOT, target)
            fault.end = time.time()
            fault.note += f", {moved.keys} keys in {moved.seconds:.1f}s"
            return [fault]
        if kind == "replica_kill":
            replica = self.replica_of(master)
            fault = begin(Fault(kind, "*", time.time(), note=f"{replica.name}, replica of {master.name}"))
            replica.kill()
            time.sleep(hold)
            replica.start(self.d.binary)
            wait_for(f"{replica.name} back in sync", self.healthy, HEALTHY_TIMEOUT)
            fault.end = time.time()
            return [fault]
        raise ValueError(kind)

    def stop(self) -> None:
        self.d.stop()


# ---- the run


@dataclass
class Run:
    topology_name: str
    seed: int
    seconds: float
    work: Path
    durable: bool = False
    plant: str | None = None
    faults: list[Fault] = field(default_factory=list)
    offers: dict[str, dict] = field(default_factory=dict)
    sent: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=lambda: {"offer retries": 0, "re-offers of confirmed ids": 0,
                                                              "WAIT refusals (durable)": 0, "worker restarts": 0})

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}/faults")
        self.lock = threading.Lock()
        self.stop_faults = threading.Event()
        self.keys = QueueKeys(PREFIX, QUEUE)
        self.workers: dict[str, subprocess.Popen] = {}

    # -- setup and teardown

    def start(self) -> None:
        (self.work / "redis").mkdir(parents=True, exist_ok=True)
        self.topology = (SentinelTopology if self.topology_name == "sentinel" else ClusterTopology)(
            self.work / "redis")
        if isinstance(self.topology, ClusterTopology):
            self.topology.rng.seed(f"{self.seed}/reshard")
        from tests.fixtures.redis import free_port
        port = free_port()
        (self.work / "store").mkdir(exist_ok=True)
        self.store_proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--bind", "127.0.0.1", "--port", str(port),
             "--protected-mode", "no", "--save", "", "--appendonly", "no", "--dir", str(self.work / "store")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.store_url = f"redis://127.0.0.1:{port}/0"
        self.store = redis.Redis(port=port, decode_responses=True)
        wait_for("the side store", self.store.ping, 10)
        for i in range(WORKERS):
            self.spawn(f"w{i}")

    def spawn(self, name: str) -> None:
        env = {**os.environ, "EFFECTMQ_CHAOS_STORE": self.store_url, "EFFECTMQ_CHAOS_POD": name,
               "PYTHONFAULTHANDLER": "1"}
        if self.plant == "drop-done":
            env["EFFECTMQ_CHAOS_PLANT"] = "drop-done"
        out = open(self.work / f"worker-{name}.log", "ab")
        self.workers[name] = subprocess.Popen(
            [sys.executable, "-m", "effectmq", "worker", "bench._chaos_handlers:app", "--queue", QUEUE,
             "--url", self.topology.url, "--prefix", PREFIX, "--concurrency", str(CONCURRENCY),
             "--lock-timeout", str(LOCK_SECONDS), "--maintenance-interval", "1", "--drain-timeout", "5",
             "--log-level", "WARNING"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def watch_workers(self) -> None:
        """A worker that exits (none should) is recorded as a fault on it and restarted."""
        for name, proc in list(self.workers.items()):
            if proc.poll() is not None:
                now = time.time()
                self.faults.append(Fault("worker_exit", name, now - LOCK_SECONDS, now + LOCK_SECONDS,
                                         f"exit {proc.returncode}"))
                self.errors.append(f"worker {name} exited {proc.returncode} (see worker-{name}.log)")
                self.counters["worker restarts"] += 1
                self.spawn(name)

    def close(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.workers.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        topology = getattr(self, "topology", None)
        if topology is not None:
            topology.stop()
        proc = getattr(self, "store_proc", None)
        if proc is not None:
            proc.kill()
            proc.wait(5)

    # -- faults

    def schedule(self) -> Iterator[tuple[float, str, float]]:
        """(gap before it, kind, hold) of each fault, from the seed, every kind first once: the
        same sequence for a seed; how much of it a run gets through is the machine's timing."""
        weighted = FAULT_KINDS[self.topology_name]
        kinds = [k for k, w in weighted for _ in range(w)]
        first = [k for k, _ in weighted]
        self.rng.shuffle(first)
        n = 0
        while True:
            kind = first[n] if n < len(first) else self.rng.choice(kinds)
            n += 1
            gap = self.rng.uniform(2, 8)
            hold = self.rng.uniform(0.3, 4.0) if kind == "primary_pause" else self.rng.uniform(1, 5)
            yield round(gap, 2), kind, round(hold, 2)

    def begin(self, fault: Fault) -> Fault:
        """Recorded as it starts: a fault whose recovery failed still explains what it did."""
        with self.lock:
            self.faults.append(fault)
        return fault

    def inject_faults(self, plan: Iterator[tuple[float, str, float]]) -> None:
        deadline = self.t0 + self.seconds
        for gap, kind, hold in plan:
            if self.stop_faults.wait(gap) or time.time() > deadline:
                return
            try:
                wait_stable("a healthy topology", self.topology.healthy, HEALTHY_TIMEOUT)
                done = self.topology.inject(kind, hold, self.begin)
            except Exception as exc:  # recorded; the checks still run on what happened
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                log(f"fault {kind} failed: {exc}")
                for fault in self.faults:
                    fault.end = fault.end or time.time() + LOCK_SECONDS
                continue
            for fault in done:
                log(f"fault {fault.kind} {fault.note}: {fault.end - fault.start:.1f}s")  # type: ignore[operator]

    # -- the producer

    async def offer(self, queue: effectmq.TaskQueue, task_id: str, payload: dict, deadline: float) -> None:
        """Offered until Redis confirms it (and, --durable, a replica has it); a re-offer of
        the same id after any error."""
        self.sent.add(task_id)
        while time.monotonic() < deadline:
            try:
                await queue.offer("work", payload, task_id=task_id, max_stalled_count=STALL_CAP)
            except effectmq.NotReplicated:
                self.counters["WAIT refusals (durable)"] += 1
                await asyncio.sleep(0.2)
                continue
            except (effectmq.EffectMQError, redis.RedisError, OSError, asyncio.TimeoutError):
                self.counters["offer retries"] += 1
                await asyncio.sleep(0.2)
                continue
            confirmed = time.time()
            with self.lock:
                offer = self.offers.setdefault(task_id, {"kind": "work", "durable": self.durable, "confirmed": []})
                offer["confirmed"].append(round(confirmed, 4))
            return
        self.errors.append(f"{task_id}: never confirmed")

    async def produce(self, until: float) -> None:
        rng = random.Random(f"{self.seed}/tasks")
        durable = {"replicas_to_confirm": 1, "confirm_timeout": 2.0} if self.durable else {}
        queue = effectmq.TaskQueue(QUEUE, url=self.topology.url, prefix=PREFIX, socket_timeout=3, **durable)
        n = 0
        try:
            while time.time() < until:
                burst = rng.choice((1, 1, 1, 2, 3, 20 if rng.random() < 0.1 else 1))
                for _ in range(burst):
                    n += 1
                    task_id = f"w{n:06d}"
                    if self.plant == "phantom-offer" and n % 25 == 0:  # claimed, never sent
                        self.offers[task_id] = {"kind": "work", "durable": self.durable, "confirmed": [time.time()]}
                        continue
                    await self.offer(queue, task_id, {"sleep": round(rng.uniform(0.1, 1.5), 2)},
                                     time.monotonic() + 120)
                if n > 5 and rng.random() < 0.1:  # a re-offer of a confirmed id: must not run it again
                    again = f"w{rng.randint(1, n - 1):06d}"
                    if again in self.offers:
                        self.counters["re-offers of confirmed ids"] += 1
                        await self.offer(queue, again, {"sleep": 0.1}, time.monotonic() + 120)
                self.watch_workers()
                await asyncio.sleep(rng.uniform(0.05, 0.4))
        finally:
            await queue.close()

    # -- the run, then the history

    async def execute(self) -> dict:
        self.start()
        log(f"{self.topology_name}, seed {self.seed}, {'durable' if self.durable else 'plain'} offers, "
            f"{self.seconds:.0f}s; faults from the seed: "
            + ", ".join(f"{kind} (+{gap:g}s, hold {hold:g}s)" for gap, kind, hold in islice(self.schedule(), 8))
            + ", ...")
        self.rng = random.Random(f"{self.seed}/faults")  # the same sequence again, for the run
        plan = self.schedule()
        self.t0 = time.time()
        injector = threading.Thread(target=self.inject_faults, args=(plan,), daemon=True)
        injector.start()
        await self.produce(self.t0 + self.seconds)
        self.stop_faults.set()
        await asyncio.to_thread(injector.join, 300)
        for fault in self.faults:
            fault.end = fault.end or time.time()
        log(f"faults over: {len(self.faults)} windows, {len(self.offers)} offers accepted; settling")
        return await asyncio.to_thread(self.collect)

    def settle(self) -> None:
        try:
            wait_stable("a healthy topology", self.topology.healthy, HEALTHY_TIMEOUT)
        except TimeoutError as exc:
            self.errors.append(str(exc))
        ids = sorted(self.sent)
        deadline = time.monotonic() + SETTLE_SECONDS
        left = ids
        while time.monotonic() < deadline:
            self.watch_workers()
            try:
                with self.topology.master_client() as client:
                    pipe = client.pipeline(transaction=False)
                    for tid in ids:
                        pipe.hget(self.keys.task(tid), "state")
                    left = [t for t, s in zip(ids, pipe.execute()) if s not in (None, "completed", "failed",
                                                                                "canceled")]
            except (redis.RedisError, AssertionError, StopIteration):
                left = ids
            if not left:
                return
            time.sleep(1)
        log(f"{len(left)} tasks not terminal after {SETTLE_SECONDS:.0f}s")

    def served_after(self) -> dict:
        """A fresh task offered after the faults completes: the queue is served again."""
        started = time.monotonic()
        queue = effectmq.SyncTaskQueue(QUEUE, url=self.topology.url, prefix=PREFIX, socket_timeout=5)
        try:
            queue.offer("work", {"sleep": 0}, task_id="probe-after-faults")
            state = wait_for("the probe task", lambda: (lambda i: i is not None and i.state == "completed")(
                queue.get("probe-after-faults")), 60, 0.2)
        except TimeoutError:
            state = False
        finally:
            queue.close()
        return {"ready": bool(state), "waited": round(time.monotonic() - started, 1), "conditions": None}

    def collect(self) -> dict:
        self.settle()
        ready = self.served_after()
        with self.topology.master_client() as client:
            indexes = {name: set(client.zrange(self.keys.key(name), 0, -1)) for name in INDEXES}
            tasks = {}
            for tid in self.offers:
                h = client.hgetall(self.keys.task(tid))
                if not h:
                    continue
                info = parse_task(tid, h)
                tasks[tid] = {"state": info.state, "attempt": info.attempt, "result": info.result,
                              "last_token": token_hash(h["last_token"]) if h.get("last_token") else None,
                              "indexes": [name for name in INDEXES if tid in indexes[name]]}
        return {
            "topology": self.topology_name, "seed": self.seed, "seconds": self.seconds, "t0": self.t0,
            "durable": self.durable, "plant": self.plant,
            "lock_seconds": LOCK_SECONDS, "tick_seconds": 1, "max_replicas": WORKERS,
            "tick_prefix": "\0no ticks here/", "rollback_kinds": list(ROLLBACK_KINDS),
            "offers": self.offers, "tasks": tasks,
            "unknown_in_indexes": sorted(set().union(*indexes.values()) - self.sent - {"probe-after-faults"}),
            "runs": [json.loads(line) for line in self.store.lrange("runs", 0, -1)],
            "faults": [vars(f) for f in self.faults], "replicas": [],
            "ready_after": ready, "counters": self.counters, "harness_errors": self.errors,
        }


def report(history: dict) -> dict:
    """The checks on a history, as a JSON-able dict (the checks that need a Deployment or a
    Schedule are not applicable here and are left out)."""
    problems = checks.check(history)
    for name in NOT_APPLICABLE:
        problems.pop(name, None)
    summary = checks.summary(history, problems)
    summary["checks"] = {name: len(found) for name, found in problems.items()}
    summary["passed"] = not any(problems.values())
    summary["plain offers lost by asynchronous replication"] = checks.lost_by_replication(history)
    return {"topology": history["topology"], "seed": history["seed"], "seconds": history["seconds"],
            "durable": history["durable"], "plant": history["plant"], "summary": summary,
            "counters": history["counters"], "faults": history["faults"], "problems": problems,
            "harness_errors": history["harness_errors"]}


def table(result: dict) -> str:
    s = result["summary"]
    lines = [f"failover chaos: {result['topology']}, seed {result['seed']}, {result['seconds']:.0f}s, "
             f"{'durable (WAIT 1)' if result['durable'] else 'plain'} offers"
             + (f", planted defect {result['plant']}" if result["plant"] else ""),
             f"  {'offers accepted':<52} {s['offers']}", f"  {'handler runs':<52} {s['handler runs']}",
             f"  {'superseded attempts':<52} {s['superseded attempts']}"]
    lines += [f"    explained by {kind:<39} {n}" for kind, n in s["superseded attempts explained by"].items()]
    lines.append("  faults by kind")
    lines += [f"    {kind:<50} {n}" for kind, n in s["faults"].items()]
    lines += [f"  {name:<52} {n}" for name, n in result["counters"].items()]
    lost = s["plain offers lost by asynchronous replication"]
    lines.append(f"  {'offers lost by asynchronous replication (by design)':<52} {len(lost)}")
    lines += [f"    {line}" for line in lost[:10]]
    lines.append("  checks (problems found)")
    for name, found in result["problems"].items():
        lines.append(f"    {'FAIL' if found else 'ok  '} {name:<45} {len(found)}")
        lines += [f"         {p}" for p in found[:10]]
    if result["harness_errors"]:
        lines.append("  harness errors: " + "; ".join(result["harness_errors"][:10]))
    lines.append(f"  {'PASSED' if s['passed'] else 'FAILED'}")
    return "\n".join(lines)


def run_failover_chaos(topology: str, seed: int, seconds: float, work: Path, *, durable: bool = False,
                       plant: str | None = None) -> tuple[dict, dict]:
    """One run: (the report, the history)."""
    run = Run(topology, seed, seconds, work, durable, plant)
    try:
        history = asyncio.run(run.execute())
    finally:
        run.close()
    return report(history), history


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", choices=("sentinel", "cluster"), required=True)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--minutes", type=float, default=3)
    parser.add_argument("--durable", action="store_true",
                        help="durable offers: TaskQueue(replicas_to_confirm=1) (see above)")
    parser.add_argument("--report", type=Path, default=None, help="write the report (JSON) here")
    parser.add_argument("--plant", choices=PLANTS, default=None, help="a planted defect the checks must catch")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix=f"emq-failover-{args.topology}-{args.seed}-"))
    log(f"work dir {work}")
    result, history = run_failover_chaos(args.topology, args.seed, args.minutes * 60, work,
                                         durable=args.durable, plant=args.plant)
    (work / "history.json").write_text(json.dumps(history))
    if args.report:
        args.report.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result), flush=True)
    return 0 if result["summary"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
