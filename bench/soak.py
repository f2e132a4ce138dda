"""Soak: a steady stream of offers through one real worker process, watched for leaks.

    python bench/soak.py                          # 10 minutes, 500 offers/s, 4 KiB payloads
    python bench/soak.py --seconds 60             # a one-minute run
    python bench/soak.py --seconds 600 --rate 500 --payload-bytes 4096 --url redis://127.0.0.1:6379/0

A private redis-server is started (unless --url is given), then one worker process,
`python -m effectmq worker bench._soak_handlers:app` (handler: a trivial async
function), exactly as a pod runs it. Producers offer at a steady `--rate`, one
`TaskQueue.offer` per task with an explicit task id. The queue is configured with a
short completed-record retention (5 s) and a short dedup window (30 s) so that the
worker's maintenance expires records while the soak runs; with the defaults (1 day,
7 days) memory grows by design: a 4 KiB completed record costs about 6.7 KiB of
used_memory while retained, a reserved explicit id about 125 B (500/s for 10
minutes: ~36 MiB). The worker runs maintenance every second (--maintenance-interval
1). Its passes sweep while calls report more and come sooner while records expire,
so the worker's default of 5 s keeps up as well (bench/retention.py); when a pass
expired at most 10 batches of 100, one worker expired about 200 records/s at that
default and, at 500 tasks/s, completed records piled up (+1.7 MiB/s of used_memory).

Every `--sample-every` seconds: accepted (offers Redis confirmed), completed (the
worker's effectmq_outcomes_total{outcome="completed"} counter, scraped from its
--metrics-port), backlog (waiting + active) and in flight (accepted - completed),
Redis used_memory (INFO memory), errors (every exception from an offer or a
sample, every WARNING/ERROR/Traceback line of the worker's log) and the worker's
VmRSS (/proc/<pid>/status). After the offers stop, the backlog drains and the
figures are checked against the criteria below (the exit status is 1 when one fails):

  accepted == completed   every confirmed offer completed exactly once, nothing else
  no Redis errors         no offer, sample or worker-log exception; the worker exits 0
  Redis memory growth     <= 32 MiB, first sample after warm-up -> last sample under load
  worker RSS growth       <= 64 MiB, same window

tests/runtime/test_soak.py runs `soak()` for 30 seconds in the default test run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import effectmq  # noqa: E402

MIB = 1024 * 1024
MAX_REDIS_GROWTH = 32 * MIB
MAX_RSS_GROWTH = 64 * MIB
HANDLERS = "bench._soak_handlers:app"
TASK = "noop"
LOG_PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")
OUTCOME = re.compile(r'^effectmq_outcomes_total\{([^}]*)\}\s+([0-9.e+]+)', re.M)


@dataclass
class Sample:
    t: float  # seconds since the offers started
    phase: str  # start (before the first offer), load, drained, expired
    accepted: int
    completed: int
    in_flight: int  # accepted - completed
    waiting: int
    active: int
    completed_records: int  # the completed index (records not yet expired)
    dedup_reserved: int  # explicit ids reserved after their record expired
    settled_kept: int  # outcomes remembered after their record expired (the `settled` index, if any)
    used_memory: int
    used_memory_rss: int
    worker_rss: int
    worker_cpu_s: float
    errors: int  # so far: offers + samples + worker log lines

    @property
    def backlog(self) -> int:
        return self.waiting + self.active


@dataclass
class SoakResult:
    seconds: float
    rate: float
    payload_bytes: int
    warmup: float
    retention_completed: float
    dedup_window: float | None
    maintenance_interval: float
    concurrency: int
    offered: int = 0  # offer calls that returned
    accepted: int = 0  # created=True
    not_created: int = 0  # created=False: an id already known (must not happen)
    completed: int = 0
    other_outcomes: dict = field(default_factory=dict)
    offer_errors: int = 0
    sample_errors: int = 0
    worker_log_problems: int = 0
    worker_exit: int | None = None
    error_examples: list = field(default_factory=list)
    offer_elapsed: float = 0.0
    max_offer_lag: float = 0.0  # how far the producers fell behind the schedule
    offer_ms: dict = field(default_factory=dict)  # p50, p99, max
    drain_seconds: float | None = None
    drained: bool = False
    samples: list = field(default_factory=list)
    log_path: str = ""

    @property
    def errors(self) -> int:
        return self.offer_errors + self.sample_errors + self.worker_log_problems

    def window(self) -> tuple[Sample, Sample]:
        """(first sample after warm-up, last sample under load)."""
        load = [s for s in self.samples if s.phase == "load"]
        after = [s for s in load if s.t >= self.warmup] or load[-1:]
        return after[0], load[-1]

    def redis_growth(self) -> int:
        first, last = self.window()
        return last.used_memory - first.used_memory

    def rss_growth(self) -> int:
        first, last = self.window()
        return last.worker_rss - first.worker_rss

    def criteria(self) -> list[tuple[str, bool, str]]:
        """(criterion, met, figures) for each criterion of the soak."""
        first, last = self.window()
        peak = max(s.used_memory for s in self.samples if s.phase == "load" and s.t >= first.t)
        end = self.samples[-1]
        others = sum(self.other_outcomes.values())
        return [
            ("accepted == completed", self.drained and self.accepted == self.completed and others == 0
             and self.not_created == 0 and end.backlog == 0,
             f"accepted {self.accepted}, completed {self.completed}, other outcomes {self.other_outcomes or 0}, "
             f"not created {self.not_created}, backlog at end {end.backlog}"),
            ("no Redis errors", self.errors == 0 and self.worker_exit == 0,
             f"offer errors {self.offer_errors}, sample errors {self.sample_errors}, "
             f"worker log warnings/errors {self.worker_log_problems}, worker exit {self.worker_exit}"),
            (f"Redis memory growth <= {MAX_REDIS_GROWTH // MIB} MiB", self.redis_growth() <= MAX_REDIS_GROWTH,
             f"{first.used_memory / MIB:.1f} MiB at {first.t:.0f} s -> {last.used_memory / MIB:.1f} MiB at "
             f"{last.t:.0f} s = {self.redis_growth() / MIB:+.1f} MiB (peak {peak / MIB:.1f} MiB)"),
            (f"worker RSS growth <= {MAX_RSS_GROWTH // MIB} MiB", self.rss_growth() <= MAX_RSS_GROWTH,
             f"{first.worker_rss / MIB:.1f} MiB at {first.t:.0f} s -> {last.worker_rss / MIB:.1f} MiB at "
             f"{last.t:.0f} s = {self.rss_growth() / MIB:+.1f} MiB"),
        ]

    @property
    def ok(self) -> bool:
        return all(met for _, met, _ in self.criteria())

    def to_json(self) -> dict:
        out = asdict(self)
        out["criteria"] = [{"criterion": c, "met": m, "figures": f} for c, m, f in self.criteria()]
        return out


# -- the worker process ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> tuple[int, float]:
    """(VmRSS in bytes, user + system CPU seconds) of a process; (0, 0) once it is gone."""
    rss, cpu = 0, 0.0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss, cpu


class SoakWorker:
    """`python -m effectmq worker bench._soak_handlers:app` with its log in a file."""

    def __init__(self, url: str, queue: str, log_dir: Path, *, concurrency: int, maintenance_interval: float,
                 extra_args: tuple[str, ...] = ()):
        self.metrics_port = free_port()
        self.log_path = log_dir / f"worker-{queue}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1", "EFFECTMQ_REDIS_URL": url}
        cmd = [sys.executable, "-m", "effectmq", "worker", HANDLERS, "--queue", queue,
               "--concurrency", str(concurrency), "--maintenance-interval", str(maintenance_interval),
               "--metrics-port", str(self.metrics_port), *extra_args]
        self.log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self.log_file, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def problems(self) -> list[str]:
        return [line for line in self.log().splitlines() if LOG_PROBLEM.search(line)]

    def outcomes(self) -> dict[str, int]:
        """effectmq_outcomes_total of TASK by outcome, from the worker's metrics endpoint."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        out: dict[str, int] = {}
        for labels, value in OUTCOME.findall(text):
            pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if pairs.get("task") == TASK:
                out[pairs["outcome"]] = out.get(pairs["outcome"], 0) + int(float(value))
        return out

    async def ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if "serving queue" in self.log():
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(self.outcomes)
                    return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"worker not ready within {timeout} s:\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        return self.proc.returncode


