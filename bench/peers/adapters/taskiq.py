"""taskiq with taskiq-redis's RedisStreamBroker (XREADGROUP / XACK), `taskiq worker`.

Acks after the handler (--ack-type when_executed), no result backend (results off),
--max-async-tasks = the in-flight budget. Option `xread_count` (default taskiq-redis's
100) is how many messages one XREADGROUP claims: with 100 a process holds up to
100 claimed messages while running 10, so the `x10` variant sets it to the budget.
The consumer group starts at id 0, so messages offered before the first worker
starts are delivered (taskiq-redis's default "$" would skip the prefill).
"""

from __future__ import annotations

from redis.asyncio import Redis
from taskiq_redis import RedisStreamBroker

from bench.peers import work
from bench.peers.adapters.base import Adapter as Base, Settings, bin_path, gather_chunked

S = Settings.from_env()
broker = RedisStreamBroker(S.url, queue_name=S.queue, consumer_id="0",
                           xread_count=S.options.get("xread_count", 100))


@broker.task(task_name="noop")
async def noop(i: int) -> None:
    await work.run_async(i)


class Adapter(Base):
    distributions = ("taskiq", "taskiq-redis", "redis", "hiredis")
    bulk_way = "task.kiq() in asyncio.gather (taskiq has no bulk call)"

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.redis = Redis.from_url(settings.url)
        self.started = False

    def worker_command(self, slot: int) -> list[str]:
        return [bin_path("taskiq"), "worker", "bench.peers.adapters.taskiq:broker", "--workers", "1",
                "--max-async-tasks", str(self.s.concurrency), "--ack-type", "when_executed",
                "--log-level", "WARNING"]

    async def setup(self) -> None:
        await broker.startup()  # declares the consumer group

    async def prefill(self, numbers: range) -> None:
        await gather_chunked(noop.kiq(i) for i in numbers)

    async def offer(self, i: int) -> None:
        await noop.kiq(i)

    async def drained(self) -> bool:
        groups = await self.redis.xinfo_groups(self.s.queue)
        return all(g["pending"] == 0 and (g.get("lag") or 0) == 0 for g in groups)

    async def close(self) -> None:
        await broker.shutdown()
        await self.redis.aclose()

    def options_summary(self) -> dict:
        return {"max_async_tasks": self.s.concurrency, "ack_type": "when_executed", "result_backend": None,
                "xread_count": S.options.get("xread_count", 100), "workers_per_command": 1}
