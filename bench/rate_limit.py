"""A queue's rate limit across worker processes: how close it keeps to the limit, and that
no window of the period ever holds more.

    python bench/rate_limit.py                        # 100 per 1 s, 4 processes, 60 s
    python bench/rate_limit.py --mode per-minute      # 5 per 60 s, 4 processes, 180 s
    python bench/rate_limit.py --tasks 20 --period 0.5 --seconds 5 --workers 2
    python bench/rate_limit.py --group-rate           # the same limit on one task group

Starts `--workers` processes of `python -m effectmq worker bench._rate_handlers:app` on
a private redis-server (or `--url`), waits until each has announced itself, configures
the queue's rate_limit=(tasks, period), offers a backlog larger than the run can start,
and lets them work for `--seconds` after the first start. Then it reads two records of
every start: the lease start time Redis wrote into each task (started_at, Redis time:
what the limit counts) and the handler start time each process wrote to a side file
(wall clock: what a downstream service sees). For each it reports the most starts in
any sliding window of the period and the starts within `--seconds` of the first one,
against tasks * seconds / period.

A handler starts a little after its lease (the reply's way back, the event loop: D at
most), and by a different delay each time. The script makes each start count for its
period plus a guard of 1 % of it (at most 20 ms, protocol.RATE_GUARD), so that bursts
(a backlog: `tasks` at once each period) reach the handlers a period apart too; a delay
longer than the guard can still put a window of handler starts over the limit. What
holds whatever the delays is the lease windows' bound shifted by D: no window of
`period - D` holds more than `tasks` handler starts; the report shows D and that count.

With --group-rate the limit is one group's (configure_group("limited", rate_limit=...)),
not the queue's: the backlog is that group's, beside a group "free" of FREE_TASKS tasks
without a limit offered first, whose starts per second the report shows (the limited
group must not slow it). Acquire parks the limited group's picks at its limit and hands
them back when its window allows (lua/includes/group_caps.lua); workers keep prefetching.

Exits 1 unless no window of the lease starts holds more than `tasks` and the total is
within 2 % of the expected one.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import effectmq  # noqa: E402
from bench._redis import private_redis  # noqa: E402
from effectmq.protocol.protocol import RATE_GUARD  # noqa: E402

QUEUE = "bench-rate"
HANDLERS = "bench._rate_handlers:app"
TOLERANCE = 0.02  # of the expected total
MODES = {"per-second": (100, 1.0, 60.0), "per-minute": (5, 60.0, 180.0)}
FREE_TASKS = 20_000  # --group-rate: the unlimited group's tasks


def most_in_a_window(starts: list[float], period: float) -> int:
    """The most of `starts` (sorted) in any window [t, t + period), in the same unit
    (the tests count with it too)."""
    most, first = 0, 0
    for last, at in enumerate(starts):
        while at - starts[first] >= period:
            first += 1
        most = max(most, last - first + 1)
    return most


@dataclass
class Result:
    tasks: int
    period: float
    seconds: float
    workers: int
    lease_starts: list[int]  # Redis time, ms, sorted
    handler_starts: list[int]  # wall clock, ns, sorted
    per_process: dict[str, int]
    delays: list[float]  # ms from each lease start to its handler's start
    free_starts: list[int] | None = None  # --group-rate: the unlimited group's lease starts (Redis ms), sorted

    @property
    def free_rate(self) -> float:
        """The unlimited group's starts per second, from its first start to its last."""
        starts = self.free_starts or []
        return (len(starts) - 1) / max((starts[-1] - starts[0]) / 1000, 0.001) if len(starts) > 1 else 0.0

    @property
    def most_delay(self) -> float:
        return max(self.delays, default=0.0)

    @property
    def handler_most_shifted(self) -> int:
        """The most handler starts in any window of period - D (D: the longest delay)."""
        return most_in_a_window(self.handler_starts, round((self.period * 1000 - self.most_delay) * 1e6))

    @property
    def expected(self) -> int:
        """The starts the limit allows within `seconds` of the first, bursts a span apart."""
        span = self.period + min(math.floor(self.period * 1000 / 100), RATE_GUARD) / 1000
        return math.ceil(self.seconds / span) * self.tasks

    def within(self, starts: list[int], unit: float) -> int:
        """Starts within `seconds` of the first one (`unit`: the starts' ticks per second)."""
        return sum(1 for at in starts if at - starts[0] < self.seconds * unit) if starts else 0

    @property
    def lease_most(self) -> int:
        return most_in_a_window(self.lease_starts, round(self.period * 1000))

    @property
    def handler_most(self) -> int:
        return most_in_a_window(self.handler_starts, round(self.period * 1e9))

    @property
    def ok(self) -> bool:
        total = self.within(self.lease_starts, 1000)
        return self.lease_most <= self.tasks and abs(total - self.expected) <= TOLERANCE * self.expected


