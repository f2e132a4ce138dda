"""SAQ (Redis queue), `saq module.settings --workers 1`.

concurrency = the in-flight budget; jobs are enqueued with ttl=-1 (SAQ stores no
job record or result after completion: results off). Other settings are SAQ's
defaults (job timeout 10 s, sweeps every 60 s).
"""

from __future__ import annotations

from saq import Queue

from bench.peers import work
from bench.peers.adapters.base import Adapter as Base, Settings, bin_path, gather_chunked

S = Settings.from_env()
queue = Queue.from_url(S.url, name=S.queue)


async def noop(ctx, *, i: int) -> None:
    await work.run_async(i)


settings = {"queue": queue, "functions": [noop], "concurrency": S.concurrency}


class Adapter(Base):
    distributions = ("saq", "redis", "hiredis")
    bulk_way = "Queue.enqueue in asyncio.gather (saq 0.26 has no bulk enqueue)"

    def worker_command(self, slot: int) -> list[str]:
        return [bin_path("saq"), "bench.peers.adapters.saq.settings", "--workers", "1"]

    async def setup(self) -> None:
        await queue.connect()

    async def prefill(self, numbers: range) -> None:
        await gather_chunked(queue.enqueue("noop", i=i, ttl=-1) for i in numbers)

    async def offer(self, i: int) -> None:
        await queue.enqueue("noop", i=i, ttl=-1)

    async def drained(self) -> bool:
        return await queue.count("queued") == 0 and await queue.count("active") == 0

    async def close(self) -> None:
        await queue.disconnect()

    def options_summary(self) -> dict:
        return {"concurrency": self.s.concurrency, "ttl": -1, "workers_per_command": 1}
