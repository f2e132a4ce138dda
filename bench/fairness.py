"""Task groups: a small group next to a large backlog, and many groups at once.

    python bench/fairness.py                          # both parts, 2 worker processes x 4 = 8 handlers
    python bench/fairness.py --part large-small --backlog 100000 --small 20 --task-ms 5
    python bench/fairness.py --part many --groups 1000 --per-group 100
    python bench/fairness.py --no-groups --part large-small   # the same tasks without groups
    python bench/fairness.py --url redis://127.0.0.1:6379/0 --json /tmp/fairness.json

A private redis-server is started (unless --url is given), then `--workers` worker
processes, `python -m effectmq worker bench._fairness_handlers:app --concurrency N`
(`--concurrency`): workers x concurrency handlers run at once. Each task sleeps
`--task-ms` milliseconds (0: returns at once). Times are Redis time (a task's
finished_at), in seconds from the moment named.

large-small  group A offers `--backlog` tasks; once the workers have completed
             `--warmup` of them, group B offers `--small` tasks. Reported: the seconds
             until all of B's tasks completed, how many of A's completed meanwhile, and
             A's throughput before and while B's ran (tasks/s).
many         `--groups` groups offer `--per-group` tasks each, one group after the
             other (one offer_many each), then the workers start. Reported: per group,
             the seconds from the workers' start until its last task completed: the
             first and last group's, the median and 99th percentile, and the throughput
             over all tasks (tasks/s).
With --no-groups the tasks carry no group (a plain FIFO queue), for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import effectmq  # noqa: E402
from bench._redis import private_redis  # noqa: E402

HANDLERS = "bench._fairness_handlers:app"
TASK = "work"
OFFER_BATCH = 5000
POLL = 0.02  # seconds between looks at the counts


@dataclass
class LargeSmall:
    backlog: int
    small: int
    grouped: bool
    small_done_s: float  # from B's offer until its last task completed
    a_completed_meanwhile: int
    a_rate_before: float  # tasks/s over the warmup
    a_rate_during: float  # tasks/s while B's tasks ran
    a_waiting_after: int  # A's tasks still waiting when B's were done


@dataclass
class Many:
    groups: int
    per_group: int
    grouped: bool
    first_group_s: float
    last_group_s: float
    p50_group_s: float
    p99_group_s: float
    all_done_s: float
    rate: float  # tasks/s over all of them


@dataclass
class FairnessResult:
    workers: int
    concurrency: int
    task_ms: float
    large_small: LargeSmall | None = None
    many: Many | None = None
    notes: list[str] = field(default_factory=list)


class Workers:
    """`count` worker processes of HANDLERS on `queue`, logging to files in `log_dir`."""

    def __init__(self, url: str, queue: str, log_dir: Path, *, count: int, concurrency: int):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1", "EFFECTMQ_REDIS_URL": url}
        self.logs = [log_dir / f"worker-{queue}-{n}.log" for n in range(count)]
        self.procs = [subprocess.Popen([sys.executable, "-m", "effectmq", "worker", HANDLERS, "--queue", queue,
                                        "--concurrency", str(concurrency)], env=env, cwd=ROOT,
                                       stdout=open(log, "ab"), stderr=subprocess.STDOUT) for log in self.logs]

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def redis_ms(q: effectmq.TaskQueue) -> int:
    seconds, micros = await q.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def finished_ms(q: effectmq.TaskQueue, ids: list[str]) -> list[int | None]:
    """Each task's finished_at (ms), None while it has not finished."""
    out: list[int | None] = []
    for start in range(0, len(ids), OFFER_BATCH):
        async with q.redis.pipeline(transaction=False) as pipe:
            for task_id in ids[start:start + OFFER_BATCH]:
                pipe.hget(q.keys.task(task_id), "finished_at")
            out += [int(v) if v else None for v in await pipe.execute()]
    return out


async def offer(q: effectmq.TaskQueue, ids: list[str], group: str | None, task_ms: float) -> None:
    options = {"group": group} if group else {}
    for start in range(0, len(ids), OFFER_BATCH):
        await q.offer_many([(TASK, {"ms": task_ms} if task_ms else None, {"task_id": i, **options})
                            for i in ids[start:start + OFFER_BATCH]])


async def completed(q: effectmq.TaskQueue) -> int:
    return int(await q.redis.zcard(q.keys.key("completed")))


