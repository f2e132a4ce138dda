"""Seeded chaos: real worker processes, a real Redis with AOF and real faults, all at once.

For about 45 s a producer offers tasks with explicit ids (re-offering the same id
after RedisUnavailable until Redis confirms it) while a seeded schedule SIGKILLs,
SIGSTOPs (past the lease), SIGTERMs (drain) and restarts workers, SIGKILLs
redis-server and restarts it on its AOF, and resets or holds the connections of
workers and of the producer (TcpProxy). Then faults stop, every worker is healthy
again, and the run is checked against the delivery model (design/runtime.md):

1. No accepted task lost: every confirmed offer's task exists and is terminal,
   `completed`; or `failed` with ~effectmq/Error/Stalled, and only for the tasks
   offered with the queue's default stall cap (max_stalled_count 1) whose every
   attempt is explained by a fault (check 4's rule). The others are offered with
   a stall cap no fault schedule can reach (HIGH_STALL_CAP), so for them a Stalled
   failure is a defect (e.g. a task stranded and recovered over and over).
2. No stale acknowledgement accepted: a completed task's result (written by the
   handler from its TaskContext) names the attempt and lease token that produced
   it; they equal the record's `attempt` and the token that settled it
   (`last_token`), and that attempt's handler recorded `done` in that process.
3. Every task is in exactly one state index (the queue's zsets, read directly),
   the one its record names; no index holds an id nobody offered.
4. Every extra run is explained by a fault. The handler records start, done or
   cancel of each attempt (wall clock) in an effects file; the test records each
   fault's window. Every attempt of a task other than the one whose result was
   accepted must overlap a fault window that affected it: one of its own worker
   process (killed, stopped, drained, its connection cut or held), a Redis
   restart, or a stall of the machine the test saw (a direct PING slower than
   STALL, while SLOWLOG shows no command that long: the AOF's fsync on a busy
   disk). An attempt that never reached its handler (its acquire reply was lost)
   is dated by the `active` event of the queue's event stream and may be explained
   by any fault. No attempt number runs twice.
Also: the producer never saw created=False for an id it had not sent before
(idempotent offers), no serving worker process exited unless the schedule made it
(a new worker that finds Redis down at startup exits 1 and is restarted, as a pod
would be), drained workers exit 0, and after the chaos fresh long tasks (needing renewals) complete on
their first attempt on the surviving workers, each of which is announced live.

A rolling upgrade, by hand: EFFECTMQ_CHAOS_OLD_TREE=<folder holding another version's
effectmq/> (`git archive <rev> effectmq | tar -x -C <folder>`) runs the odd worker slots
on that version, so old and new workers share the queue through every fault.

The seed is random; EFFECTMQ_CHAOS_SEED=<seed> replays the same fault schedule and
task mix (process timing differs, so a replay is likely, not certain, to hit the
same interleaving). The seed is printed first and starts every assertion message.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import effectmq
from effectmq.protocol.keys import INDEXES, QueueKeys
from effectmq.client.models import parse_task
from tests.fixtures.proxy import TcpProxy, _drop
from tests.support.processes import WorkerProcess

pytestmark = pytest.mark.slow

QUEUE = "chaos"
LOCK = 1.0  # lease (seconds): short, so stalls are recovered within the run
MAINTENANCE = 0.2
WORKERS = 3
CONCURRENCY = 4
DRAIN = 1.0
WORKER_ARGS = ["--lock-timeout", str(LOCK), "--maintenance-interval", str(MAINTENANCE),
               "--concurrency", str(CONCURRENCY), "--drain-timeout", str(DRAIN)]
FAULT_PHASE = 45.0  # seconds of faults (and of offers)
# Tasks of three groups and without one, under a rate limit below the offers' pace (about
# 12 a second): fair turns and the log of starts go through every fault too, and no window
# of the limit's period holds more lease starts (lifecycle events, by Redis time) than it allows.
GROUPS = (None, "tenant-a", "tenant-b", "tenant-c")
RATE_LIMIT = (10, 1.0)
SETTLE_TIMEOUT = 150.0  # generous: a loaded 2-core machine
HIGH_STALL_CAP = 100
KINDS = ("kill", "stop", "term", "redis", "cut", "hold")
# An attempt overlaps a fault when the fault's window meets
# [start - BEFORE, end + LOCK + AFTER]: BEFORE covers a late acquire reply handled
# just after the fault ended; LOCK + AFTER covers an acknowledgement still being
# retried (within the lease) when the fault began.
BEFORE = 1.5
AFTER = 1.0
# A direct PING slower than this is a stall of the machine (the AOF's fsync on a busy
# disk, this process paused): it takes leases away as an injected fault does. A lease
# of LOCK is given up LOCK/10 before its deadline and renewed every LOCK/3, so a renewal
# has about 0.55 s to come back, less when the acquire reply itself came late; PINGs
# 0.1 s apart see a block at least 0.1 s shorter than it was.
STALL = 0.3


class ChaosProxy(TcpProxy):
    """TcpProxy whose restore() ends the partition for every connection: those opened
    during a cut are blackholed by TcpProxy and stay so after restore (each hangs
    until the client's 15 s socket timeout), which would stretch a fault far past
    its recorded window. Here they are reset when the fault ends. A proxy not cut is
    left alone: its connections are live (heal() restores every proxy)."""

    def restore(self) -> None:
        if not self.cut_off.is_set():
            return
        with self._lock:
            stale, self._conns, self._held = self._conns + self._held, [], []
        _drop(stale)
        self._silent.clear()
        self.cut_off.clear()


@dataclass
class Fault:
    kind: str
    target: str  # "w0".."w2", "producer", "redis"
    pid: int | None  # the worker process it hit (None: every process, or none)
    start: float
    end: float
    note: str = ""

    def hits(self, pid: int | None) -> bool:
        if self.target == "producer":
            return False
        return self.pid is None or pid is None or self.pid == pid

    def __str__(self) -> str:
        who = f"{self.target}" + (f"/pid {self.pid}" if self.pid else "")
        return f"{self.kind:<15} {who:<16} {self.start:.3f}..{self.end:.3f} ({self.end - self.start:.2f}s) {self.note}"


@dataclass
class Step:
    at: float  # seconds after the start of the fault phase
    kind: str
    target: str
    duration: float  # how long the fault lasts (stop, cut, hold, redis down) or restart delay


def chaos_seed() -> int:
    given = os.environ.get("EFFECTMQ_CHAOS_SEED")
    return int(given) if given else random.SystemRandom().randrange(1, 2**31)


def fault_schedule(rng: random.Random) -> list[Step]:
    """A seeded schedule over FAULT_PHASE seconds holding every kind at least once."""
    for _ in range(100):
        kinds = list(KINDS) + rng.choices(KINDS, weights=[2, 2, 1.5, 1.5, 2, 2], k=14)
        rng.shuffle(kinds)
        steps, t = [], rng.uniform(1.0, 2.0)
        for kind in kinds:
            target = f"w{rng.randrange(WORKERS)}"
            if kind == "stop":
                duration = LOCK + rng.uniform(1.0, 2.5)  # past the lease and its recovery
            elif kind == "redis":
                duration, target = rng.uniform(0.2, 1.5), "redis"
            elif kind in ("cut", "hold"):
                duration = rng.uniform(0.3, 2.5) if kind == "cut" else rng.uniform(0.5, 3.0)
                if rng.random() < 0.25:
                    target = "producer"
            else:  # kill, term: the delay before a new worker replaces it
                duration = rng.uniform(0.0, 1.0)
            if t + duration > FAULT_PHASE:
                break
            steps.append(Step(round(t, 3), kind, target, round(duration, 3)))
            t += duration + rng.uniform(0.5, 2.5)
        if {s.kind for s in steps} == set(KINDS):
            return steps
    raise AssertionError("could not draw a schedule holding every kind of fault")


class Slot:
    """One worker position: its proxy to Redis and the process currently behind it."""

    def __init__(self, index: int, redis_port: int, tmp: Path):
        self.index = index
        self.name = f"w{index}"
        self.proxy = ChaosProxy(redis_port)
        self.tmp = tmp
        self.generation = 0
        self.worker: WorkerProcess | None = None
        self.expect_exit = False

    def spawn(self) -> WorkerProcess:
        self.generation += 1
        env = {"EFFECTMQ_WORKER_NAME": self.worker_name, "EFFECTMQ_LOG_LEVEL": "INFO", "PYTHONFAULTHANDLER": "1"}
        old_tree = os.environ.get("EFFECTMQ_CHAOS_OLD_TREE")
        if old_tree and self.index % 2:  # its effectmq first; the handlers are this checkout's
            env["PYTHONPATH"] = os.pathsep.join([old_tree, str(Path(__file__).resolve().parents[2])])
            env["PYTHONSAFEPATH"] = "1"  # python -m would put the cwd (this checkout) first
        self.worker = WorkerProcess(
            self.proxy.url, QUEUE, self.tmp, args=WORKER_ARGS, name=f"chaos-{self.name}-g{self.generation}",
            handlers="tests.support.chaos_handlers:app", env=env)
        self.expect_exit = False
        return self.worker

    @property
    def worker_name(self) -> str:
        return f"chaos-{self.name}-g{self.generation}"

    @property
    def pid(self) -> int:
        return self.worker.proc.pid


class Chaos:
    def __init__(self, seed: int, server, tmp: Path):
        self.seed = seed
        self.server = server
        self.tmp = tmp
        self.t0 = time.time()
        self.slots = [Slot(i, server.port, tmp) for i in range(WORKERS)]
        self.producer_proxy = ChaosProxy(server.port)
        self.faults: list[Fault] = []
        self.slowest_ping = 0.0  # seconds, of the direct PINGs (watch_stalls)
        self.problems: dict[str, list[str]] = defaultdict(list)
        self.processes: dict[int, WorkerProcess] = {}  # every worker process ever started, by pid
        self.exited_at: dict[int, float] = {}
        self.killed: set[int] = set()
        self.confirmed: dict[str, dict] = {}  # task id -> what was offered and how it was confirmed
        self.stopped: set[int] = set()  # pids under SIGSTOP right now
        self.startup_failures = 0

    # -- bookkeeping ------------------------------------------------------------

    def problem(self, category: str, text: str) -> None:
        self.problems[category].append(text)

    def spawn(self, slot: Slot) -> None:
        worker = slot.spawn()
        self.processes[worker.proc.pid] = worker

    def header(self) -> str:
        return f"chaos seed {self.seed} (replay: EFFECTMQ_CHAOS_SEED={self.seed}; artifacts in {self.tmp})"

    # -- faults -----------------------------------------------------------------

    async def run_schedule(self, steps: list[Step], started: float) -> None:
        for step in steps:
            delay = started + step.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.inject(step)

    async def inject(self, step: Step) -> None:
        kind, target = step.kind, step.target
        if kind == "redis":
            t0 = time.time()
            await asyncio.to_thread(self.server.stop, "kill")
            await asyncio.sleep(step.duration)
            await asyncio.to_thread(self.server.start)
            self.faults.append(Fault("redis-kill", "redis", None, t0, time.time(), "restarted on its AOF"))
            return
        if target == "producer":
            proxy, pid = self.producer_proxy, None
        else:
            slot = self.slots[int(target[1:])]
            await self.ready(slot)  # a fault on a worker still starting up would hit nothing
            proxy, pid = slot.proxy, slot.pid
        if kind in ("cut", "hold"):
            t0 = time.time()
            proxy.cut(drop_existing=(kind == "cut"))
            await asyncio.sleep(step.duration)
            proxy.restore()
            self.faults.append(Fault("conn-reset" if kind == "cut" else "conn-held", target, pid, t0, time.time()))
        elif kind == "stop":
            t0 = time.time()
            slot.worker.signal(signal.SIGSTOP)
            self.stopped.add(pid)
            await asyncio.sleep(step.duration)
            slot.worker.signal(signal.SIGCONT)
            self.stopped.discard(pid)
            self.faults.append(Fault("sigstop", target, pid, t0, time.time(), "then SIGCONT"))
        elif kind == "kill":
            slot.expect_exit = True
            t0 = time.time()
            slot.worker.signal(signal.SIGKILL)
            await asyncio.to_thread(slot.worker.proc.wait)
            self.killed.add(pid)
            self.exited_at[pid] = t0
            self.faults.append(Fault("sigkill", target, pid, t0, t0, "replaced by a new worker"))
            await asyncio.sleep(step.duration)
            self.spawn(slot)
        elif kind == "term":
            slot.expect_exit = True
            t0 = time.time()
            slot.worker.signal(signal.SIGTERM)
            rc = await asyncio.to_thread(wait_exit, slot.worker.proc, 30)
            t1 = time.time()
            self.exited_at[pid] = t1
            self.faults.append(Fault("sigterm", target, pid, t0, t1, f"drained, exit {rc}"))
            if rc != 0:
                self.problem("worker exits", f"{slot.worker_name} (pid {pid}) drained after SIGTERM with exit "
                                             f"{rc} (None: hung, killed):\n{tail(self.processes[pid].log(), 60)}")
            await asyncio.sleep(step.duration)
            self.spawn(slot)

    async def ready(self, slot: Slot, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while "serving queue" not in slot.worker.log():
            if time.monotonic() > end:
                self.problem("worker exits", f"{slot.worker_name} (pid {slot.pid}) not serving after {timeout}s:\n"
                                             f"{tail(slot.worker.log(), 20)}")
                return
            await asyncio.sleep(0.05)

    async def watch_workers(self, until: asyncio.Event) -> None:
        """A worker that exits without being told to is a defect: record it, replace it.

        Except at startup: `effectmq worker` checks Redis before serving and exits 1
        when it is unreachable (a Redis restart under way), as a pod would, and is
        restarted, as Kubernetes would do."""
        while not until.is_set():
            for slot in self.slots:
                proc = slot.worker.proc
                if not slot.expect_exit and proc.poll() is not None:
                    now = time.time()
                    log = slot.worker.log()
                    self.exited_at[proc.pid] = now
                    if "serving queue" not in log and "Redis unavailable" in log:
                        self.startup_failures += 1
                        self.faults.append(Fault("startup-exit", slot.name, proc.pid, now - 0.25, now,
                                                 f"exit {proc.returncode}: Redis unreachable at startup"))
                    else:
                        self.faults.append(Fault("unexpected-exit", slot.name, proc.pid, now - 0.25, now,
                                                 f"exit {proc.returncode}"))
                        self.problem("worker exits", f"{slot.worker_name} (pid {proc.pid}) exited by itself "
                                                     f"with {proc.returncode}:\n{tail(log, 40)}")
                    self.spawn(slot)
            await asyncio.sleep(0.2)

    def watch_stalls(self, stop: threading.Event) -> None:
        """PING Redis directly ten times a second and record each stall as a fault; the
        end of the run checks that no command itself ran that long (SLOWLOG)."""
        # no retries inside redis-py: a PING that spans a restart fails, as the restart is a fault of its own
        client = redis.Redis(host="127.0.0.1", port=self.server.port, socket_timeout=30, retry=Retry(NoBackoff(), 0))
        while not stop.wait(0.1):
            t0 = time.time()
            try:
                client.ping()
            except Exception:  # Redis is down: a redis-kill fault covers it
                continue
            took = time.time() - t0
            self.slowest_ping = max(self.slowest_ping, took)
            if took > STALL:
                self.faults.append(Fault("stall", "redis", None, t0, t0 + took, f"PING answered after {took:.2f}s"))

    def heal(self) -> None:
        for pid in list(self.stopped):
            os.kill(pid, signal.SIGCONT)
        self.stopped.clear()
        for slot in self.slots:
            slot.proxy.restore()
        self.producer_proxy.restore()

    # -- the producer -----------------------------------------------------------

    async def produce(self, queue: effectmq.TaskQueue, rng: random.Random, until: asyncio.Event) -> None:
        n = 0
        while not until.is_set():
            tid = f"c{n:05d}"
            n += 1
            long = rng.random() < 0.2
            payload = {"sleep": round(rng.uniform(1.2, 2.5) if long else rng.uniform(0.02, 0.6), 3)}
            cap = None if rng.random() < 1 / 3 else HIGH_STALL_CAP
            group = rng.choice(GROUPS)
            unknown, first_sent = 0, time.time()
            while True:
                try:
                    offered = await queue.offer("chaos", payload, task_id=tid, max_stalled_count=cap, group=group)
                    break
                except effectmq.RedisUnavailable:
                    unknown += 1
                except Exception as exc:  # not the documented error of an unreachable Redis
                    unknown += 1
                    self.problem("producer", f"offer of {tid} raised {type(exc).__name__}: {exc}")
                if time.time() - first_sent > 90:
                    self.problem("producer", f"offer of {tid} not confirmed within 90s; giving it up")
                    offered = None
                    break
                await asyncio.sleep(0.05)
            if offered is None:
                continue
            if not offered.created and unknown == 0:
                self.problem("producer", f"first offer of {tid} answered created=False")
            self.confirmed[tid] = {"payload": payload, "cap": cap, "created": offered.created,
                                   "unknown_outcomes": unknown, "confirmed_at": time.time()}
            await asyncio.sleep(rng.uniform(0.02, 0.12))

    # -- reporting --------------------------------------------------------------

    def timeline(self) -> str:
        return "\n".join(f"  +{f.start - self.t0:7.3f}s {f}" for f in sorted(self.faults, key=lambda f: f.start))

    def log_lines_naming(self, tid: str) -> list[str]:
        """What any worker process logged about a task (an attempt that never reached its
        handler left no other trace in the workers)."""
        return [f"pid {pid}: {line}" for pid, worker in self.processes.items() if worker.log_path.exists()
                for line in worker.log().splitlines() if tid in line]

    def failure_message(self, pids: set[int]) -> str:
        parts = [self.header()]
        for category, items in self.problems.items():
            parts.append(f"-- {category}: {len(items)} problem(s)")
            parts.extend(f"   {item}" for item in items[:12])
            if len(items) > 12:
                parts.append(f"   ... and {len(items) - 12} more")
        parts.append("-- fault timeline (wall clock; +offset from the start):\n" + self.timeline())
        for pid in sorted(pids)[:4]:
            worker = self.processes.get(pid)
            if worker:
                parts.append(f"-- log of pid {pid} ({worker.log_path.name}), warnings and errors:\n"
                             + tail(notable(worker.log()), 40))
        return "\n".join(parts)


def wait_exit(proc, timeout: float) -> int | None:
    """The exit code, or None when the process hung: then SIGABRT makes faulthandler
    (PYTHONFAULTHANDLER=1) write every thread's stack into its log, and SIGKILL ends it."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None


def tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def notable(log: str) -> str:
    keep = ("WARNING", "ERROR", "CRITICAL", "Traceback", "Error", "  File ", "stopped", "draining")
    return "\n".join(line for line in log.splitlines() if any(k in line for k in keep))


def read_effects(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def wait_all_terminal(queue: effectmq.TaskQueue, ids: list[str], timeout: float) -> dict[str, object]:
    end = time.monotonic() + timeout
    infos: dict[str, object] = {}
    while True:
        try:
            pending = [tid for tid in ids if tid not in infos or not infos[tid] or not infos[tid].terminal]
            for tid in pending:
                infos[tid] = await queue.get(tid)
            if all(infos[tid] is not None and infos[tid].terminal for tid in ids):
                return infos
        except effectmq.RedisUnavailable:
            pass
        if time.monotonic() > end:
            return infos
        await asyncio.sleep(0.2)


def test_healing_a_proxy_that_was_not_cut_keeps_its_connections(redis_server):
    """heal() restores every proxy when the faults stop; one not cut at that moment must
    keep its connections, or the end of the fault phase is itself a fault nobody
    recorded (an acquire reply lost there stalls a task no fault explains)."""
    proxy = ChaosProxy(redis_server.port)
    client = redis.Redis.from_url(proxy.url, retry=Retry(NoBackoff(), 0), socket_timeout=2)
    try:
        # redis-py quietly reconnects an idle connection the peer closed: the server's
        # id for the connection tells whether it is still the same one
        first = client.client_id()
        proxy.restore()
        assert client.client_id() == first, "restoring a proxy that was not cut reset its connection"
        proxy.cut(drop_existing=False)
        proxy.restore()
        assert client.client_id() != first, "a held connection (its byte stream torn) outlived the fault"
    finally:
        client.close()
        proxy.close()


async def test_chaos_seeded_faults_lose_nothing_and_accept_no_stale_ack(make_redis, tmp_path):
    seed = chaos_seed()
    print(f"\n{'=' * 20} chaos seed {seed} (replay with EFFECTMQ_CHAOS_SEED={seed}) {'=' * 20}", flush=True)
    steps = fault_schedule(random.Random(f"{seed}/faults"))
    print("schedule: " + ", ".join(f"+{s.at:.1f}s {s.kind}:{s.target}({s.duration:.1f}s)" for s in steps), flush=True)
    server = make_redis(aof=True)
    chaos = Chaos(seed, server, tmp_path)
    keys = QueueKeys("emq", QUEUE)
    direct = effectmq.TaskQueue(QUEUE, url=server.url, lock_timeout=LOCK)
    producer = effectmq.TaskQueue(QUEUE, url=chaos.producer_proxy.url, lock_timeout=LOCK, socket_timeout=3.0)
    # Keep every lifecycle event of the run: the checker learns from them when an attempt
    # that never reached its handler was acquired, and which fault explains it. Since
    # events are written only while somebody reads them, it must ask for them.
    await direct.configure(events_maxlen=1_000_000, events_always=True, rate_limit=RATE_LIMIT)
    stop_watch = asyncio.Event()
    watcher = None
    stop_stalls = threading.Event()
    probes: list[str] = []
    try:
        for slot in chaos.slots:
            chaos.spawn(slot)
        deadline = time.monotonic() + 60
        while len(set(await direct.workers()) & {s.worker_name for s in chaos.slots}) < WORKERS:
            assert time.monotonic() < deadline, chaos.header() + ": workers did not start:\n" + "\n".join(
                tail(s.worker.log(), 20) for s in chaos.slots)
            await asyncio.sleep(0.1)
        watcher = asyncio.create_task(chaos.watch_workers(stop_watch))
        stalls = threading.Thread(target=chaos.watch_stalls, args=(stop_stalls,), daemon=True)
        stalls.start()

        # -- the chaos: offers throughout, faults on a seeded schedule --------------
        stop_offers = asyncio.Event()
        started = time.monotonic()
        offers = asyncio.create_task(chaos.produce(producer, random.Random(f"{seed}/tasks"), stop_offers))
        try:
            await chaos.run_schedule(steps, started)
            await asyncio.sleep(max(0.0, started + FAULT_PHASE - time.monotonic()))
        finally:
            chaos.heal()
            stop_offers.set()
            await asyncio.wait_for(offers, 120)  # the last offer is re-sent until confirmed
        fault_end = time.time()
        print(f"faults done: {len(chaos.faults)} faults, {len(chaos.confirmed)} offers confirmed", flush=True)

        # -- settle: every confirmed task reaches a terminal state ------------------
        ids = sorted(chaos.confirmed)
        infos = await wait_all_terminal(direct, ids, SETTLE_TIMEOUT)
        not_terminal = [tid for tid in ids if infos.get(tid) is None or not infos[tid].terminal]
        for tid in not_terminal:
            info = infos.get(tid)
            chaos.problem("accepted task lost", f"{tid}: " + ("no record" if info is None else
                          f"still {info.state} after {SETTLE_TIMEOUT}s (attempt {info.attempt}, "
                          f"stalls {info.stalled_attempt_count})"))
        settled_in = time.time() - fault_end
        for counted in await direct.groups():  # every grouped task settled: no group counts one waiting
            chaos.problem("group counts", f"{counted} after every task settled")

        # -- health: new long tasks (several renewals each) on the surviving workers --
        probes = [f"probe{i:02d}" for i in range(WORKERS * CONCURRENCY)]
        for tid in probes:
            await direct.offer("chaos", {"sleep": 2.5 * LOCK}, task_id=tid, max_stalled_count=HIGH_STALL_CAP)
        probe_infos = await wait_all_terminal(direct, probes, 60)
        for tid in probes:
            info = probe_infos.get(tid)
            if info is None or info.state != "completed" or info.attempt != 1 or info.stalled_attempt_count:
                chaos.problem("workers unhealthy after the chaos", f"{tid}: " + (
                    "no record" if info is None else f"{info.state}, attempt {info.attempt}, "
                    f"stalls {info.stalled_attempt_count}, error {info.error}"))
        live = set(await direct.workers())
        for slot in chaos.slots:
            if slot.worker_name not in live or slot.worker.proc.poll() is not None:
                chaos.problem("workers unhealthy after the chaos",
                              f"{slot.worker_name} (pid {slot.pid}) is not announced live:\n"
                              f"{tail(slot.worker.log(), 20)}")
    finally:
        stop_watch.set()
        stop_stalls.set()
        if watcher:
            await watcher
        chaos.heal()
        for slot in chaos.slots:
            if slot.worker:
                slot.expect_exit = True
                rc = wait_exit_after_term(slot.worker)
                chaos.exited_at.setdefault(slot.pid, time.time())
                if rc != 0:
                    chaos.problem("worker exits", f"{slot.worker_name} (pid {slot.pid}) exited {rc} after the "
                                                  f"final SIGTERM:\n{tail(slot.worker.log(), 30)}")
            slot.proxy.close()
        chaos.producer_proxy.close()
        await producer.close()
        await direct.close()

    # -- the checks -----------------------------------------------------------------
    r = server.client()
    # A stall explains extra runs only when no command made it (SLOWLOG since the last
    # restart): a script of ours holding Redis that long would be a defect.
    for entry in r.slowlog_get(128):
        if entry["duration"] > STALL * 1e6:
            chaos.problem("redis held by a command", f"{entry['duration'] / 1e6:.2f}s: {str(entry['command'])[:200]}")
    effects = read_effects(tmp_path / "effects.log")
    runs: dict[tuple[str, int], dict] = {}
    for e in effects:
        key = (e["task"], e["attempt"])
        run = runs.get(key)
        if e["ev"] == "start":
            if run is not None:
                chaos.problem("an attempt ran twice", f"{key[0]} attempt {key[1]} started in pid {run['pid']} and "
                                                      f"again in pid {e['pid']} (tokens {run['token']}, {e['token']})")
                continue
            runs[key] = {"pid": e["pid"], "token": e["token"], "start": e["t"], "deadline": e["deadline"],
                         "end": None, "how": None}
        elif run is not None and run["end"] is None:
            run["end"], run["how"] = e["t"], e["ev"]
    acquired: dict[tuple[str, int], float] = {}
    lease_end: dict[tuple[str, int], float] = {}  # when Redis took the task from that attempt
    current: dict[str, tuple[str, int]] = {}
    completed_at: dict[str, float] = {}
    for entry_id, fields in r.xrange(keys.key("events"), "-", "+"):
        tid, event, at = fields.get("id"), fields.get("event"), int(entry_id.split("-")[0]) / 1000
        if event in ("stalled", "released", "failed", "completed", "canceled", "active") and tid in current:
            lease_end.setdefault(current.pop(tid), at)
        if event == "completed":
            completed_at[tid] = at
        if event == "active":
            current[tid] = (tid, int(fields["attempt"]))
            acquired[current[tid]] = at
    hashes = {tid: r.hgetall(keys.task(tid)) for tid in [*chaos.confirmed, *probes]}
    index = {name: set(r.zrange(keys.key(name), 0, -1)) for name in INDEXES}
    starts = sorted(int(entry_id.split("-")[0]) for entry_id, fields in r.xrange(keys.key("events"), "-", "+")
                    if fields.get("event") == "active")
    tasks, period_ms = RATE_LIMIT[0], RATE_LIMIT[1] * 1000
    for i in range(len(starts) - tasks):
        if starts[i + tasks] - starts[i] < period_ms:
            chaos.problem("rate limit", f"{tasks + 1} lease starts within {starts[i + tasks] - starts[i]} ms "
                                        f"(from {starts[i]} ms, Redis time)")
            break

    def explained(tid: str, attempt: int) -> str | None:
        """The fault that explains why this attempt's result was not the accepted one."""
        run = runs.get((tid, attempt))
        if run is None:  # acquired, never reached its handler: its acquire reply was lost
            at = acquired.get((tid, attempt))
            if at is None:
                return None
            lo, hi, pid = at - BEFORE, max(at + LOCK, lease_end.get((tid, attempt), 0)) + AFTER, None
        else:
            # the attempt lasts until its handler ended and Redis took the lease back
            # (a finished handler's acknowledgement may be retried, the lease renewed)
            end = run["end"] if run["end"] is not None else chaos.exited_at.get(run["pid"], float("inf"))
            lo = run["start"] - BEFORE
            hi, pid = max(end + LOCK, lease_end.get((tid, attempt), 0)) + AFTER, run["pid"]
        for f in chaos.faults:
            if f.hits(pid) and f.start <= hi and f.end >= lo:
                return f"{f.kind}@+{f.start - chaos.t0:.2f}s"
        return None

    def describe(tid: str, attempt: int) -> str:
        run = runs.get((tid, attempt))
        if run is None:
            at = acquired.get((tid, attempt))
            return f"attempt {attempt}: no handler run, acquired " + (f"at +{at - chaos.t0:.3f}s" if at else "?")
        end = f"{run['how']} +{run['end'] - chaos.t0:.3f}s" if run["end"] else "no end recorded"
        late = " (started after its lease deadline)" if run["start"] > run["deadline"] + 0.05 else ""
        return f"attempt {attempt}: pid {run['pid']} start +{run['start'] - chaos.t0:.3f}s, {end}{late}"

    involved: set[int] = set()
    outcome = Counter()
    extra_runs = Counter()
    for tid in [*chaos.confirmed, *probes]:
        h = hashes[tid]
        if not h:
            if tid not in not_terminal:
                chaos.problem("accepted task lost", f"{tid}: its record is gone")
            continue
        info = parse_task(tid, h)
        task_runs = [a for a in range(1, info.attempt + 1) if (tid, a) in runs]
        stray = [a for (t, a) in runs if t == tid and a > info.attempt]
        if stray:
            chaos.problem("an attempt ran twice", f"{tid}: runs of attempts {stray} beyond the record's {info.attempt}")
        if len(task_runs) > 1:
            extra_runs[tid] = len(task_runs) - 1
        # 3. exactly one state index, the record's own
        member = [name for name in INDEXES if tid in index[name]]
        if member != [info.state]:
            chaos.problem("state indexes", f"{tid}: record says {info.state}, indexes {member}")
        if not info.terminal:
            continue  # reported above
        cap = chaos.confirmed[tid]["cap"] if tid in chaos.confirmed else HIGH_STALL_CAP
        if info.state == "completed":
            outcome["completed"] += 1
            # 2. the accepted acknowledgement is the current attempt's
            result = info.result if isinstance(info.result, dict) else {}
            done = runs.get((tid, info.attempt))
            if (result.get("attempt") != info.attempt or result.get("token") != h.get("last_token")
                    or done is None or done["how"] != "done" or done["token"] != result.get("token")
                    or done["pid"] != result.get("pid")):
                chaos.problem("stale acknowledgement accepted",
                              f"{tid}: record attempt {info.attempt}, last_token {h.get('last_token')}, result "
                              f"{info.result}; runs: "
                              + "; ".join(describe(tid, a) for a in range(1, info.attempt + 1)))
                involved.update(runs[(tid, a)]["pid"] for a in range(1, info.attempt + 1) if (tid, a) in runs)
            superseded = range(1, info.attempt)
        elif (info.state == "failed" and info.error and info.error.tag == effectmq.STALLED and cap is None
              and info.stalled_attempt_count > 1 and info.handler_failure_count == 0):
            outcome["failed: stalled (default cap)"] += 1
            superseded = range(1, info.attempt + 1)
        else:
            outcome[f"{info.state}: {info.error.tag if info.error else '?'}"] += 1
            chaos.problem("accepted task lost",
                          f"{tid}: {info.state} with {info.error} (stall cap {cap or 'default'}, attempt "
                          f"{info.attempt}, stalls {info.stalled_attempt_count}); runs: "
                          + "; ".join(describe(tid, a) for a in range(1, info.attempt + 1)))
            involved.update(runs[(tid, a)]["pid"] for a in range(1, info.attempt + 1) if (tid, a) in runs)
            continue
        # 4. every superseded attempt (an extra run, or a lease that ran out) meets a fault
        unexplained = [a for a in superseded if explained(tid, a) is None]
        if unexplained:
            chaos.problem("extra run not explained by a fault",
                          f"{tid} ({info.state}, stalls {info.stalled_attempt_count}): unexplained "
                          + "; ".join(describe(tid, a) for a in unexplained) + " | all: "
                          + "; ".join(describe(tid, a) for a in range(1, info.attempt + 1))
                          + " | worker logs on it: " + " / ".join(chaos.log_lines_naming(tid)[:4]))
            involved.update(runs[(tid, a)]["pid"] for a in unexplained if (tid, a) in runs)
    known = set(chaos.confirmed) | set(probes)
    for name in INDEXES:
        for tid in sorted(index[name] - known)[:20]:
            chaos.problem("state indexes", f"{name} holds {tid}, which nobody offered")

    late_starts = [(k, v) for k, v in runs.items() if v["start"] > v["deadline"] + 0.05]
    same_pid_overlaps = 0
    by_task: dict[str, list[dict]] = defaultdict(list)
    for (tid, _attempt), run in runs.items():
        by_task[tid].append(run)
    for task_runs in by_task.values():
        for a in task_runs:
            for b in task_runs:
                if a is not b and a["pid"] == b["pid"] and a["start"] < b["start"] < (a["end"] or float("inf")):
                    same_pid_overlaps += 1
    slow_acks = sorted((completed_at[tid] - run["end"], tid) for (tid, a), run in runs.items()
                       if run["how"] == "done" and tid in completed_at and str(a) == hashes[tid].get("attempt"))
    slow_acks = [(round(d, 2), tid) for d, tid in slow_acks if d > 2 * LOCK]
    held_after_done = sorted(
        (round(lease_end[(tid, a)] - run["end"], 2), tid) for (tid, a), run in runs.items()
        if run["how"] == "done" and (tid, a) in lease_end and str(a) != hashes.get(tid, {}).get("attempt")
        and lease_end[(tid, a)] - run["end"] > 2 * LOCK)
    drains = [round(f.end - f.start, 2) for f in chaos.faults if f.kind == "sigterm"]
    summary = (f"{chaos.header()}\n  {len(chaos.confirmed)} offers confirmed "
               f"({sum(1 for c in chaos.confirmed.values() if c['unknown_outcomes'])} after an unknown outcome, "
               f"{sum(1 for c in chaos.confirmed.values() if not c['created'])} answered created=False), "
               f"{len(runs)} handler runs, {sum(extra_runs.values())} extra runs on {len(extra_runs)} tasks, "
               f"outcomes {dict(outcome)}; settled {settled_in:.1f}s after the faults\n"
               f"  faults: {dict(Counter(f.kind for f in chaos.faults))} (startup-exit: a new worker found Redis "
               f"down and exited 1, then was started again)\n"
               f"  diagnostics: {len(late_starts)} handler starts after their lease deadline, "
               f"{same_pid_overlaps} overlapping attempts of one task in one process, "
               f"{len(slow_acks)} completions accepted > {2 * LOCK}s after the handler returned {slow_acks[-5:]}, "
               f"{len(held_after_done)} finished attempts whose result was dropped after holding the lease "
               f"> {2 * LOCK}s {held_after_done[-5:]}; SIGTERM drains took {drains}s (drain timeout {DRAIN}s); "
               f"slowest direct PING {chaos.slowest_ping:.2f}s (a stall above {STALL}s)")
    print(summary, flush=True)
    print("fault timeline:\n" + chaos.timeline(), flush=True)
    assert not chaos.problems, chaos.failure_message(involved) + "\n" + summary


def wait_exit_after_term(worker: WorkerProcess) -> int | None:
    """SIGTERM (after SIGCONT, in case it is stopped) and wait for the drain."""
    proc = worker.proc
    if proc.poll() is not None:
        return proc.returncode
    try:
        os.kill(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    proc.terminate()
    return wait_exit(proc, 30)