# -- the soak ---------------------------------------------------------------------------


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))]


async def soak(url: str, *, seconds: float = 600.0, rate: float = 500.0, payload_bytes: int = 4096,
               warmup: float | None = None, sample_every: float = 5.0, retention_completed: float = 5.0,
               dedup_window: float | None = 30.0, maintenance_interval: float = 1.0, concurrency: int = 10,
               producers: int = 8, drain_timeout: float = 60.0, log_dir: Path | None = None,
               progress=None) -> SoakResult:
    """Offer `rate` tasks/s for `seconds` through one worker process; sample; drain; return the figures.

    `dedup_window=None` keeps the queue default (7 days). `warmup` defaults to the time the
    completed records need to reach their steady count (retention + 3 maintenance intervals).
    `progress`, if given, is called with each Sample as it is taken.
    """
    if warmup is None:
        warmup = min(seconds / 2, max(10.0, retention_completed + 3 * maintenance_interval + 2))
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="effectmq-soak-"))
    queue_name = f"soak-{secrets.token_hex(4)}"
    result = SoakResult(seconds, rate, payload_bytes, warmup, retention_completed, dedup_window,
                        maintenance_interval, concurrency)
    q = effectmq.TaskQueue(queue_name, url=url, max_connections=producers + 4)
    settings = {"retention_completed": retention_completed}
    if dedup_window is not None:
        settings["dedup_window"] = dedup_window
    await q.configure(**settings)
    payload = {"data": "x" * max(0, payload_bytes - 11)}  # ~payload_bytes of JSON
    run = secrets.token_hex(3)
    total = int(seconds * rate)
    next_index = 0
    latencies: list[float] = []
    loop = asyncio.get_running_loop()

    def note(where: str, exc: BaseException) -> None:
        if len(result.error_examples) < 10:
            result.error_examples.append(f"{where}: {type(exc).__name__}: {exc}")

    worker = SoakWorker(url, queue_name, log_dir, concurrency=concurrency, maintenance_interval=maintenance_interval)
    result.log_path = str(worker.log_path)
    try:
        await worker.ready()
        t0 = loop.time()  # reset when the offers start

        async def producer() -> None:
            nonlocal next_index
            while next_index < total:
                i = next_index
                next_index += 1
                delay = t0 + i / rate - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    result.max_offer_lag = max(result.max_offer_lag, -delay)
                start = time.perf_counter()
                try:
                    offered = await q.offer(TASK, payload, task_id=f"{run}-{i:09d}")
                except Exception as exc:  # every exception counts, whatever its kind
                    result.offer_errors += 1
                    note("offer", exc)
                    continue
                latencies.append(time.perf_counter() - start)
                result.offered += 1
                if offered.created:
                    result.accepted += 1
                else:
                    result.not_created += 1

        async def sample(phase: str) -> Sample | None:
            try:
                outcomes = await asyncio.to_thread(worker.outcomes)
                stats = await q.stats()
                memory = await q.redis.info("memory")
                dedup = await q.redis.zcard(q.keys.key("dedup"))
                settled = await q.redis.zcard(q.keys.key("settled"))  # 0 where the runtime has no such index
            except Exception as exc:
                result.sample_errors += 1
                note("sample", exc)
                return None
            result.completed = outcomes.get("completed", 0)
            result.other_outcomes = {k: v for k, v in outcomes.items() if k != "completed" and v}
            result.worker_log_problems = len(worker.problems())
            rss, cpu = proc_status(worker.proc.pid)
            s = Sample(round(loop.time() - t0, 2), phase, result.accepted, result.completed,
                       result.accepted - result.completed, stats.waiting, stats.active, stats.completed, dedup,
                       settled,
                       int(memory["used_memory"]), int(memory["used_memory_rss"]), rss, cpu, result.errors)
            result.samples.append(s)
            if progress:
                progress(s)
            return s

        await sample("start")
        t0 = loop.time()
        tasks = [asyncio.create_task(producer()) for _ in range(producers)]
        offering = asyncio.gather(*tasks)
        next_sample = sample_every
        while not offering.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(offering), max(0.0, t0 + next_sample - loop.time()))
            if not offering.done():
                await sample("load")
                next_sample += sample_every
        await offering
        result.offer_elapsed = loop.time() - t0
        await sample("load")  # the last sample under load

        drain_start = loop.time()
        while loop.time() - drain_start < drain_timeout:
            with contextlib.suppress(Exception):  # a failure here shows in the sample below
                outcomes = await asyncio.to_thread(worker.outcomes)
                stats = await q.stats()
                if sum(outcomes.values()) >= result.accepted and stats.waiting + stats.active == 0:
                    result.drained = True
                    break
            await asyncio.sleep(0.25)
        result.drain_seconds = loop.time() - drain_start
        await sample("drained")

        # Leak check after the load: the completed records expire (retention + a few sweeps).
        expiry_end = loop.time() + retention_completed + 4 * maintenance_interval + 5
        while loop.time() < expiry_end:
            await asyncio.sleep(min(1.0, sample_every))
            stats = None
            with contextlib.suppress(Exception):
                stats = await q.stats()
            if stats is not None and stats.completed == 0:
                break
        await sample("expired")
    finally:
        result.worker_exit = await asyncio.to_thread(worker.stop)
        result.worker_log_problems = len(worker.problems())
        for line in worker.problems()[:10 - len(result.error_examples)]:
            result.error_examples.append(f"worker log: {line[:300]}")
        with contextlib.suppress(Exception):
            await q.close()
    latencies.sort()
    result.offer_ms = {"p50": percentile(latencies, 50) * 1000, "p99": percentile(latencies, 99) * 1000,
                       "max": (latencies[-1] * 1000) if latencies else float("nan")}
    return result


