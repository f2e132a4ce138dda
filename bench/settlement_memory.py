"""Redis memory held for resent acknowledgements after records are deleted (retention 0).

    python bench/settlement_memory.py                  # 20,000 tasks, calls of 10
    python bench/settlement_memory.py --tasks 50000 --k 1 10 50

A record kept for 0 s is deleted when its task completes, but a worker whose reply was
lost sends the acknowledgement again, and must get "completed", not "lease lost". So
the settlement is remembered until the lease's deadline plus a slack (35 s with the
default 30 s lease). This drains `--tasks` no-op tasks through complete_and_acquire in
calls of k completions and k leases against a private redis-server, then reports
used_memory still held per completed task, and what holds it: settled markers (one
sorted-set entry per token, removed later by maintenance) or receipts (one string key
per call, which expires by itself). Run it from a checkout of an older commit to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import effectmq
from bench._redis import private_client


async def held_per_task(client, tasks: int, k: int) -> tuple[float, int, int]:
    await client.flushall()
    q = effectmq.TaskQueue("settlement-memory", redis=client, retention_completed=0)
    await q.offer("warm", None)  # the queue's own keys exist before the baseline
    lease = await q.acquire()
    await lease.complete(None)
    base = (await client.info("memory"))["used_memory"]
    for start in range(0, tasks, 500):
        await q.offer_many([("t", i) for i in range(start, min(tasks, start + 500))])
    leases: list = []
    while len(leases) < k:
        more, _ = await q.acquire_many(k - len(leases))
        leases += more
    done = 0
    while leases:
        _, following = await q.engine.complete_and_acquire([(x, "null") for x in leases], k)
        done += len(leases)
        leases = following
    held = (await client.info("memory"))["used_memory"] - base
    markers = await client.zcard(q.keys.key("settled"))
    receipts = len([key async for key in client.scan_iter(match=q.keys.key("r:*"), count=1000)])
    return held / done, markers, receipts


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--k", type=int, nargs="+", default=[10], help="completions and leases per call")
    args = parser.parse_args()
    async with private_client() as client:
        for k in args.k:
            per_task, markers, receipts = await held_per_task(client, args.tasks, k)
            print(f"k={k:3d}: {per_task:6.0f} B held per completed task; settled markers {markers:,}, "
                  f"receipts {receipts:,}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
