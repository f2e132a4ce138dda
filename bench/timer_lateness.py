"""How close to the ideal one worker process runs 10 ms handlers, by loop and prefetch.

    python bench/timer_lateness.py                  # 6,000 jobs, concurrency 10, 2 rounds
    python bench/timer_lateness.py --jobs 20000 --rounds 3

One in-process Worker (a private redis-server) runs `asyncio.sleep(0.01)` handlers on
asyncio's own loop and on the worker's default loop (effectmq.eventloop.loops.precise_event_loop),
with prefetch 0 and auto. The ideal is concurrency / 10 ms. "sleep" is how long the
handler's 10 ms sleep took: what is left of a slot's time beyond it is the wait for the
next task (a round trip without prefetch).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import effectmq
from bench._redis import private_redis
from effectmq.eventloop.loops import precise_event_loop

HANDLER_SECONDS = 0.01


async def one_run(url: str, jobs: int, concurrency: int, prefetch: int | None) -> tuple[float, float]:
    """jobs/s from the first handler start to the last, and the mean sleep (seconds)."""
    starts: list[float] = []
    sleeps: list[float] = []

    async def job(payload):
        start = time.perf_counter()
        starts.append(start)
        await asyncio.sleep(HANDLER_SECONDS)
        sleeps.append(time.perf_counter() - start)

    q = effectmq.TaskQueue(f"lateness-{time.monotonic_ns()}", url=url)
    await q.configure(retention_completed=0)
    for first in range(0, jobs, 500):
        await q.offer_many([("job", i) for i in range(first, min(jobs, first + 500))])
    worker = effectmq.Worker(q, {"job": job}, concurrency=concurrency, prefetch=prefetch,
                             install_signal_handlers=False, loop_block_warning=None)
    running = asyncio.create_task(worker.run())
    while len(sleeps) < jobs:
        await asyncio.sleep(0.05)
    worker.stop()
    await running
    await q.close()
    return (jobs - 1) / (max(starts) - min(starts)), statistics.mean(sleeps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--url", help="an existing Redis (default: a private redis-server)")
    args = parser.parse_args()
    ideal = args.concurrency / HANDLER_SECONDS
    loops = {"asyncio's own": asyncio.new_event_loop, "precise (default)": precise_event_loop}
    print(f"{args.jobs} jobs of asyncio.sleep({HANDLER_SECONDS}), concurrency {args.concurrency}, "
          f"ideal {ideal:,.0f} jobs/s; median of {args.rounds} rounds")
    print(f"{'loop':<20}{'prefetch':>9}{'jobs/s':>9}{'of ideal':>10}{'sleep ms':>10}")
    with private_redis(args.url) as url:
        for label, factory in loops.items():
            for prefetch in (0, None):
                rounds = []
                for _ in range(args.rounds):
                    with asyncio.Runner(loop_factory=factory) as runner:
                        rounds.append(runner.run(one_run(url, args.jobs, args.concurrency, prefetch)))
                rate = statistics.median(r[0] for r in rounds)
                sleep = statistics.median(r[1] for r in rounds)
                print(f"{label:<20}{'auto' if prefetch is None else prefetch:>9}{rate:>9,.0f}"
                      f"{rate / ideal:>10.1%}{sleep * 1e3:>10.2f}")


if __name__ == "__main__":
    main()