def report(r: Result) -> str:
    lease_total, handler_total = r.within(r.lease_starts, 1000), r.within(r.handler_starts, 1e9)
    free = [] if r.free_starts is None else [
        f"group free (no limit):         {len(r.free_starts)} starts at {r.free_rate:,.0f}/s, its last "
        f"{(r.free_starts[-1] - r.lease_starts[0]) / 1000 if r.free_starts and r.lease_starts else 0:.2f} s "
        "after the limited group's first"]
    return "\n".join([
        f"limit {r.tasks} per {r.period:g} s{' on group limited' if r.free_starts is not None else ''}, "
        f"{r.workers} worker processes, {r.seconds:g} s after the first start",
        f"lease starts (Redis time):     most in any {r.period:g} s window {r.lease_most} (limit {r.tasks}), "
        f"{lease_total} within {r.seconds:g} s (expected {r.expected}, {lease_total / r.expected - 1:+.2%})",
        f"handler starts (wall clock):   most in any {r.period:g} s window {r.handler_most}, "
        f"{handler_total} within {r.seconds:g} s",
        f"lease to handler start:        median {sorted(r.delays)[len(r.delays) // 2] if r.delays else 0:.1f} ms, "
        f"at most D = {r.most_delay:.1f} ms; most handler starts in any window of period - D: "
        f"{r.handler_most_shifted}",
        f"starts per process: {', '.join(f'{n}' for n in sorted(r.per_process.values(), reverse=True))}",
        *free,
        "OK" if r.ok else "FAILED: a window held more than the limit, or the total is off by more than 2 %",
    ])


async def run(url: str, *, tasks: int, period: float, seconds: float, workers: int = 4, concurrency: int = 10,
              log_dir: Path | None = None, group_rate: bool = False) -> Result:
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="effectmq-rate-"))
    side = log_dir / "starts"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", "EFFECTMQ_REDIS_URL": url, "EFFECTMQ_BENCH_STARTS": str(side)}
    q = effectmq.TaskQueue(QUEUE, url=url)
    procs: list[subprocess.Popen] = []
    try:
        await q.redis.delete(*[q.keys.key(k) for k in ("waiting", "meta", "starts", "seq", "groups", "group_clock",
                                                        "group_ctl", "backlog", "group_starts", "group_due")])
        if group_rate:
            await q.configure_group("limited", rate_limit=(tasks, period))
        else:
            await q.configure(rate_limit=(tasks, period))
        for i in range(workers):
            log = open(log_dir / f"worker-{i}.log", "ab")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "effectmq", "worker", HANDLERS, "--queue", QUEUE,
                 "--concurrency", str(concurrency)], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while len(await q.workers()) < workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"the workers did not all start; logs in {log_dir}")
            await asyncio.sleep(0.1)
        backlog = math.ceil(seconds / period + 2) * tasks + 100  # more than the run can start
        group = {"group": "limited"} if group_rate else {}
        free = FREE_TASKS if group_rate else 0
        for at in range(0, free, 5000):
            await q.offer_many([("noop", None, {"task_id": f"f{i}", "group": "free"})
                                for i in range(at, min(free, at + 5000))])
        for at in range(0, backlog, 5000):
            await q.offer_many([("noop", None, {"task_id": f"t{i}", **group})
                                for i in range(at, min(backlog, at + 5000))])
        while not await q.redis.exists(q.keys.key("group_starts" if group_rate else "starts")):
            await asyncio.sleep(0.01)
        await asyncio.sleep(seconds + min(period, 5.0))  # past the window that starts `seconds` later
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
    try:
        ids = [f"t{i}" for i in range(backlog)]
        free_ids = [f"f{i}" for i in range(free)]
        async with q.redis.pipeline(transaction=False) as pipe:
            for task_id in ids + free_ids:
                pipe.hget(q.keys.task(task_id), "started_at")
            started = await pipe.execute()
        leased = {task_id: int(s) for task_id, s in zip(ids, started) if s}
        free_starts = sorted(int(s) for s in started[len(ids):] if s) if group_rate else None
        await q.configure(rate_limit=None)
    finally:
        await q.close()
    handled: dict[str, int] = {}
    per_process: dict[str, int] = {}
    for path in log_dir.glob("starts.*"):
        lines = [line.split() for line in path.read_text().splitlines() if line]
        lines = [line for line in lines if line[1].startswith("t")]  # the limited tasks
        per_process[path.suffix[1:]] = len(lines)
        handled.update((task_id, int(at)) for at, task_id in lines)
    delays = [handled[task_id] / 1e6 - at for task_id, at in leased.items() if task_id in handled]
    return Result(tasks, period, seconds, workers, sorted(leased.values()), sorted(handled.values()), per_process,
                  delays, free_starts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="per-second",
                        help="per-second: 100 per 1 s for 60 s; per-minute: 5 per 60 s for 180 s")
    parser.add_argument("--tasks", type=int, help="the limit's tasks (instead of the mode's)")
    parser.add_argument("--period", type=float, help="the limit's period in seconds (instead of the mode's)")
    parser.add_argument("--seconds", type=float, help="how long to run after the first start (instead of the mode's)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=10, help="attempts per worker process")
    parser.add_argument("--url", help="an existing Redis (default: a private redis-server)")
    parser.add_argument("--group-rate", action="store_true",
                        help="limit one task group (beside an unlimited one) instead of the queue")
    args = parser.parse_args()
    tasks, period, seconds = MODES[args.mode]
    with private_redis(args.url) as url:
        result = asyncio.run(run(url, tasks=args.tasks or tasks, period=args.period or period,
                                 seconds=args.seconds or seconds, workers=args.workers,
                                 concurrency=args.concurrency, group_rate=args.group_rate))
    print(report(result))
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