async def large_small(url: str, log_dir: Path, *, backlog: int, small: int, warmup: int, workers: int,
                      concurrency: int, task_ms: float, grouped: bool, timeout: float) -> LargeSmall:
    q = effectmq.TaskQueue(f"fair-ls-{time.time_ns()}", url=url)
    try:
        await q.configure(retention_completed=3600)
        a_ids, b_ids = [f"a{i}" for i in range(backlog)], [f"b{i}" for i in range(small)]
        await offer(q, a_ids, "a" if grouped else None, task_ms)
        procs = Workers(url, q.name, log_dir, count=workers, concurrency=concurrency)
        try:
            deadline = time.monotonic() + timeout
            while (done := await completed(q)) < 1:  # the workers are up
                if time.monotonic() > deadline:
                    raise SystemExit(f"no task completed within {timeout}s; see {procs.logs[0]}")
                await asyncio.sleep(POLL)
            started_ms, started_done = await redis_ms(q), done
            while (done := await completed(q)) < started_done + warmup:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the warmup did not end within {timeout}s")
                await asyncio.sleep(POLL)
            offered_ms, done_before = await redis_ms(q), done
            await offer(q, b_ids, "b" if grouped else None, task_ms)
            while True:
                b_done = await finished_ms(q, b_ids)
                if all(b_done):
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"B's tasks were not all done within {timeout}s")
                await asyncio.sleep(POLL)
            a_waiting = int(await q.redis.zcard(q.keys.key("waiting")))  # B's are done: all A's
            last_b = max(ms for ms in b_done if ms)
            a_done = await finished_ms(q, a_ids)
            meanwhile = sum(1 for ms in a_done if ms and offered_ms <= ms <= last_b)
        finally:
            procs.stop()
        during = max(last_b - offered_ms, 1) / 1000
        return LargeSmall(backlog, small, grouped, round((last_b - offered_ms) / 1000, 3), meanwhile,
                          round((done_before - started_done) / max((offered_ms - started_ms) / 1000, 1e-3), 1),
                          round(meanwhile / during, 1), a_waiting)
    finally:
        await q.close()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def many_groups(url: str, log_dir: Path, *, groups: int, per_group: int, workers: int, concurrency: int,
                      task_ms: float, grouped: bool, timeout: float) -> Many:
    q = effectmq.TaskQueue(f"fair-many-{time.time_ns()}", url=url)
    try:
        await q.configure(retention_completed=3600)
        ids = {g: [f"g{g}-{i}" for i in range(per_group)] for g in range(groups)}
        for g, group_ids in ids.items():
            await offer(q, group_ids, f"g{g}" if grouped else None, task_ms)
        start_ms = await redis_ms(q)
        procs = Workers(url, q.name, log_dir, count=workers, concurrency=concurrency)
        try:
            deadline = time.monotonic() + timeout
            while await completed(q) < groups * per_group:
                if time.monotonic() > deadline:
                    raise SystemExit(f"not all {groups * per_group} tasks were done within {timeout}s")
                await asyncio.sleep(0.2)
        finally:
            procs.stop()
        done = await finished_ms(q, [i for group_ids in ids.values() for i in group_ids])
        per = [max(ms or 0 for ms in done[g * per_group:(g + 1) * per_group]) for g in range(groups)]
        first_done = min(ms or 0 for ms in done)
        seconds = [(ms - start_ms) / 1000 for ms in per]
        total = (max(per) - first_done) / 1000
        return Many(groups, per_group, grouped, round(min(seconds), 3), round(max(seconds), 3),
                    round(statistics.median(seconds), 3), round(percentile(seconds, 0.99), 3),
                    round(max(seconds), 3), round(groups * per_group / max(total, 1e-3), 1))
    finally:
        await q.close()


async def run(url: str, args: argparse.Namespace) -> FairnessResult:
    result = FairnessResult(args.workers, args.concurrency, args.task_ms)
    with tempfile.TemporaryDirectory(prefix="effectmq-fairness-") as tmp:
        if args.part in ("all", "large-small"):
            result.large_small = await large_small(
                url, Path(tmp), backlog=args.backlog, small=args.small, warmup=args.warmup, workers=args.workers,
                concurrency=args.concurrency, task_ms=args.task_ms, grouped=not args.no_groups, timeout=args.timeout)
        if args.part in ("all", "many"):
            result.many = await many_groups(
                url, Path(tmp), groups=args.groups, per_group=args.per_group, workers=args.workers,
                concurrency=args.concurrency, task_ms=args.task_ms, grouped=not args.no_groups, timeout=args.timeout)
    return result


def report(result: FairnessResult) -> str:
    lines = [f"{result.workers} worker processes x concurrency {result.concurrency}, tasks of {result.task_ms} ms"]
    if (ls := result.large_small) is not None:
        lines.append(f"large-small ({'grouped' if ls.grouped else 'no groups'}): A {ls.backlog:,} waiting, B offers "
                     f"{ls.small}: B done in {ls.small_done_s:.3f} s; A completed {ls.a_completed_meanwhile} "
                     f"meanwhile; A {ls.a_rate_before:,.0f}/s before, {ls.a_rate_during:,.0f}/s during; "
                     f"A still waiting {ls.a_waiting_after:,}")
    if (m := result.many) is not None:
        lines.append(f"many ({'grouped' if m.grouped else 'no groups'}): {m.groups:,} groups x {m.per_group}: "
                     f"group done after first {m.first_group_s:.2f} s, p50 {m.p50_group_s:.2f} s, "
                     f"p99 {m.p99_group_s:.2f} s, last {m.last_group_s:.2f} s; {m.rate:,.0f} tasks/s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("all", "large-small", "many"), default="all")
    parser.add_argument("--url", help="an existing Redis (default: a private redis-server)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=4, help="handlers per worker process")
    parser.add_argument("--task-ms", type=float, default=0, help="each task sleeps this long")
    parser.add_argument("--backlog", type=int, default=100_000, help="large-small: group A's tasks")
    parser.add_argument("--small", type=int, default=20, help="large-small: group B's tasks")
    parser.add_argument("--warmup", type=int, default=2000, help="large-small: A's tasks done before B offers")
    parser.add_argument("--groups", type=int, default=1000, help="many: groups")
    parser.add_argument("--per-group", type=int, default=100, help="many: tasks per group")
    parser.add_argument("--no-groups", action="store_true", help="offer the same tasks without groups")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a part may take")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    with private_redis(args.url) as url:
        result = asyncio.run(run(url, args))
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(result), indent=2))


if __name__ == "__main__":
    main()
