"""Retention under sustained load: Redis memory stays flat while completed records expire.

    python bench/retention.py                       # 5 minutes at 2,000 tasks/s, retention 10 s
    python bench/retention.py --minutes 1 --rate 500
    python bench/retention.py --url redis://127.0.0.1:6379/0 --json /tmp/retention.json

A private redis-server is started (unless --url is given), then one worker process,
`python -m effectmq worker bench._soak_handlers:app` (a trivial async handler) with the
worker's own maintenance defaults (interval 5 s, batch 100) unless
--maintenance-interval / --maintenance-batch say otherwise. The queue keeps completed
records for `--retention` seconds (queue setting retention_completed). A producer
offers `--rate` tasks/s on a fixed schedule, `offer_many` every 50 ms, with generated
task ids (an explicit id stays reserved for the dedup window, 7 days by default, which
grows memory by design).

While records expire as fast as they are made, used_memory holds about rate x
(retention + the sweep gap) records plus the remembered settlements (until the lease
deadline + 5 s) and the capped event stream. Deletion that falls behind shows as
growth: before the sweeps went on while there was more, one worker deleted about 200
records/s and memory grew for as long as the load lasted.

Every `--sample-every` seconds: accepted, completed (the worker's
effectmq_outcomes_total, scraped from its --metrics-port), backlog (waiting + active),
completed records, remembered settlements, used_memory. Criteria (exit status 1 when
one is missed):

  kept up            accepted >= 95 % of rate x duration, and the backlog at the last
                     sample under load is under 2 s of offers
  flat memory        every used_memory sample after the first minute (--warmup) within
                     10 % (--tolerance): max <= 1.1 x min
  records expire     after the load, every completed record is gone within
                     retention + 2 maintenance intervals + 5 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import effectmq  # noqa: E402
from bench.soak import TASK, SoakWorker  # noqa: E402

MIB = 1024 * 1024
TICK = 0.05  # seconds between offer_many calls
KEEP_UP_SHARE = 0.95


@dataclass
class Sample:
    t: float  # seconds since the offers started
    phase: str  # load, after
    accepted: int
    completed: int
    backlog: int  # waiting + active
    completed_records: int
    settled_kept: int  # outcomes remembered after their record was deleted
    used_memory: int


@dataclass
class RetentionResult:
    minutes: float
    rate: float
    retention: float
    maintenance_interval: float
    maintenance_batch: int
    concurrency: int
    warmup: float
    tolerance: float
    accepted: int = 0
    offer_errors: int = 0
    max_offer_lag: float = 0.0
    expired_after: float | None = None  # seconds after the load until no completed record was left
    worker_exit: int | None = None
    samples: list = field(default_factory=list)
    log_path: str = ""

    def window(self) -> list[Sample]:
        return [s for s in self.samples if s.phase == "load" and s.t >= self.warmup]

    def criteria(self) -> list[tuple[str, bool, str]]:
        load = [s for s in self.samples if s.phase == "load"]
        window = self.window()
        wanted = self.rate * self.minutes * 60
        last = load[-1] if load else None
        kept_up = (self.accepted >= KEEP_UP_SHARE * wanted and last is not None
                   and last.backlog < 2 * self.rate and self.offer_errors == 0)
        lo = min((s.used_memory for s in window), default=0)
        hi = max((s.used_memory for s in window), default=0)
        flat = bool(window) and hi <= (1 + self.tolerance) * lo
        grace = self.retention + 2 * self.maintenance_interval + 5
        return [
            ("kept up", kept_up,
             f"accepted {self.accepted} of {wanted:.0f} ({self.accepted / max(wanted, 1):.1%}), offer errors "
             f"{self.offer_errors}, max lag {self.max_offer_lag * 1000:.0f} ms, backlog at the last sample "
             f"{last.backlog if last else '?'}"),
            (f"flat memory (within {self.tolerance:.0%} after {self.warmup:.0f} s)", flat,
             f"{len(window)} samples: min {lo / MIB:.1f} MiB, max {hi / MIB:.1f} MiB "
             f"({(hi / lo - 1) if lo else float('nan'):+.1%}); first {window[0].used_memory / MIB:.1f} MiB, "
             f"last {window[-1].used_memory / MIB:.1f} MiB" if window else "no samples after the warm-up"),
            ("records expire", self.expired_after is not None,
             f"no completed record left {self.expired_after:.1f} s after the load" if self.expired_after is not None
             else f"completed records still there {grace:.0f} s after the load"),
        ]

    @property
    def ok(self) -> bool:
        return all(met for _, met, _ in self.criteria()) and self.worker_exit == 0

    def to_json(self) -> dict:
        out = asdict(self)
        out["criteria"] = [{"criterion": c, "met": m, "figures": f} for c, m, f in self.criteria()]
        return out


async def run(url: str, *, minutes: float = 5.0, rate: float = 2000.0, retention: float = 10.0,
              maintenance_interval: float = 5.0, maintenance_batch: int = 100, concurrency: int = 50,
              warmup: float = 60.0, tolerance: float = 0.10, sample_every: float = 5.0,
              payload_bytes: int = 100, progress=None) -> RetentionResult:
    """Offer `rate` tasks/s for `minutes` through one worker process; sample memory; return the figures."""
    result = RetentionResult(minutes, rate, retention, maintenance_interval, maintenance_batch, concurrency,
                             warmup, tolerance)
    queue_name = f"retention-{secrets.token_hex(4)}"
    q = effectmq.TaskQueue(queue_name, url=url)
    await q.configure(retention_completed=retention)
    payload = {"data": "x" * max(0, payload_bytes - 11)}
    log_dir = Path(tempfile.mkdtemp(prefix="effectmq-retention-"))
    worker = SoakWorker(url, queue_name, log_dir, concurrency=concurrency, maintenance_interval=maintenance_interval,
                        extra_args=("--maintenance-batch", str(maintenance_batch)))
    result.log_path = str(worker.log_path)
    loop = asyncio.get_running_loop()
    seconds = minutes * 60
    try:
        await worker.ready()
        t0 = loop.time()

        async def produce() -> None:
            sent = 0
            total = int(rate * seconds)
            while sent < total:
                due = t0 + sent / rate
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    result.max_offer_lag = max(result.max_offer_lag, -delay)
                # Everything due by the next tick: the schedule holds even when a call is slow.
                n = min(total - sent, max(1, int((loop.time() - t0 + TICK) * rate) - sent))
                try:
                    offered = await q.offer_many((TASK, payload) for _ in range(n))
                    result.accepted += sum(o.created for o in offered)
                except Exception:  # counted: the criterion fails on any
                    result.offer_errors += 1
                sent += n

        async def sample(phase: str) -> Sample:
            outcomes = await asyncio.to_thread(worker.outcomes)
            stats = await q.stats()
            memory = await q.redis.info("memory")
            settled = await q.redis.zcard(q.keys.key("settled"))
            s = Sample(round(loop.time() - t0, 1), phase, result.accepted, outcomes.get("completed", 0),
                       stats.waiting + stats.active, stats.completed, settled, int(memory["used_memory"]))
            result.samples.append(s)
            if progress:
                progress(s)
            return s

        producing = asyncio.create_task(produce())
        next_sample = sample_every
        while not producing.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(producing), max(0.0, t0 + next_sample - loop.time()))
            if not producing.done():
                await sample("load")
                next_sample += sample_every
        await producing
        await sample("load")

        ended = loop.time()
        grace = retention + 2 * maintenance_interval + 5
        while loop.time() - ended < grace:
            await asyncio.sleep(1.0)
            s = await sample("after")
            if s.backlog == 0 and s.completed_records == 0:
                result.expired_after = loop.time() - ended
                break
    finally:
        result.worker_exit = await asyncio.to_thread(worker.stop)
        with contextlib.suppress(Exception):
            await q.close()
    return result


HEADER = (f"{'t s':>7} {'phase':<6} {'accepted':>9} {'completed':>9} {'backlog':>7} {'done rec':>8} "
          f"{'settled':>7} {'used_memory MiB':>15}")


def sample_row(s: Sample) -> str:
    return (f"{s.t:>7.1f} {s.phase:<6} {s.accepted:>9} {s.completed:>9} {s.backlog:>7} {s.completed_records:>8} "
            f"{s.settled_kept:>7} {s.used_memory / MIB:>15.2f}")


def report(r: RetentionResult) -> str:
    lines = [
        "",
        f"retention: {r.minutes:g} min at {r.rate:.0f} tasks/s, retention_completed {r.retention:g} s, 1 worker "
        f"process (concurrency {r.concurrency}, maintenance interval {r.maintenance_interval:g} s, batch "
        f"{r.maintenance_batch}), {os.cpu_count()} cores",
        "",
        "criteria",
        *(f"  {name:<40} {'met' if met else 'MISSED':<7} {figures}" for name, met, figures in r.criteria()),
        f"  worker exit {r.worker_exit}",
        "",
        f"worker log: {r.log_path}",
        f"verdict: {'PASS' if r.ok else 'FAIL'}",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="use this Redis instead of a private redis-server")
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to offer (default 5)")
    parser.add_argument("--rate", type=float, default=2000.0, help="tasks offered per second (default 2000)")
    parser.add_argument("--retention", type=float, default=10.0, help="retention_completed, seconds (default 10)")
    parser.add_argument("--maintenance-interval", type=float, default=5.0,
                        help="worker --maintenance-interval (default 5, the worker's own)")
    parser.add_argument("--maintenance-batch", type=int, default=100,
                        help="worker --maintenance-batch (default 100, the worker's own)")
    parser.add_argument("--concurrency", type=int, default=50, help="worker --concurrency (default 50)")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before memory must be flat (default 60)")
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed max/min - 1 (default 0.10)")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples (default 5)")
    parser.add_argument("--payload-bytes", type=int, default=100, help="payload size (default 100)")
    parser.add_argument("--json", type=Path, help="also write the figures and samples to this file")
    args = parser.parse_args()

    from bench._redis import private_redis

    print(HEADER, flush=True)
    started = time.monotonic()
    with private_redis(args.url) as url:
        result = asyncio.run(run(
            url, minutes=args.minutes, rate=args.rate, retention=args.retention,
            maintenance_interval=args.maintenance_interval, maintenance_batch=args.maintenance_batch,
            concurrency=args.concurrency, warmup=args.warmup, tolerance=args.tolerance,
            sample_every=args.sample_every, payload_bytes=args.payload_bytes,
            progress=lambda s: print(sample_row(s), flush=True)))
    print(report(result))
    print(f"ran {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=2, default=str))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
