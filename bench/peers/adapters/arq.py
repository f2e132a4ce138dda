"""arq, `arq module.WorkerSettings`.

max_jobs = the in-flight budget, keep_result=0 (results off). Option `poll_delay`:
arq polls the queue (no blocking pop), every 0.5 s by default; the `50ms` variant
polls every 50 ms. arq logs every job at INFO from its CLI; the worker lowers that
to WARNING on startup like the other libraries' workers.
"""

from __future__ import annotations

import logging

from arq.connections import RedisSettings, create_pool
from arq.constants import in_progress_key_prefix

from bench.peers import work
from bench.peers.adapters.base import Adapter as Base, Settings, bin_path, gather_chunked

S = Settings.from_env()
POLL = S.options.get("poll_delay", 0.5)


async def noop(ctx, i: int) -> None:
    await work.run_async(i, ctx["redis"])  # arq hands handlers its own client


async def quiet(ctx) -> None:
    logging.getLogger("arq").setLevel(logging.WARNING)


class WorkerSettings:
    functions = [noop]
    redis_settings = RedisSettings.from_dsn(S.url)
    queue_name = S.queue
    max_jobs = S.concurrency
    keep_result = 0
    poll_delay = POLL
    on_startup = quiet


class Adapter(Base):
    distributions = ("arq", "redis", "hiredis")
    bulk_way = "ArqRedis.enqueue_job in asyncio.gather (arq has no bulk call)"

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.pool = None

    def worker_command(self, slot: int) -> list[str]:
        return [bin_path("arq"), "bench.peers.adapters.arq.WorkerSettings"]

    async def setup(self) -> None:
        self.pool = await create_pool(RedisSettings.from_dsn(self.s.url), default_queue_name=self.s.queue)

    async def prefill(self, numbers: range) -> None:
        await gather_chunked(self.pool.enqueue_job("noop", i) for i in numbers)

    async def offer(self, i: int) -> None:
        await self.pool.enqueue_job("noop", i)

    async def drained(self) -> bool:
        if await self.pool.zcard(self.s.queue):
            return False
        return not await self.pool.keys(in_progress_key_prefix + "*")

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()

    def options_summary(self) -> dict:
        return {"max_jobs": self.s.concurrency, "keep_result": 0, "poll_delay": POLL}