# -- report ------------------------------------------------------------------------------

HEADER = (f"{'t s':>7} {'phase':<7} {'accepted':>9} {'completed':>9} {'in fl.':>6} {'backlog':>7} "
          f"{'done rec':>8} {'dedup':>6} {'settled':>7} {'redis MiB':>9} {'rss MiB':>7} {'wrk RSS MiB':>11} "
          f"{'wrk CPU s':>9} "
          f"{'errors':>6}")


def sample_row(s: Sample) -> str:
    return (f"{s.t:>7.1f} {s.phase:<7} {s.accepted:>9} {s.completed:>9} {s.in_flight:>6} {s.backlog:>7} "
            f"{s.completed_records:>8} {s.dedup_reserved:>6} {s.settled_kept:>7} {s.used_memory / MIB:>9.1f} "
            f"{s.used_memory_rss / MIB:>7.1f} {s.worker_rss / MIB:>11.1f} {s.worker_cpu_s:>9.1f} {s.errors:>6}")


def report(r: SoakResult, samples: bool = True) -> str:
    first, last = r.window()
    lines = [
        "",
        f"soak: {r.seconds:.0f} s at {r.rate:.0f} offers/s, {r.payload_bytes} B payloads, 1 worker process "
        f"(concurrency {r.concurrency}, maintenance every {r.maintenance_interval} s), retention_completed "
        f"{r.retention_completed} s, dedup_window {r.dedup_window if r.dedup_window is not None else 'default (7 d)'}"
        f"{'' if r.dedup_window is None else ' s'}, {os.cpu_count()} cores",
        f"offers: {r.offered} confirmed in {r.offer_elapsed:.1f} s = {r.offered / max(r.offer_elapsed, 1e-9):.0f}/s "
        f"(max lag behind schedule {r.max_offer_lag * 1000:.0f} ms); latency p50 {r.offer_ms['p50']:.2f} ms, "
        f"p99 {r.offer_ms['p99']:.2f} ms, max {r.offer_ms['max']:.1f} ms",
        f"drain after the last offer: {r.drain_seconds:.1f} s ({'drained' if r.drained else 'NOT drained'})",
        f"window: first sample after the {r.warmup:.0f} s warm-up (t={first.t:.0f} s) -> last under load "
        f"(t={last.t:.0f} s)",
        *(["", HEADER, *(sample_row(s) for s in r.samples)] if samples else []),
        "",
        "criteria",
        *(f"  {name:<32} {'met' if met else 'MISSED':<7} {figures}" for name, met, figures in r.criteria()),
    ]
    if r.error_examples:
        lines += ["", "errors seen (first 10):", *(f"  {e}" for e in r.error_examples)]
    lines += ["", f"worker log: {r.log_path}", f"verdict: {'PASS' if r.ok else 'FAIL'}"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="use this Redis instead of a private redis-server")
    parser.add_argument("--seconds", type=float, default=600.0, help="how long to offer (default 600)")
    parser.add_argument("--rate", type=float, default=500.0, help="offers per second (default 500)")
    parser.add_argument("--payload-bytes", type=int, default=4096, help="payload size (default 4096)")
    parser.add_argument("--warmup", type=float, help="seconds before the memory baseline "
                        "(default retention + 3 maintenance intervals + 2, at least 10)")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples (default 5)")
    parser.add_argument("--retention-completed", type=float, default=5.0,
                        help="queue setting retention_completed, seconds (default 5)")
    parser.add_argument("--dedup-window", type=float, default=30.0,
                        help="queue setting dedup_window, seconds; 0 keeps the default of 7 days (default 30)")
    parser.add_argument("--maintenance-interval", type=float, default=1.0,
                        help="worker --maintenance-interval (default 1; the worker's own default is 5)")
    parser.add_argument("--concurrency", type=int, default=10, help="worker --concurrency (default 10)")
    parser.add_argument("--producers", type=int, default=8, help="concurrent offer loops (default 8)")
    parser.add_argument("--json", type=Path, help="also write the figures and samples to this file")
    args = parser.parse_args()

    from bench._redis import private_redis

    print(HEADER, flush=True)
    with private_redis(args.url) as url:
        result = asyncio.run(soak(
            url, seconds=args.seconds, rate=args.rate, payload_bytes=args.payload_bytes, warmup=args.warmup,
            sample_every=args.sample_every, retention_completed=args.retention_completed,
            dedup_window=args.dedup_window or None, maintenance_interval=args.maintenance_interval,
            concurrency=args.concurrency, producers=args.producers,
            progress=lambda s: print(sample_row(s), flush=True)))
    print(report(result, samples=False))
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=2, default=str))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
