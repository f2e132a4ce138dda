"""RQ, `rq worker-pool -n <budget>` per worker process slot.

An RQ worker runs one job at a time (forking a child per job), so each of the two
slots is a worker pool of `concurrency` workers: the same 20 jobs in flight.
result_ttl=0 (results off). RQ has no async API: offers run in a thread.
"""

from __future__ import annotations

import asyncio

from redis import Redis
from rq import Queue

from bench.peers import work
from bench.peers.adapters.base import BULK, Adapter as Base, Settings, bin_path

S = Settings.from_env()


def noop(i: int) -> None:
    work.run_sync(i)


class Adapter(Base):
    distributions = ("rq", "redis", "hiredis")
    bulk_way = "Queue.enqueue_many in one pipeline"

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.redis = Redis.from_url(settings.url)
        self.queue = Queue(settings.queue, connection=self.redis)

    def worker_command(self, slot: int) -> list[str]:
        worker_class = ["-w", S.options["worker_class"]] if "worker_class" in S.options else []
        if S.options.get("pool", True):
            return [bin_path("rq"), "worker-pool", "-n", str(self.s.concurrency), "-u", self.s.url,
                    "-l", "WARNING", *worker_class, self.s.queue]
        return [bin_path("rq"), "worker", "-u", self.s.url, "--logging_level", "WARNING", *worker_class,
                self.s.queue]

    async def prefill(self, numbers: range) -> None:
        numbers = list(numbers)
        for start in range(0, len(numbers), BULK):
            with self.redis.pipeline() as pipe:
                jobs = [Queue.prepare_data(noop, (i,), result_ttl=0) for i in numbers[start:start + BULK]]
                self.queue.enqueue_many(jobs, pipeline=pipe)
                pipe.execute()

    async def offer(self, i: int) -> None:
        await asyncio.to_thread(self.queue.enqueue, noop, i, result_ttl=0)

    async def offer_serial(self, numbers: range) -> None:
        def loop() -> None:
            for i in numbers:
                self.queue.enqueue(noop, i, result_ttl=0)
        await asyncio.to_thread(loop)

    async def drained(self) -> bool:
        return self.queue.count == 0 and self.queue.started_job_registry.count == 0

    async def close(self) -> None:
        self.redis.close()

    def options_summary(self) -> dict:
        pool = S.options.get("pool", True)
        return {"worker_pool_size": self.s.concurrency if pool else None,
                "in_flight_per_process": self.s.concurrency if pool else 1,
                "result_ttl": 0, "worker_class": S.options.get("worker_class", "rq.Worker (fork per job)")}
