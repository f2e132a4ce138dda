"""BullMQ's Python port. It has no worker command: each worker process is this module
run with `python -m` (a `bullmq.Worker` until SIGTERM).

concurrency = the in-flight budget; removeOnComplete=True (results off). BullMQ
needs Redis >= 5.0 and recommends >= 6.2; the harness checks the server version.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from bullmq import Queue, Worker

from bench.peers import work
from bench.peers.adapters.base import BULK, Adapter as Base, Settings

S = Settings.from_env()
JOB_OPTS = {"removeOnComplete": True, "removeOnFail": 1000}


async def process(job, token):
    await work.run_async(job.data["i"])


async def run_worker() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = Worker(S.queue, process, {"connection": S.url, "concurrency": S.concurrency,
                                       "removeOnComplete": True})
    await stop.wait()
    await worker.close()


class Adapter(Base):
    distributions = ("bullmq", "redis", "hiredis")
    bulk_way = "Queue.addBulk"

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.queue = Queue(settings.queue, {"connection": settings.url})

    def worker_command(self, slot: int) -> list[str]:
        return [sys.executable, "-m", "bench.peers.adapters.bullmq"]

    async def prefill(self, numbers: range) -> None:
        jobs = [{"name": "noop", "data": {"i": i}, "opts": JOB_OPTS} for i in numbers]
        for start in range(0, len(jobs), BULK):
            await self.queue.addBulk(jobs[start:start + BULK])

    async def offer(self, i: int) -> None:
        await self.queue.add("noop", {"i": i}, JOB_OPTS)

    async def drained(self) -> bool:
        counts = await self.queue.getJobCounts("wait", "active", "delayed", "prioritized", "paused")
        return not any(counts.values())

    async def close(self) -> None:
        await self.queue.close()

    def options_summary(self) -> dict:
        return {"concurrency": self.s.concurrency, "removeOnComplete": True}


if __name__ == "__main__":
    asyncio.run(run_worker())
