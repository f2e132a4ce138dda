"""Run Queues and Schedules on this machine: local Redis, worker processes scaled by
the operator's scaling decision, schedules, maintenance, and a live view.

Ctrl-C (SIGINT) or SIGTERM stops it cleanly: the scheduler stops, every worker
drains (finishes or releases its attempts), and Redis is shut down after its
append-only file is synced, so the next start continues where this one stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import redis.asyncio as aioredis

import effectmq
from effectmq.transport.redaction import redact_url
from effectmq.scheduler import Scheduler
from effectmq.scheduler.model import ScheduleSpec

from .. import builders, queue_plan, scaling
from ..spec import InvalidSpec, QueueSpec
from . import view
from .manifests import Resource

log = logging.getLogger("effectmq.local")
SCHEDULER_NAMESPACE = "local"
PASS_EVERY = 0.5  # seconds between passes of the loop (scaling polls, ticks, the view)
OUTAGE_BACKOFF_LIMIT = 5.0  # seconds: the longest wait between passes while Redis refuses


class LocalError(RuntimeError):
    """Something the local runner needs is missing; the message says what to do."""


# -- Redis -------------------------------------------------------------------------

class LocalRedis:
    """A redis-server with AOF in `data_dir`: what was accepted survives a restart."""

    def __init__(self, data_dir: Path, port: int):
        self.data_dir = data_dir
        self.port = port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise LocalError("redis-server is not installed. Install it (Debian/Ubuntu: "
                             "`sudo apt-get install redis-server`, macOS: `brew install redis`) "
                             "or point at a running Redis with --url.")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--maxmemory-policy", "noeviction",
             "--protected-mode", "no"],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        client = aioredis.Redis(port=self.port)
        try:
            for _ in range(250):
                try:
                    await client.ping()
                    return
                except Exception:
                    if self.proc.poll() is not None:
                        tail = (self.data_dir / "redis.log").read_text(errors="replace")[-800:]
                        raise LocalError(f"redis-server exited (port {self.port} in use?):\n{tail}") from None
                    await asyncio.sleep(0.02)
        finally:
            await client.aclose()
        raise LocalError("redis-server did not answer within 5s")

    async def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        client = aioredis.Redis(port=self.port)
        with contextlib.suppress(Exception):
            await client.execute_command("SHUTDOWN")  # syncs the AOF before exiting
        with contextlib.suppress(Exception):
            await client.aclose()
        try:
            await asyncio.to_thread(self.proc.wait, 10)
        except subprocess.TimeoutExpired:
            self.proc.terminate()


# -- worker processes ----------------------------------------------------------------

@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen
    stopping: bool = False


@dataclass
class LocalQueue:
    resource: Resource
    queue: effectmq.TaskQueue
    spec: QueueSpec
    env: dict[str, str]
    argv: list[str]
    workers: list[WorkerProc] = field(default_factory=list)
    state: scaling.ScalingState = field(default_factory=scaling.ScalingState)
    next_poll: float = 0.0
    last_reason: str = ""
    last_scaled_at: float | None = None  # monotonic: the view says how long ago
    serial: int = 0

    @property
    def running(self) -> list[WorkerProc]:
        return [w for w in self.workers if not w.stopping and w.proc.poll() is None]


def worker_env(resource: Resource, redis_url: str, worker_name: str, redis_url_file: Path) -> dict[str, str]:
    """The Deployment's environment, with what only a cluster provides resolved locally.

    The Redis is the runner's, whatever the manifest says, passed as the Deployment
    passes it: a literal URL as EFFECTMQ_REDIS_URL; a URL from a Secret (which may hold
    a password) by EFFECTMQ_REDIS_URL_FILE, here `redis_url_file`, written by the runner."""
    env: dict[str, str] = {}
    for var in builders.worker_env(resource.namespace, resource.name, QueueSpec.parse(resource.spec, resource.name)):
        if var["name"] == "EFFECTMQ_REDIS_URL":
            env[var["name"]] = redis_url
        elif var["name"] == "EFFECTMQ_REDIS_URL_FILE":
            env[var["name"]] = str(redis_url_file)
        elif var["name"] == "EFFECTMQ_METRICS_PORT":
            continue  # several local workers would fight over one port
        elif "value" in var:
            env[var["name"]] = str(var["value"])
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = worker_name
    return env


class LocalRunner:
    def __init__(self, resources: list[Resource], *, data_dir: Path, redis_port: int = 6390,
                 redis_url: str | None = None, pythonpath: Sequence[str] = (), live_view: bool = True,
                 burst: int = 0, burst_task: str = "send_email", stop_after: float | None = None,
                 dashboard_port: int | None = None, burst_payload: dict | None = None):
        self.resources = resources
        self.data_dir = data_dir
        self.redis: LocalRedis | None = None if redis_url else LocalRedis(data_dir / "redis", redis_port)
        self.redis_url: str = self.redis.url if self.redis is not None else redis_url or ""
        self.pythonpath = [str(Path(p).resolve()) for p in pythonpath]
        self.live_view = live_view
        self.burst = burst
        self.burst_task = burst_task
        self.burst_payload = burst_payload
        self.stop_after = stop_after
        self.queues: dict[str, LocalQueue] = {}
        self.scheduler: Scheduler | None = None
        self.recent_ticks: list[str] = []
        self.recent_failures: list[str] = []
        self.ticks_created = 0
        self.redis_problem: str | None = None  # why the last pass failed, while Redis refuses
        self.stopping = asyncio.Event()
        self.worker_logs = data_dir / "logs"
        self.redis_url_file: Path | None = None  # written at start, removed at shutdown
        self.dashboard_port = dashboard_port
        self.dashboard: subprocess.Popen | None = None

    def _write_url_file(self) -> Path:
        """The Redis URL in a file only this user reads (0600, in a fresh 0700 folder): the
        kubelet's mounted Secret, for workers whose Deployment reads the URL from a file."""
        path = Path(tempfile.mkdtemp(prefix="effectmq-local-")) / "redis-url"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.redis_url)
        return path

    # -- setup ----------------------------------------------------------------------

    async def start(self) -> None:
        if self.redis is not None:
            await self.redis.start()
        self.worker_logs.mkdir(parents=True, exist_ok=True)
        self.redis_url_file = self._write_url_file()
        executable = shutil.which("effectmq")
        base = [executable] if executable else [sys.executable, "-m", "effectmq"]
        for r in (r for r in self.resources if r.kind == "Queue"):
            qname = builders.queue_name(r.namespace, r.name)
            try:
                spec = QueueSpec.parse(r.spec, r.name)
            except InvalidSpec as exc:
                raise LocalError(f"{r.source}: Queue {r.name}: {exc}") from None
            if spec.worker is None:
                raise LocalError(f"{r.source}: Queue {r.name}: spec.worker (image, handlers) is needed to run workers")
            q = effectmq.TaskQueue(qname, url=self.redis_url)
            await q.ping()
            await q.configure(**builders.queue_settings(spec))
            self.queues[qname] = LocalQueue(r, q, spec, env={}, argv=base + ["worker", spec.worker.handlers])
        self.scheduler = Scheduler(self.redis_url, namespace=SCHEDULER_NAMESPACE)
        wanted = set()
        for r in (r for r in self.resources if r.kind == "Schedule"):
            schedule = ScheduleSpec.from_json(builders.schedule_spec(r.namespace, r.name, r.spec))
            wanted.add(schedule.id)
            await self.scheduler.put(schedule)
        for old in await self.scheduler.list():  # schedules removed from the manifests stop firing
            if old.id not in wanted:
                await self.scheduler.remove(old.id)
        if self.dashboard_port is not None:
            self._start_dashboard(base)
        if self.burst:  # a burst of tasks on the first queue, to watch the workers scale
            first = next(iter(self.queues.values()))
            await first.queue.offer_many([
                (self.burst_task, self.burst_payload or {"to": f"user{i}@example.com", "subject": "burst"})
                for i in range(self.burst)])

    @property
    def dashboard_url(self) -> str | None:
        return None if self.dashboard_port is None else f"http://127.0.0.1:{self.dashboard_port}"

    def _start_dashboard(self, base: list[str]) -> None:
        """The web dashboard beside the workers, read-only on loopback, given the Redis URL
        by file as a worker is (a URL in its arguments would show in `ps`)."""
        assert self.redis_url_file is not None, "start() writes it"
        env = {k: v for k, v in os.environ.items() if k not in builders.URL_VARIABLES}
        env["EFFECTMQ_REDIS_URL_FILE"] = str(self.redis_url_file)
        out = open(self.worker_logs / "dashboard.log", "ab")
        self.dashboard = subprocess.Popen([*base, "dashboard", "--port", str(self.dashboard_port)], env=env,
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        print(f"effectmq local: dashboard at {self.dashboard_url} (log: {self.worker_logs / 'dashboard.log'})",
              flush=True)

    # -- the loop ---------------------------------------------------------------------

    def _spawn(self, lq: LocalQueue) -> None:
        lq.serial += 1
        name = f"{lq.resource.name}-worker-{lq.serial}"
        assert self.redis_url_file is not None, "start() writes it"
        # This shell's own Redis URL variables stay out: the worker takes one of the two, never both.
        inherited = {k: v for k, v in os.environ.items() if k not in builders.URL_VARIABLES}
        env = {**inherited, **worker_env(lq.resource, self.redis_url, name, self.redis_url_file)}
        env["PYTHONPATH"] = os.pathsep.join([*self.pythonpath, os.getcwd(), os.environ.get("PYTHONPATH", "")])
        out = open(self.worker_logs / f"{name}.log", "ab")
        proc = subprocess.Popen(lq.argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        lq.workers.append(WorkerProc(name, proc))

    async def _scale(self, lq: LocalQueue, now: float) -> None:
        lq.workers = [w for w in lq.workers if w.proc.poll() is None]
        stats = await lq.queue.stats()
        announced = await lq.queue.workers()
        running = lq.running
        mine = {w.name: announced[w.name] for w in running if w.name in announced}
        decision = queue_plan.scale(lq.spec, stats, mine, len(running), lq.state, now)
        lq.state = decision.state
        if decision.replicas != len(running):
            lq.last_reason, lq.last_scaled_at = decision.reason, now
            log.info("%s: %s", lq.queue.name, decision.reason)
        for _ in range(decision.replicas - len(running)):
            self._spawn(lq)
        surplus = len(running) - decision.replicas
        if surplus > 0:  # idle workers go first: the operator's pod-deletion-cost, applied here
            costs = queue_plan.pod_costs(announced, [w.name for w in running])
            for w in sorted(running, key=lambda w: int(costs[w.name]))[:surplus]:
                w.stopping = True
                w.proc.send_signal(signal.SIGTERM)

    async def _maintain(self, lq: LocalQueue) -> None:
        # Briefly: this loop also ticks the schedules, and the worker processes sweep too.
        await lq.queue.sweep(batch=200, budget=0.1)

    async def _note_failures(self) -> None:
        for lq in self.queues.values():
            for t in await lq.queue.dead_letters(limit=5):
                line = f"{t.task_id} ({t.name}): {t.error.tag if t.error else '?'}"
                if line not in self.recent_failures:
                    self.recent_failures = (self.recent_failures + [line])[-5:]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        started = time.monotonic()
        try:
            await self.start()
            next_view, wait = 0.0, PASS_EVERY
            while not self.stopping.is_set():
                now = time.monotonic()
                try:
                    await self._pass(now)
                    self._redis_answers()
                    wait = PASS_EVERY
                except effectmq.RedisUnavailable as exc:
                    if not exc.retryable:
                        raise
                    self._redis_refuses(str(exc))  # a full or restarting Redis: the system waits, as a pod would
                    wait = min(wait * 2, OUTAGE_BACKOFF_LIMIT)
                if now >= next_view:
                    next_view = now + 1.0
                    with contextlib.suppress(effectmq.RedisUnavailable):  # said above, once
                        await self._note_failures()
                        await self._render()
                if self.stop_after is not None and now - started >= self.stop_after:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), wait)
        finally:
            await self.shutdown()

    async def _pass(self, now: float) -> None:
        """Scale and sweep the queues due, tick the schedules."""
        for lq in self.queues.values():
            if now >= lq.next_poll:
                lq.next_poll = now + min(lq.spec.scaling.poll_interval, 5.0)
                await self._maintain(lq)
                await self._scale(lq, now)
        assert self.scheduler is not None, "start() made it"
        report = await self.scheduler.tick()
        for m in report.materialized:
            if m.created:
                self.ticks_created += 1
                self.recent_ticks = (self.recent_ticks + [f"{m.tick:%H:%M:%S} {m.schedule_id} -> {m.task_id}"])[-5:]

    def _redis_refuses(self, problem: str) -> None:
        if problem != self.redis_problem:  # once per problem, not once per pass
            print(f"effectmq local: {problem.rstrip('.')}; retrying", flush=True)
        self.redis_problem = problem

    def _redis_answers(self) -> None:
        if self.redis_problem is not None:
            print("effectmq local: Redis answers again", flush=True)
        self.redis_problem = None

    async def _render(self) -> None:
        rows = []
        for lq in self.queues.values():
            stats = await lq.queue.stats()
            age = None if lq.last_scaled_at is None else time.monotonic() - lq.last_scaled_at
            rows.append(view.QueueRow(lq.queue.name, stats, len(lq.running), lq.last_reason, age))
        dashboard = self.dashboard_url if self.dashboard is not None and self.dashboard.poll() is None else None
        text = view.render(redact_url(self.redis_url), rows, self.recent_ticks, self.recent_failures, self.worker_logs,
                           self.redis_problem, dashboard=dashboard)
        if self.live_view and sys.stdout.isatty():
            sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
        else:
            sys.stdout.write(view.status_line(rows, self.ticks_created) + "\n")
        sys.stdout.flush()

    async def shutdown(self) -> None:
        print("effectmq local: stopping: draining workers ...", flush=True)
        procs = [w.proc for lq in self.queues.values() for w in lq.workers if w.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)  # drain: finish or release, never stall
        for p in procs:
            try:
                await asyncio.to_thread(p.wait, 120)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.dashboard is not None and self.dashboard.poll() is None:
            self.dashboard.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.dashboard.wait, 10)
        for lq in self.queues.values():
            await lq.queue.close()
        if self.scheduler is not None:
            await self.scheduler.close()
        if self.redis is not None:
            await self.redis.stop()
        if self.redis_url_file is not None:
            shutil.rmtree(self.redis_url_file.parent, ignore_errors=True)
        print("effectmq local: stopped; state kept in " + str(self.data_dir), flush=True)
