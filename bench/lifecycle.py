"""Throughput and latency of the task lifecycle: offer -> acquire -> complete.

    python bench/lifecycle.py                 # private redis-server, all combinations
    python bench/lifecycle.py --tasks 20000 --url redis://127.0.0.1:6379/0

Engine: `concurrency` coroutines each run offer, acquire and complete in a loop;
latency is one such cycle. Worker: a full `effectmq.Worker` (heartbeats and
maintenance on, no-op handler) drains a prefilled queue. Redis commands per task
come from INFO commandstats (round trips are the EVALSHA calls; the total
includes the commands the scripts run inside Redis).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

import effectmq
from bench._redis import calls_delta, command_calls, private_redis


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


async def engine_run(url: str, concurrency: int, size: int, tasks: int) -> dict:
    q = effectmq.TaskQueue(f"bench-{concurrency}-{size}", url=url, retention_completed=0,
                           max_connections=concurrency + 4)
    await q.configure(events_maxlen=1000)
    payload = {"data": "x" * max(0, size - 11)}  # ~`size` bytes of JSON
    latencies: list[float] = []
    remaining = tasks

    async def loop() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            await q.offer("noop", payload)
            lease = await q.acquire()
            if lease is not None:
                await lease.complete(None)
            latencies.append(time.perf_counter() - start)

    await q.ping()
    sync = redis.Redis.from_url(url)
    before = command_calls(sync)
    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    delta = calls_delta(before, command_calls(sync))
    stats = await q.stats()
    assert stats.waiting == 0 and stats.active == 0, stats
    await q.close()
    latencies.sort()
    return {
        "mode": "engine", "concurrency": concurrency, "payload_bytes": size, "tasks": tasks,
        "tasks_per_s": tasks / elapsed,
        "p50_ms": percentile(latencies, 50) * 1000, "p95_ms": percentile(latencies, 95) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "round_trips_per_task": delta.get("evalsha", 0) / tasks,
        "redis_commands_per_task": (sum(delta.values()) - delta.get("info", 0)) / tasks,
    }


async def worker_run(url: str, concurrency: int, size: int, tasks: int) -> dict:
    q = effectmq.TaskQueue(f"bench-worker-{size}", url=url, retention_completed=0, max_connections=64)
    await q.configure(events_maxlen=1000)
    payload = {"data": "x" * max(0, size - 11)}
    for i in range(0, tasks, 500):
        await q.offer_many([("noop", payload)] * min(500, tasks - i))
    done = asyncio.Event()
    count = 0

    async def noop(_payload):
        nonlocal count
        count += 1
        if count >= tasks:
            done.set()

    worker = effectmq.Worker(q, {"noop": noop}, concurrency=concurrency, install_signal_handlers=False,
                             lock_timeout=30)
    sync = redis.Redis.from_url(url)
    before = command_calls(sync)
    start = time.perf_counter()
    runner = asyncio.create_task(worker.run())
    await done.wait()
    while (await q.stats()).active:  # the last acknowledgements
        await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - start
    delta = calls_delta(before, command_calls(sync))
    worker.stop()
    await runner
    stats = await q.stats()
    assert stats.waiting == 0 and stats.active == 0 and count == tasks, (stats, count)
    await q.close()
    return {
        "mode": "worker", "concurrency": concurrency, "payload_bytes": size, "tasks": tasks,
        "tasks_per_s": tasks / elapsed,
        "round_trips_per_task": delta.get("evalsha", 0) / tasks,
        "redis_commands_per_task": (sum(delta.values()) - delta.get("info", 0)) / tasks,
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'mode':<7} {'conc':>4} {'payload':>7} {'tasks/s':>9} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} "
          f"{'RTT/task':>8} {'cmds/task':>9}")
    for r in rows:
        print(f"{r['mode']:<7} {r['concurrency']:>4} {r['payload_bytes']:>7} {r['tasks_per_s']:>9.0f} "
              f"{r.get('p50_ms', float('nan')):>7.2f} {r.get('p95_ms', float('nan')):>7.2f} "
              f"{r.get('p99_ms', float('nan')):>7.2f} {r['round_trips_per_task']:>8.2f} "
              f"{r['redis_commands_per_task']:>9.1f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use this Redis instead of a private redis-server")
    parser.add_argument("--tasks", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--worker-concurrency", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    with private_redis(args.url) as url:
        for size in args.sizes:
            for conc in args.concurrency:
                rows.append(await engine_run(url, conc, size, args.tasks if conc > 1 else args.tasks // 4))
        for size in args.sizes:
            rows.append(await worker_run(url, args.worker_concurrency, size, args.tasks))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
